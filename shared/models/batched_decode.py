"""Batched greedy and speculative decoding: all prompts of a row go through the target together.

The algorithm is the one-prompt loop of ``shared.models.speculative`` (``greedy_generate``,
``speculative_generate``, greedy branch: z-lab/dflash ``dflash/model.py`` ``dflash_generate``), run for every
unfinished prompt of a group at once; every prompt keeps its own sequence, drafts, acceptance and stop, and
the counting (``DecodeResult``: acceptance lengths, drafted tokens, target forwards) is the one-prompt loop's,
so ``summarize`` reads the results as before. Greedy only (temperature 0). Written here, not copied.

Per step, for the ``A`` prompts still decoding:

1. The proposer drafts for all ``A`` rows (``BatchedProposer.propose``: DFlash/DFlash2 one block forward for
   every row, the DFlash2 selector walk per row on the host; EAGLE-3 one chain for every row; prompt lookup
   per row on the CPU). A row's drafts may be shorter than ``k`` (prompt lookup); the verify block is padded
   to the longest with the anchor token, and the padding's logits are never read.
2. One verify forward of ``[A, m + 1]`` tokens, each row at its own positions (``position_ids``), over the
   batched target cache (``BatchedTargetCache``); each row accepts its own ``a`` and produces its own tokens.
3. The columns of a row's rejected drafts are masked out of the cache (the ``attention_mask`` hides them from
   every later query) instead of cropped, since rows accept different counts; the cache is compacted (each
   row's kept columns gathered, right-aligned) once masked columns waste a quarter of it. Rows that reached
   ``max_new_tokens`` or a stop token drop out of the cache and the proposer (``select``).

Each prompt is prefilled alone (the one-prompt loop's own prefill forward: its first token and prompt features
are those bits) and the per-prompt caches are stacked, left-padded, into one ``[A, kv_heads, L, head_dim]`` cache
per layer. Keys hold the RoPE of their true positions, so moving columns is exact; within a row, columns stay
in position order, so the target's causal mask (by column) is the row's causal order.

Exactness: in exact arithmetic every emitted token and acceptance length equals the one-prompt loop's. In
floating point a batched forward rounds differently from a batch-1 forward (other matrix shapes, a padded
attention), as the one-prompt loop's ``k + 1``-token verify forward already does against a one-token step: a
near-tie of the two best logits can flip. ``tests/unit/test_batched_decode.py`` asserts equality with the
one-prompt loop in float32 on the fixture target for every proposer kind.

What is batched (``batch_support``; anything else decodes one prompt at a time, and the caller says why):

* targets whose every cache layer is a plain attention ``DynamicLayer`` (transformers >= 4.56) with ``sdpa``
  or ``eager`` attention; hybrid linear-attention targets (their recurrent states cannot mask out a rejected
  token) and sliding-window layers (their cache keeps the last window of *columns*) are not;
* greedy decoding; sampling (temperature > 0) is not: its draws come from one generator in prompt order, and
  a batch would draw them in another order;
* the proposers ``DFlashProposer``, ``DFlash2Proposer``, ``Eagle3Proposer`` and ``PromptLookupProposer``
  (``batched_proposer``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from specring.shared import envs
from specring.shared.models.batched_dflash_graphs import GraphedDFlash
from specring.shared.models.batched_proposers import (
    BatchedDFlash,
    BatchedEagle3,
    BatchedPromptLookup,
    BatchedProposer,
)
from specring.shared.models.speculative import (
    DecodeResult,
    DFlash2Proposer,
    DFlashProposer,
    Eagle3Proposer,
    SamplingParams,
    _cache_kwarg,
    _check_args,
    _cut_at_stop,
    _device_of,
    _prefill,
    greedy_generate,
    holds_linear_state,
    speculative_generate,
)

_ATTENTION_OK = ("sdpa", "eager")


# ---------------------------------------------------------------------------------------------- support
def _plain_layers(cache) -> str | None:
    """None when every layer of ``cache`` is a plain attention ``DynamicLayer``; else the reason it is not."""
    from transformers import cache_utils
    layers = getattr(cache, "layers", None)
    plain = getattr(cache_utils, "DynamicLayer", None)
    if not isinstance(layers, (list, tuple)) or not layers or plain is None:
        return "the installed transformers has no per-layer cache (DynamicLayer, transformers >= 4.56)"
    if holds_linear_state(cache):
        return "the target has linear-attention layers (their states cannot mask out a rejected draft)"
    kinds = sorted({type(layer).__name__ for layer in layers if type(layer) is not plain})
    if kinds:
        return f"the target's cache has {', '.join(kinds)} layers (batched decoding needs plain attention layers)"
    return None


def target_batch_support(target) -> str | None:
    """None when ``target`` can decode batched (``BatchedTargetCache``), else the reason, one line. Probes the
    cache its layers build with a one-token forward, once per model (remembered on the model)."""
    cached = getattr(target, "_specring_batch_support", False)
    if cached is not False:
        return cached
    impl = getattr(target.config, "_attn_implementation", None) or "eager"
    if impl not in _ATTENTION_OK:
        reason = f"attention implementation {impl!r} (batched decoding needs sdpa or eager)"
    else:
        with torch.no_grad():
            _, _, cache = _prefill(target, [0], None)
        reason = _plain_layers(cache)
    target._specring_batch_support = reason
    return reason


def batch_support(target, proposer=None, sampling: SamplingParams | None = None) -> str | None:
    """None when ``proposer`` (None: plain greedy decoding) decodes batched on ``target`` with ``sampling``;
    else why not (the one-prompt loop runs then)."""
    if sampling is not None and not sampling.greedy:
        return ("sampling (temperature > 0): the draws come from one generator in prompt order, a batch would "
                "draw them in another order")
    if proposer is not None and batched_proposer(proposer) is None:
        return f"proposer {getattr(proposer, 'name', type(proposer).__name__)!r} has no batched form"
    return target_batch_support(target)


# ---------------------------------------------------------------------------------------------- target cache
class BatchedTargetCache:
    """The target's KV cache for ``A`` rows decoding together, per-row lengths kept by a column mask.

    ``cache``: the model's ``DynamicCache`` whose layers hold ``[A, kv_heads, L, head_dim]`` keys and values;
    ``mask``: ``[A, L] bool`` on the target's device, True where column ``l`` of row ``a`` holds a verified
    token of that row. Every row's kept columns are in position order. Built by ``prefill``; ``verify`` appends
    a block to every row, ``keep`` masks out what each row rejected, ``select`` drops finished rows. Raises
    ``ValueError`` from ``prefill`` for a target ``target_batch_support`` refuses.
    """

    def __init__(self, target):
        self.target = target
        self.cache = None
        self.mask: torch.Tensor | None = None
        self.forwards = 0            # batched forwards (prefills counted one per prompt)
        self._block = 0              # columns appended by the last verify

    def prefill(self, prompts: Sequence[Sequence[int]], capture) -> tuple[list[torch.Tensor], list | None]:
        """Prefill each prompt alone (``speculative._prefill``), then stack the caches left-padded. Returns
        ``(last logits [V] float32 per prompt, features [P, n*H] per prompt or None)``."""
        logits, feats, caches = [], [], []
        for p in prompts:
            lg, f, c = _prefill(self.target, [int(t) for t in p], capture)
            reason = _plain_layers(c)
            if reason is not None:
                raise ValueError(f"BatchedTargetCache: {reason}")
            logits.append(lg[-1])
            feats.append(f)
            caches.append(c)
            self.forwards += 1
        lengths = [len(p) for p in prompts]
        width = max(lengths)
        self.cache = caches[0]
        for i, layer in enumerate(self.cache.layers):
            layer.keys = torch.cat([F.pad(c.layers[i].keys, (0, 0, width - n, 0)) for c, n in zip(caches, lengths)])
            layer.values = torch.cat([F.pad(c.layers[i].values, (0, 0, width - n, 0))
                                      for c, n in zip(caches, lengths)])
        dev = _device_of(self.target)
        self.mask = torch.arange(width, device=dev)[None, :] >= torch.tensor([width - n for n in lengths],
                                                                            device=dev)[:, None]
        return logits, (feats if capture is not None else None)

    def verify(self, ids: torch.Tensor, start: torch.Tensor, capture, last_only: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward of ``ids [A, S] long`` at positions ``start[a] ..`` (``start [A] long``) for every row
        over the cache. Returns ``(logits [A, S|1, V] float32, features [A, S, n*H] or None)``; the ``S`` new
        columns count as kept until ``keep``."""
        dev = _device_of(self.target)
        ids, start = ids.to(dev), start.to(dev)
        a, s = ids.shape
        self.mask = torch.cat([self.mask, torch.ones(a, s, dtype=torch.bool, device=dev)], dim=1)
        pos = start[:, None] + torch.arange(s, device=dev)[None, :]
        out = self.target(input_ids=ids, position_ids=pos, attention_mask=self.mask.long(), use_cache=True,
                          logits_to_keep=1 if last_only else 0, **{_cache_kwarg(self.target): self.cache})
        self.forwards += 1
        self._block = s
        feats = None
        if capture is not None:
            feats = torch.cat(capture.outputs(), dim=-1)
            capture.clear()
        return out.logits.float(), feats

    def keep(self, produced: Sequence[int]) -> None:
        """Row ``a`` keeps the first ``produced[a]`` columns of the last verify block (the anchor and its accepted
        drafts); the rest are masked out. Compacts when masked columns waste a quarter of the width."""
        width = self.mask.shape[1]
        dev = self.mask.device
        keep = torch.as_tensor(list(produced), device=dev)
        col = torch.arange(self._block, device=dev)[None, :]
        self.mask[:, width - self._block:] = col < keep[:, None]
        self._maybe_compact()

    def select(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (indices into the current rows, in order): the others finished."""
        rows = list(rows)
        if len(rows) == self.mask.shape[0]:
            return
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.mask.device)
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys.index_select(0, idx), layer.values.index_select(0, idx)
        self.mask = self.mask.index_select(0, idx)
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        if self.mask.shape[0] == 0:
            return
        width = self.mask.shape[1]
        longest = int(self.mask.sum(dim=1).max())
        if width - longest >= max(16, width // 4):
            self.compact()

    def compact(self) -> None:
        """Gather each row's kept columns, right-aligned, into a cache as wide as the longest row."""
        mask = self.mask
        count = mask.sum(dim=1)
        width = int(count.max())
        rank = mask.long().cumsum(dim=1) - 1
        rows, cols = mask.nonzero(as_tuple=True)
        dest = width - count[rows] + rank[rows, cols]
        src = torch.zeros(mask.shape[0], width, dtype=torch.long, device=mask.device)
        src[rows, dest] = cols
        new_mask = torch.zeros(mask.shape[0], width, dtype=torch.bool, device=mask.device)
        new_mask[rows, dest] = True
        for layer in self.cache.layers:
            idx = src[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys, layer.values = layer.keys.gather(2, idx), layer.values.gather(2, idx)
        self.mask = new_mask


# ---------------------------------------------------------------------------------------------- proposers
def batched_proposer(proposer) -> BatchedProposer | None:
    """The batched form of a one-prompt proposer (a new object; the proposer is not changed), or None when it
    has none: ``DFlashProposer`` (DFlash; on CUDA ``GraphedDFlash``, its propose replayed as CUDA graphs, unless
    ``SPECRING_DECODE_GRAPHS=0``), ``DFlash2Proposer``, ``Eagle3Proposer``, ``PromptLookupProposer``,
    by exact class (a subclass may change what a row sees)."""
    from specring.shared.models.ngram import PromptLookupProposer
    if isinstance(proposer, BatchedProposer):
        return proposer
    kind = type(proposer)
    if kind is PromptLookupProposer:
        return BatchedPromptLookup(proposer)
    if kind is DFlashProposer:
        if proposer.drafter.fc.weight.device.type == "cuda" and envs.flag(envs.DECODE_GRAPHS, True):
            return GraphedDFlash(proposer)
        return BatchedDFlash(proposer, selector=False)
    if kind is DFlash2Proposer:
        return BatchedDFlash(proposer, selector=True)
    if kind is Eagle3Proposer:
        return BatchedEagle3(proposer)
    return None


# ---------------------------------------------------------------------------------------------- decoding
@contextlib.contextmanager
def decode_attention_backends():
    """Context manager: cuDNN's SDPA backend off for a decode loop, every other backend as the caller left it
    (``torch.backends.cuda.enable_cudnn_sdp``; the previous setting restored on exit, also on an exception; the
    setting is the process's, as PyTorch keeps it).

    Why: a decode loop calls attention at a new key/value length every step (the cache grows by the accepted
    tokens), and PyTorch's cuDNN SDPA backend builds an execution plan for every new shape on the host. On one
    H200 with the fixture target (``launch.py eval``, the greedy and DFlash rows, bf16, 2026-12-03) that took
    6.2 ms of host time per attention call (the profiler's average), 23.6 s of the run's 31.2 s of host time
    against 0.48 s of GPU time in all (torch profiler; docs/performance.md, "cuDNN attention off in every
    decode"). The other backends (for a masked attention, the memory-efficient kernel) build no plan. On CPU
    nothing changes (cuDNN is a CUDA backend). Raises nothing."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def _share_wall(results: list[DecodeResult], seconds: float) -> None:
    for r in results:
        r.wall_s = seconds / len(results)


@torch.no_grad()
def batched_greedy_generate(target, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                            stop_token_ids: Sequence[int] = (), stats: dict | None = None) -> list[DecodeResult]:
    """``greedy_generate`` of every prompt, all rows through the target together (one token per row and
    forward). Returns one ``DecodeResult`` per prompt, as ``greedy_generate``'s, except ``wall_s``: the group's
    wall time shared equally by its prompts (so ``summarize``'s ``tokens_per_s`` is the group's throughput).
    ``stats`` (a dict): ``batch_forwards`` is increased by the target forwards run (a prefill per prompt, then
    one per step for all rows). Raises ``ValueError`` for an empty prompt list or prompt, ``max_new_tokens < 1``
    or a target whose cache is not plain attention (``BatchedTargetCache.prefill``); check
    ``target_batch_support`` first."""
    if not prompts:
        raise ValueError("prompts: none given")
    for p in prompts:
        _check_args(p, max_new_tokens)
    t0 = time.perf_counter()
    stop = {int(t) for t in stop_token_ids}
    dev = _device_of(target)
    cache = BatchedTargetCache(target)
    first, _ = cache.prefill(prompts, None)
    tokens = [[int(lg.argmax())] for lg in first]
    active = [r for r in range(len(prompts)) if len(tokens[r]) < max_new_tokens and tokens[r][-1] not in stop]
    cache.select(active)
    while active:
        ids = torch.tensor([[tokens[r][-1]] for r in active], dtype=torch.long, device=dev)
        start = torch.tensor([len(prompts[r]) + len(tokens[r]) - 1 for r in active], device=dev)
        logits, _ = cache.verify(ids, start, None, last_only=True)
        for r, t in zip(active, logits[:, -1].argmax(dim=-1).tolist()):
            tokens[r].append(int(t))
        cache.keep([1] * len(active))
        cont = [i for i, r in enumerate(active) if len(tokens[r]) < max_new_tokens and tokens[r][-1] not in stop]
        cache.select(cont)
        active = [active[i] for i in cont]
    res = [DecodeResult(prompt_len=len(p), tokens=t, accept_lengths=[1] * (len(t) - 1), drafted=[0] * (len(t) - 1),
                        target_forwards=len(t), stopped=t[-1] in stop) for p, t in zip(prompts, tokens)]
    if stats is not None:
        stats["batch_forwards"] = stats.get("batch_forwards", 0) + cache.forwards
    _share_wall(res, time.perf_counter() - t0)
    return res


@torch.no_grad()
def batched_speculative_generate(target, proposer, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                                 block_size: int, layer_ids: Sequence[int] | None = None,
                                 stop_token_ids: Sequence[int] = (), stats: dict | None = None
                                 ) -> list[DecodeResult]:
    """Greedy ``speculative_generate`` of every prompt, all rows through the target and the proposer together
    (see the module docstring). ``proposer``: a one-prompt proposer with a batched form (``batched_proposer``)
    or a ``BatchedProposer``; the other arguments as ``speculative_generate``'s. Returns one ``DecodeResult``
    per prompt, as ``speculative_generate``'s (``cache_rollback`` ``crop``: rejected columns masked out),
    except ``wall_s``: the group's wall time shared equally; ``stats`` as ``batched_greedy_generate``'s. Raises
    ``ValueError`` for bad arguments, a proposer without a batched form or a target whose cache is not plain
    attention (``batch_support`` tells beforehand)."""
    from specring.shared.models.target import LayerCapture

    if not prompts:
        raise ValueError("prompts: none given")
    for p in prompts:
        _check_args(p, max_new_tokens)
    if block_size < 1:
        raise ValueError(f"block_size: must be >= 1, got {block_size}")
    batched = batched_proposer(proposer)
    if batched is None:
        raise ValueError(f"proposer {getattr(proposer, 'name', type(proposer).__name__)!r} has no batched form")
    if batched.needs_features and not layer_ids:
        raise ValueError(f"layer_ids: proposer {batched.name!r} needs target features; no layer ids given")
    t0 = time.perf_counter()
    stop = {int(t) for t in stop_token_ids}
    dev = _device_of(target)
    prompts = [[int(t) for t in p] for p in prompts]
    res = [DecodeResult(prompt_len=len(p), tokens=[]) for p in prompts]
    cache = BatchedTargetCache(target)
    capture = LayerCapture(target, list(layer_ids)) if batched.needs_features else None
    with capture if capture is not None else contextlib.nullcontext():
        first, feats = cache.prefill(prompts, capture)
        batched.reset(prompts)
        seqs = []
        for r, (p, lg) in enumerate(zip(prompts, first)):
            seqs.append(p + [int(lg.argmax())])
            res[r].tokens.append(seqs[r][-1])
            res[r].stopped = seqs[r][-1] in stop
            res[r].target_forwards = 1
            res[r].cache_rollback = "crop"
        if feats is not None:
            batched.add_context(feats, [0] * len(prompts))
        active = [r for r in range(len(prompts)) if not res[r].stopped and len(res[r].tokens) <= max_new_tokens]
        cache.select(active)
        batched.select(active)
        k = block_size - 1
        while active:
            drafts = [[int(t) for t in d][:k] for d in batched.propose([seqs[r] for r in active], k)]
            m = max(len(d) for d in drafts)
            ids = torch.tensor([[seqs[r][-1]] + d + [seqs[r][-1]] * (m - len(d)) for r, d in zip(active, drafts)],
                               dtype=torch.long, device=dev)
            anchor_pos = [len(seqs[r]) - 1 for r in active]
            logits, vfeats = cache.verify(ids, torch.tensor(anchor_pos, device=dev), capture)
            greedy = logits.argmax(dim=-1).tolist()
            produced, cont = [], []
            for i, (r, d) in enumerate(zip(active, drafts)):
                a = 0
                while a < len(d) and d[a] == greedy[i][a]:
                    a += 1
                new, res[r].stopped = _cut_at_stop(d[:a] + [greedy[i][a]], stop)
                produced.append(len(new))
                seqs[r] += new
                res[r].tokens += new
                res[r].accept_lengths.append(a + 1)
                res[r].drafted.append(len(d))
                res[r].target_forwards += 1
                if not res[r].stopped and len(res[r].tokens) <= max_new_tokens:
                    cont.append(i)
            cache.keep(produced)
            cache.select(cont)
            batched.select(cont)
            if vfeats is not None and cont:
                batched.add_context([vfeats[i, :produced[i]] for i in cont], [anchor_pos[i] for i in cont])
            active = [active[i] for i in cont]
    for r in res:
        r.tokens = r.tokens[:max_new_tokens]
        r.stopped = bool(r.tokens) and r.tokens[-1] in stop
    if stats is not None:
        stats["batch_forwards"] = stats.get("batch_forwards", 0) + cache.forwards
    _share_wall(res, time.perf_counter() - t0)
    return res


def decode_prompts(target, proposer, prompts: Sequence[Sequence[int]], max_new_tokens: int, block_size: int,
                   layer_ids: Sequence[int] | None = None, stop_token_ids: Sequence[int] = (), *,
                   batch_size: int = 1, sampling: SamplingParams | None = None,
                   generator: torch.Generator | None = None,
                   on_done: Callable[[int], None] | None = None) -> tuple[list[DecodeResult], dict[str, Any]]:
    """Decode ``prompts`` in groups of ``batch_size`` (``batched_speculative_generate``; ``proposer`` None:
    ``batched_greedy_generate``), or one at a time (``speculative_generate`` / ``greedy_generate``) when
    ``batch_size`` is 1 or ``batch_support`` refuses (sampling, a hybrid target, a proposer without a batched
    form). ``on_done(n)`` is called after every ``n`` prompts finished. Returns ``(results in prompt order,
    info)``: ``info["batched"]`` bool, ``info["batch_size"]`` the prompts decoded together (1 when not
    batched), ``info["batched_reason"]`` why not (None when batched or ``batch_size`` 1 was asked),
    ``info["batch_forwards"]`` the target forwards run (batched: one per verify step of a group plus one
    prefill per prompt; one prompt at a time: the sum of ``target_forwards``). Raises ``ValueError`` for
    ``batch_size < 1`` and what the decode functions raise. Every forward runs under
    ``decode_attention_backends`` (no cuDNN attention: it plans every new key/value length on the host)."""
    if int(batch_size) < 1:
        raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
    with decode_attention_backends():
        return _decode_prompts(target, proposer, prompts, max_new_tokens, block_size, layer_ids, stop_token_ids,
                               int(batch_size), sampling, generator, on_done)


def _decode_prompts(target, proposer, prompts, max_new_tokens, block_size, layer_ids, stop_token_ids, batch_size,
                    sampling, generator, on_done):
    reason = None if int(batch_size) == 1 else batch_support(target, proposer, sampling)
    results: list[DecodeResult] = []
    if int(batch_size) == 1 or reason is not None:
        sampled = sampling is not None and not sampling.greedy
        for p in prompts:
            if proposer is None:
                if sampled:
                    from specring.shared.models.speculative import sample_generate
                    results.append(sample_generate(target, p, max_new_tokens, sampling, generator, stop_token_ids))
                else:
                    results.append(greedy_generate(target, p, max_new_tokens, stop_token_ids))
            else:
                results.append(speculative_generate(target, proposer, p, max_new_tokens, block_size, layer_ids,
                                                    stop_token_ids, sampling=sampling if sampled else None,
                                                    generator=generator))
            if on_done is not None:
                on_done(1)
        return results, {"batched": False, "batch_size": 1, "batched_reason": reason,
                         "batch_forwards": sum(r.target_forwards for r in results)}
    stats: dict[str, int] = {}
    n = int(batch_size)
    for lo in range(0, len(prompts), n):
        group = list(prompts[lo:lo + n])
        if proposer is None:
            results += batched_greedy_generate(target, group, max_new_tokens, stop_token_ids, stats)
        else:
            results += batched_speculative_generate(target, proposer, group, max_new_tokens, block_size, layer_ids,
                                                    stop_token_ids, stats)
        if on_done is not None:
            on_done(len(group))
    return results, {"batched": True, "batch_size": min(n, len(prompts)), "batched_reason": None,
                     "batch_forwards": stats.get("batch_forwards", 0)}
