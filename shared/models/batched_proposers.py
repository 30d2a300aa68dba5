"""The batched proposers of the batched decode loop (``shared.models.batched_decode``): what a proposer does for
the ``A`` prompts of a group at once, one object per proposer kind behind ``BatchedProposer``.

* ``BatchedPromptLookup``: ``PromptLookupProposer`` per row, on the CPU;
* ``BatchedDFlash``: DFlash and DFlash2 (``selector=True``: the DFlash2 selector walk per row on the host), one
  block forward for every row over a per-row context cache (``_ContextCache``);
* ``BatchedEagle3``: EAGLE-3, one draft chain for every row.

``shared.models.batched_dflash_graphs`` builds the CUDA-graph DFlash propose on ``BatchedDFlash``;
``batched_decode.batched_proposer`` picks the batched form of a one-prompt proposer. The algorithms are those of
the one-prompt proposers in ``shared.models.speculative`` (z-lab/dflash ``dflash/model.py``), written here, not
copied.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

_ATTN_SCORE_BUDGET = 1 << 27   # float32 scores alive at once in a batched EAGLE-3 context extension


class BatchedProposer:
    """What the batched loop asks of a proposer, for the ``A`` rows decoding (row ``a`` = slot ``a``).

    ``reset(prompts)`` starts ``len(prompts)`` rows; ``add_context(features, starts)`` queues, per row, the
    verified context ``features[a] [C_a, n*H]`` at positions ``starts[a] .. starts[a] + C_a - 1`` (contiguous:
    every position before the row's next anchor, each once); ``propose(seqs, k)`` returns up to ``k`` drafts
    per row (``seqs[a]``: prompt and generated tokens, its last entry the anchor); ``select(rows)`` keeps only
    those rows (indices into the current ones, in order).
    """

    needs_features = True
    name = "batched"

    def reset(self, prompts: Sequence[Sequence[int]]) -> None:
        raise NotImplementedError

    def add_context(self, features: list[torch.Tensor], starts: list[int]) -> None:
        raise NotImplementedError

    def propose(self, seqs: list[list[int]], k: int) -> list[list[int]]:
        raise NotImplementedError

    def select(self, rows: Sequence[int]) -> None:
        raise NotImplementedError


class BatchedPromptLookup(BatchedProposer):
    """``PromptLookupProposer`` per row (stateless, on the CPU)."""

    needs_features = False

    def __init__(self, proposer):
        self.proposer = proposer
        self.name = proposer.name

    def reset(self, prompts):
        pass

    def add_context(self, features, starts):
        pass

    def propose(self, seqs, k):
        return [self.proposer.propose(s, k) for s in seqs]

    def select(self, rows):
        pass


class _ContextCache:
    """Per-layer keys/values of ``A`` rows' verified context, ``[A, kv_heads, capacity, head_dim]`` each (the
    slot of position ``p`` is column ``p``: a row's context is positions ``0 .. length - 1``), ``lengths [A]``
    long on the device; capacity grows by doubling."""

    def __init__(self, layers: int, rows: int, kv_heads: int, head_dim: int, dtype, device):
        self.keys = [torch.zeros(rows, kv_heads, 0, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [k.clone() for k in self.keys]
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)

    def reserve(self, width: int) -> None:
        cap = self.keys[0].shape[2] if self.keys else 0
        if width <= cap:
            return
        grow = max(width, 2 * cap, 64) - cap
        self.keys = [F.pad(k, (0, 0, 0, grow)) for k in self.keys]
        self.values = [F.pad(v, (0, 0, 0, grow)) for v in self.values]

    def write(self, layer: int, rows: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Context entries ``k, v [kv_heads, N, head_dim]`` of rows ``rows [N]`` at positions ``pos [N]``."""
        self.keys[layer][rows, :, pos] = k.transpose(0, 1).to(self.keys[layer].dtype)
        self.values[layer][rows, :, pos] = v.transpose(0, 1).to(self.values[layer].dtype)

    def select(self, rows: torch.Tensor) -> None:
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]
        self.lengths = self.lengths.index_select(0, rows)


class _FeatureRows(BatchedProposer):
    """Queued context of feature proposers: ``(features, starts)`` per row until the next ``propose``."""

    needs_features = True

    def reset(self, prompts):
        self.rows = len(prompts)
        self.cache: _ContextCache | None = None
        self._pending: list[list[tuple[torch.Tensor, int]]] = [[] for _ in range(self.rows)]

    def add_context(self, features, starts):
        if len(features) != len(self._pending):
            raise ValueError(f"{type(self).__name__}.add_context: {len(features)} rows of context for "
                             f"{len(self._pending)} rows")
        for queue, f, s in zip(self._pending, features, starts):
            if f is None:
                raise ValueError(f"{type(self).__name__}.add_context: the drafter needs target features (got None)")
            queue.append((f, int(s)))

    def select(self, rows):
        rows = list(rows)
        self._pending = [self._pending[r] for r in rows]
        if self.cache is not None:
            self.cache.select(torch.as_tensor(rows, dtype=torch.long, device=self.cache.lengths.device))

    def _take_pending(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]] | None:
        """The queued context of every row, packed: ``(features [N, F], rows [N], positions [N], counts [A])``
        on ``device``; None when nothing is queued. Raises ``ValueError`` when a row's context does not
        continue at its cache length."""
        feats, rows, pos, counts = [], [], [], []
        lengths = self.cache.lengths.tolist() if self.cache is not None else [0] * len(self._pending)
        for r, queue in enumerate(self._pending):
            n_row = 0
            for f, s in queue:
                if s != lengths[r] + n_row:
                    raise ValueError(f"{type(self).__name__}: row {r}'s context at position {s} does not continue "
                                     f"its cache of {lengths[r] + n_row} positions")
                feats.append(f)
                n = f.shape[0]
                rows.extend([r] * n)  # built on the host, one copy each: no operator per row in the decode loop
                pos.extend(range(s, s + n))
                n_row += n
            counts.append(n_row)
        self._pending = [[] for _ in self._pending]
        if not feats:
            return None
        return (torch.cat(feats).to(device), torch.tensor(rows, dtype=torch.long, device=device),
                torch.tensor(pos, dtype=torch.long, device=device), counts)


class BatchedDFlash(_FeatureRows):
    """DFlash and DFlash2 drafting for every row at once: the new context of all rows projected together into
    a per-row context cache, then one forward of ``A`` blocks ``[anchor, MASK x k]`` (the drafter's layers in
    their batched inference form, ``DFlashAttention``; each block sees its row's context and itself, sliding
    layers their window, causal layers their causal block), exactly the computation of
    ``DFlashDrafter.draft_block_hidden`` per row. DFlash drafts each slot's argmax; DFlash2 (``selector``)
    walks its candidate selector per row (``CandidateSelector.select``, as ``DFlash2Drafter.propose_block``)."""

    def __init__(self, proposer, selector: bool):
        self.drafter = proposer.drafter
        self.block_size = int(proposer.block_size)
        self.selector = bool(selector)
        self.name = proposer.name

    def _feed(self) -> None:
        d = self.drafter
        dev = d.fc.weight.device
        cfg = d.config
        if self.cache is None:
            self.cache = _ContextCache(len(d.layers), len(self._pending), cfg.num_key_value_heads, cfg.head_dim,
                                       d._compute_dtype(), dev)
        packed = self._take_pending(dev)
        if packed is None:
            return
        feats, rows, pos, counts = packed
        self.cache.reserve(int((self.cache.lengths + torch.as_tensor(counts, device=dev)).max()))
        ctx = d.project_context(feats)
        cos, sin = d._rope(pos)
        for i, layer in enumerate(d.layers):
            k, v = layer.self_attn.project_kv(ctx, cos, sin)
            self.cache.write(i, rows, pos, k, v)
        self.cache.lengths += torch.as_tensor(counts, device=dev)

    def _masks(self, pos: torch.Tensor, width: int) -> dict[str, torch.Tensor]:
        """``{layer_type: [A, b, width + b] bool}`` for blocks at ``pos [A, b]`` (``_inference_masks`` per row,
        plus the padding of each row's context)."""
        a, b = pos.shape
        dev = pos.device
        col = torch.arange(width, device=dev)
        valid = (col[None, :] < self.cache.lengths[:, None])[:, None, :].expand(a, b, width)
        out = {}
        for t, v in self.drafter.config.attention_variants().items():
            ctx = valid
            if v["window"] is not None:
                ctx = ctx & ((pos[:, :, None] - col[None, None, :]) < v["window"])
            own = torch.ones(b, b, dtype=torch.bool, device=dev)
            if v["causal"]:
                own = own.tril()
            out[t] = torch.cat([ctx, own[None].expand(a, b, b)], dim=2)
        return out

    def _block_width(self, k) -> int:
        """The width ``b = k + 1`` of a block proposing ``k`` drafts (``k`` capped at ``block_size - 1``); 1 when
        there is nothing to propose. Raises ``ValueError`` for a block wider than a sliding window."""
        b = min(int(k), self.block_size - 1) + 1
        w = self.drafter.config.sliding_window
        if b > 1 and w is not None and "sliding_attention" in self.drafter.config.resolved_layer_types() and b > w:
            raise ValueError(f"block_size: {b} > sliding_window {w}")
        return b

    @torch.no_grad()
    def propose(self, seqs, k):
        b = self._block_width(k)
        if b <= 1:
            return [[] for _ in seqs]
        d = self.drafter
        cfg = d.config
        self._feed()
        dev = d.fc.weight.device
        anchor_pos = torch.tensor([len(s) - 1 for s in seqs], device=dev)
        if not torch.equal(self.cache.lengths, anchor_pos):
            raise ValueError("BatchedDFlash.propose: the context cache must hold every position before each "
                             f"anchor (lengths {self.cache.lengths.tolist()}, anchors at {anchor_pos.tolist()})")
        a = len(seqs)
        anchors = [int(s[-1]) for s in seqs]
        ids = torch.full((a, b), cfg.mask_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = torch.tensor(anchors, device=dev)
        pos = anchor_pos[:, None] + torch.arange(b, device=dev)[None, :]
        width = int(self.cache.lengths.max())
        masks = self._masks(pos, width)
        x = d.embed(ids.reshape(-1))
        cos, sin = d._rope(pos.reshape(-1))
        for i, layer in enumerate(d.layers):
            ctx_kv = (self.cache.keys[i][:, :, :width], self.cache.values[i][:, :, :width])
            x = layer(x, ctx_kv, cos, sin, masks[layer.layer_type], None, b)
        hidden = d.norm(x)
        logits = d.logits(hidden).float().view(a, b, -1)
        if not self.selector:
            return logits[:, 1:].argmax(dim=-1).tolist()
        hidden = hidden.view(a, b, -1)
        out = []
        for r in range(a):
            path, _, _ = d.candidate_selector.select(hidden[r, 1:], logits[r, 1:], anchors[r])
            out.append([int(t) for t in path.tolist()])
        return out


class BatchedEagle3(_FeatureRows):
    """EAGLE-3 chain drafting for every row at once: step 0 over every row's new verified context (the
    computation of ``eagle3_extend`` per row: each new position attends causally to its row's context), then
    the chain (``eagle3_chain`` per row: step ``j`` of row ``a`` at position ``last_a + j`` attends to row
    ``a``'s context and to its own chain keys), ``A`` rows per forward. The attention is
    ``eagle3_attention``'s (one float32 softmax over the context scores and the chain's own keys) with a
    batch dimension and each row's context padding masked."""

    def __init__(self, proposer):
        self.drafter = proposer.drafter
        self.num_draft_tokens = int(proposer.num_draft_tokens)
        self.name = proposer.name

    def reset(self, prompts):
        super().reset(prompts)
        self.h_last: torch.Tensor | None = None     # [A, H]: step-0 output of each row's last context position

    def select(self, rows):
        super().select(rows)
        if self.h_last is not None:
            self.h_last = self.h_last.index_select(0, torch.as_tensor(list(rows), dtype=torch.long,
                                                                      device=self.h_last.device))

    @staticmethod
    def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                diag_k: list[torch.Tensor], diag_v: list[torch.Tensor]) -> torch.Tensor:
        """``eagle3_attention`` with a batch dimension: ``q [A, Hq, T, D]`` over ``keys/values [A, Hkv, C, D]``
        where ``mask [A, T, C]`` allows, plus per later chain step the one key ``diag_k[i] [A, Hkv, T, D]`` of
        the query's own position; one float32 softmax. Returns ``[A, Hq, T, D]`` in ``q``'s dtype."""
        a, hq, t, d = q.shape
        hkv = keys.shape[1]
        g = hq // hkv
        scale = d ** -0.5
        qg = q.reshape(a, hkv, g, t, d).float()
        s0 = torch.einsum("ahgtd,ahsd->ahgts", qg, keys.float()) * scale
        s0 = s0.masked_fill(~mask[:, None, None], float("-inf"))
        sd = [torch.einsum("ahgtd,ahtd->ahgt", qg, kd.float())[..., None] * scale for kd in diag_k]
        p = torch.softmax(torch.cat([s0] + sd, dim=-1), dim=-1)
        c = keys.shape[2]
        out = torch.einsum("ahgts,ahsd->ahgtd", p[..., :c], values.float())
        for i, vd in enumerate(diag_v):
            out = out + p[..., c + i, None] * vd.float()[:, :, None]
        return out.reshape(a, hq, t, d).to(q.dtype)

    def _extend(self, seqs: list[list[int]]) -> None:
        d = self.drafter
        dev = d.fc.weight.device
        cfg = d.config
        if self.cache is None:
            self.cache = _ContextCache(1, len(self._pending), cfg.num_key_value_heads, cfg.head_dim, d._dtype(), dev)
        packed = self._take_pending(dev)
        if packed is None:
            return
        feats, rows, pos, counts = packed
        rows_h, pos_h = rows.tolist(), pos.tolist()
        nxt = torch.tensor([seqs[r][p + 1] for r, p in zip(rows_h, pos_h)], dtype=torch.long, device=dev)
        old = self.cache.lengths.clone()
        new_len = old + torch.as_tensor(counts, device=dev)
        self.cache.reserve(int(new_len.max()))
        h = d.fuse(feats)
        cos, sin = d.rope(pos)
        q, k, v = d.midlayer.qkv(d.embed(nxt), h, cos, sin)      # [Hq, N, D], [Hkv, N, D]
        self.cache.write(0, rows, pos, k, v)
        self.cache.lengths = new_len
        # queries padded per row: [A, Hq, T, D], T = the most new positions of a row
        a = len(counts)
        t = max(counts)
        first = torch.tensor([0] + counts[:-1], device=dev).cumsum(0)
        slot = torch.arange(rows.shape[0], device=dev) - first[rows]          # index inside its row's new block
        attn_packed = torch.empty_like(q)
        width = int(new_len.max())
        hq = q.shape[0]
        chunk = max(1, _ATTN_SCORE_BUDGET // max(1, hq * t * width))
        col = torch.arange(width, device=dev)
        for lo in range(0, a, chunk):
            hi = min(a, lo + chunk)
            sel = (rows >= lo) & (rows < hi)
            qp = torch.zeros(hi - lo, hq, t, q.shape[2], dtype=q.dtype, device=dev)
            qp[rows[sel] - lo, :, slot[sel]] = q[:, sel].transpose(0, 1)
            qpos = old[lo:hi, None] + torch.arange(t, device=dev)[None, :]                        # [a, T]
            mask = (col[None, None, :] <= qpos[:, :, None]) & (col[None, None, :] < new_len[lo:hi, None, None])
            mask[:, :, 0] = True            # padded queries see column 0 (no row of -inf; never read)
            out = self._attend(qp, self.cache.keys[0][lo:hi, :, :width], self.cache.values[0][lo:hi, :, :width],
                               mask, [], [])
            attn_packed[:, sel] = out[rows[sel] - lo, :, slot[sel]].transpose(0, 1)
        out = d.midlayer.finish(h, attn_packed)                    # [N, H]
        last = first + torch.as_tensor(counts, device=dev) - 1
        h_new = out[last.clamp_min(0)]
        has = torch.as_tensor(counts, device=dev) > 0
        if self.h_last is None:
            self.h_last = torch.zeros_like(h_new)
        self.h_last = torch.where(has[:, None], h_new, self.h_last)

    @torch.no_grad()
    def propose(self, seqs, k):
        from specring.shared.models.eagle3 import draft_to_target
        k = min(int(k), self.num_draft_tokens)
        fresh = [bool(queue) for queue in self._pending]
        if k <= 0 or not any(fresh):
            return [[] for _ in seqs]
        self._extend(seqs)
        d = self.drafter
        dev = d.fc.weight.device
        d2t_full = draft_to_target(d.d2t)
        a = len(seqs)
        h = self.h_last
        last = self.cache.lengths - 1
        width = int(self.cache.lengths.max())
        keys, values = self.cache.keys[0][:, :, :width], self.cache.values[0][:, :, :width]
        mask = (torch.arange(width, device=dev)[None, :] < self.cache.lengths[:, None])[:, None, :]   # [A, 1, C]
        token = d2t_full[d.logits(h).argmax(dim=-1)]
        out = [token]
        dk: list[torch.Tensor] = []
        dv: list[torch.Tensor] = []
        for j in range(1, k):
            cos, sin = d.rope(last + j)
            q, kk, vv = d.midlayer.qkv(d.embed(token), h, cos, sin)     # [Hq, A, D], [Hkv, A, D]
            dk.append(kk.transpose(0, 1)[:, :, None])
            dv.append(vv.transpose(0, 1)[:, :, None])
            attn = self._attend(q.transpose(0, 1)[:, :, None], keys, values, mask, dk, dv)   # [A, Hq, 1, D]
            h = d.midlayer.finish(h, attn[:, :, 0].transpose(0, 1))
            token = d2t_full[d.logits(h).argmax(dim=-1)]
            out.append(token)
        drafts = torch.stack(out, dim=1).tolist()
        return [drafts[r] if fresh[r] else [] for r in range(a)]
