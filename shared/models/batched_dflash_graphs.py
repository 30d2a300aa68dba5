"""The batched DFlash ``propose`` over static buffers, replayed as CUDA graphs (``launch.py eval``'s decode loop).

On a small target the batched decode is bound by kernel launches, not by the GPU: the fixture's 5-layer drafter
dispatches about 570 operators per cycle in ``BatchedDFlash.propose`` (its context feed and its block forward),
close to the 8-layer target's verify (docs/evaluation.md, "What a decode cycle dispatches"), so the drafter's
cycle costs as much as the verify it saves. ``GraphedDFlash`` computes what ``BatchedDFlash`` computes, with every
shape fixed for a group of prompts, so that the feed and the block forward are each one ``torch.cuda.CUDAGraph``
replay per cycle (PyTorch's CUDA graphs, ``torch.cuda.graph``; the technique serving engines use for their decode
steps; written here, not copied):

* rows never move: a finished row stays in the buffers and its drafts are not read; the live rows are a list of
  physical row indices (``select`` edits the list, no tensor is re-indexed);
* the context cache (``[R, kv_heads, capacity, head_dim]`` per draft layer) has a fixed capacity (twice the
  prompts' at first), grown by doubling, which re-captures; every block attends over the whole capacity under
  the mask of its row's length (``BatchedDFlash._masks``: the same padding rule), so the block forward's shapes
  do not change as the context grows;
* the feed of new verified context pads its entries to ``R × block_size`` with writes to a scratch column (the
  cache's last, never inside a row's length); the first feed (the prompts, longer than that) runs eagerly.

The graphs are captured lazily, one per (kind, block width, capacity) and group (``reset``); a capture costs
one warm-up run and one recorded run. On CPU, or with ``graphs=False``, the same static code runs eagerly: the
tests compare its drafts with ``BatchedDFlash``'s (``tests/unit/test_batched_dflash_graphs.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specring.shared.models.batched_proposers import BatchedDFlash, _ContextCache

_CAP_ROUND = 64  # the cache capacity is a multiple of this many columns


class GraphedDFlash(BatchedDFlash):
    """``BatchedDFlash`` for DFlash (no selector) over static buffers; ``graphs``: replay CUDA graphs (default:
    when the drafter is on a CUDA device). Drafts equal ``BatchedDFlash``'s up to floating-point rounding (the
    block attends over masked padding columns, the feed's matrices have padded rows). Raises ``ValueError`` for
    ``graphs=True`` off CUDA, and what ``BatchedDFlash.propose`` raises (a block wider than a sliding window,
    context that does not end at each anchor)."""

    def __init__(self, proposer, graphs: bool | None = None):
        super().__init__(proposer, selector=False)
        dev = self.drafter.fc.weight.device
        self.graphs = dev.type == "cuda" if graphs is None else bool(graphs)
        if self.graphs and dev.type != "cuda":
            raise ValueError(f"GraphedDFlash: graphs=True needs a CUDA drafter (it is on {dev})")

    def reset(self, prompts):
        super().reset(prompts)
        self.phys = list(range(self.rows))      # live row i is physical row phys[i]
        self.lengths_host = [0] * self.rows     # context length of each physical row (the device copy in cache)
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor | None]] = {}
        self._feed_buf: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._block_buf: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.captures = 0

    def select(self, rows):
        rows = list(rows)
        self._pending = [self._pending[r] for r in rows]
        self.phys = [self.phys[r] for r in rows]

    # ---------------------------------------------------------------------------------------- buffers
    @property
    def capacity(self) -> int:
        return self.cache.keys[0].shape[2] if self.cache is not None and self.cache.keys else 0

    def _ensure_capacity(self, need: int) -> None:
        """Columns for ``need`` positions plus the scratch column; growing re-allocates and drops the graphs."""
        d = self.drafter
        if self.cache is None:
            cfg = d.config
            self.cache = _ContextCache(len(d.layers), self.rows, cfg.num_key_value_heads, cfg.head_dim,
                                       d._compute_dtype(), d.fc.weight.device)
        cap = self.capacity
        if need + 1 <= cap:
            return
        new = max(2 * (need + 1) if cap == 0 else need + 1, 2 * cap, _CAP_ROUND)  # the first: room to grow
        new = -(-new // _CAP_ROUND) * _CAP_ROUND
        self.cache.reserve(new)  # pads every layer to exactly ``new`` columns (new > 2 * cap or = 2 * cap)
        if self.capacity != new:
            raise RuntimeError(f"GraphedDFlash: cache capacity {self.capacity}, expected {new}")
        self._graphs.clear()

    def _run(self, key: tuple, fn: Callable[[], torch.Tensor | None]) -> torch.Tensor | None:
        """``fn()`` eagerly, or (graphs) the replay of its graph, captured at the first call of ``key``."""
        if not self.graphs:
            return fn()
        hit = self._graphs.get(key)
        if hit is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()  # warm-up: lazy initialisation and the allocator outside the capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):  # a private memory pool per graph
                out = fn()
            hit = self._graphs[key] = (graph, out)
            self.captures += 1
        hit[0].replay()
        return hit[1]

    # ---------------------------------------------------------------------------------------- context feed
    def _feed(self) -> None:
        d = self.drafter
        dev = d.fc.weight.device
        feats, counts = self._take_pending_host()
        if feats is None:
            return
        rows, pos = [], []
        for p, c in zip(self.phys, counts):
            rows.extend([p] * c)
            pos.extend(range(self.lengths_host[p], self.lengths_host[p] + c))
        first = self.cache is None
        self._ensure_capacity(max(self.lengths_host[p] + c for p, c in zip(self.phys, counts)))
        slots = self.rows * self.block_size
        n = feats.shape[0]
        if first or n > slots:
            ctx = d.project_context(feats.to(dev))
            rows_t = torch.tensor(rows, dtype=torch.long, device=dev)
            pos_t = torch.tensor(pos, dtype=torch.long, device=dev)
            cos, sin = d._rope(pos_t)
            for i, layer in enumerate(d.layers):
                k, v = layer.self_attn.project_kv(ctx, cos, sin)
                self.cache.write(i, rows_t, pos_t, k, v)
        else:
            if self._feed_buf is None or self._feed_buf[0].shape[1] != feats.shape[1]:
                self._feed_buf = (torch.zeros(slots, feats.shape[1], dtype=feats.dtype, device=dev),
                                  torch.zeros(slots, dtype=torch.long, device=dev),
                                  torch.zeros(slots, dtype=torch.long, device=dev))
                self._graphs = {k: g for k, g in self._graphs.items() if k[0] != "feed"}
            fbuf, rbuf, pbuf = self._feed_buf
            scratch = self.capacity - 1
            fbuf[:n].copy_(feats)
            rbuf.copy_(torch.tensor(rows + [0] * (slots - n), dtype=torch.long))
            pbuf.copy_(torch.tensor(pos + [scratch] * (slots - n), dtype=torch.long))
            self._run(("feed", feats.shape[1], self.capacity), self._feed_static)
        for p, c in zip(self.phys, counts):
            self.lengths_host[p] += c
        self.cache.lengths.copy_(torch.tensor(self.lengths_host, dtype=torch.long))

    def _take_pending_host(self) -> tuple[torch.Tensor | None, list[int]]:
        """The queued context of every live row in row order, ``(features [N, F] or None, counts [A])``; raises
        ``ValueError`` when a row's context does not continue at its length."""
        feats, counts = [], []
        for i, (p, queue) in enumerate(zip(self.phys, self._pending)):
            n_row = 0
            for f, s in queue:
                if s != self.lengths_host[p] + n_row:
                    raise ValueError(f"{type(self).__name__}: row {i}'s context at position {s} does not continue "
                                     f"its cache of {self.lengths_host[p] + n_row} positions")
                feats.append(f)
                n_row += f.shape[0]
            counts.append(n_row)
        self._pending = [[] for _ in self._pending]
        if not feats:
            return None, counts
        return torch.cat(feats), counts

    def _feed_static(self) -> None:
        d = self.drafter
        fbuf, rbuf, pbuf = self._feed_buf
        ctx = d.project_context(fbuf)
        cos, sin = d._rope(pbuf)
        for i, layer in enumerate(d.layers):
            k, v = layer.self_attn.project_kv(ctx, cos, sin)
            self.cache.write(i, rbuf, pbuf, k, v)
        return None

    # ---------------------------------------------------------------------------------------- block forward
    def _block_static(self, b: int) -> torch.Tensor:
        d = self.drafter
        ids, pos = self._block_buf[b]
        masks = self._masks(pos, self.capacity)
        x = d.embed(ids.reshape(-1))
        cos, sin = d._rope(pos.reshape(-1))
        for i, layer in enumerate(d.layers):
            x = layer(x, (self.cache.keys[i], self.cache.values[i]), cos, sin, masks[layer.layer_type], None, b)
        logits = d.logits(d.norm(x)).float().view(self.rows, b, -1)
        return logits[:, 1:].argmax(dim=-1)

    @torch.no_grad()
    def propose(self, seqs, k):
        b = self._block_width(k)
        if b <= 1:
            return [[] for _ in seqs]
        k = b - 1
        d = self.drafter
        cfg = d.config
        if len(seqs) != len(self.phys):
            raise ValueError(f"GraphedDFlash.propose: {len(seqs)} sequences for {len(self.phys)} live rows")
        self._feed()
        lengths = [self.lengths_host[p] for p in self.phys]
        anchors_at = [len(s) - 1 for s in seqs]
        if lengths != anchors_at:
            raise ValueError("GraphedDFlash.propose: the context cache must hold every position before each "
                             f"anchor (lengths {lengths}, anchors at {anchors_at})")
        dev = d.fc.weight.device
        if b not in self._block_buf:
            self._block_buf[b] = (torch.zeros(self.rows, b, dtype=torch.long, device=dev),
                                  torch.zeros(self.rows, b, dtype=torch.long, device=dev))
        mask = int(cfg.mask_token_id)
        ids = [[mask] * b for _ in range(self.rows)]
        pos = [[self.lengths_host[p] + j for j in range(b)] for p in range(self.rows)]
        for p, s in zip(self.phys, seqs):
            ids[p][0] = int(s[-1])
        ibuf, pbuf = self._block_buf[b]
        ibuf.copy_(torch.tensor(ids, dtype=torch.long))
        pbuf.copy_(torch.tensor(pos, dtype=torch.long))
        out = self._run(("block", b, self.capacity), lambda: self._block_static(b)).tolist()
        return [out[p][:k] for p in self.phys]
