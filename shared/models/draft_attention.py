"""The DFlash attention pattern and the three forms that compute it.

A draft token of the block anchored at packed position ``p`` sees the context of its own sequence strictly
before ``p`` (never the anchor's own target state) and every token of its own block; nothing else
(DFlash paper, training section; SpecForge ``specforge/core/dflash.py``). Forms:

* dense: ``build_attention_mask`` ``[Q, C+Q]`` into ``scaled_dot_product_attention``;
* structured: ``build_context_mask`` ``[Q, C]`` plus the own block implicit, ``block_attention``;
* flex: ``build_flex_mask``, a block-sparse ``flex_attention`` mask (the CUDA training form).

Two optional restrictions, the attention variants of z-lab/dflash ``dflash/model.py`` (``layer_types``,
``sliding_window``, ``is_causal`` of ``Qwen3DFlashAttention``; commit 10129599dffb338ff38cfd235a53ca6d3667b4dd,
read, not copied), taken by every builder as keywords (defaults: today's pattern, unchanged):

* ``window=W`` (a ``"sliding_attention"`` layer): the draft token in slot ``j`` of the block anchored at ``p``
  sits at sequence position ``P = pos(p) + j``; it sees context position ``c`` only if also ``P - c < W``. Only
  the context is windowed: inside a block every distance is ``<= B - 1``, so with ``W >= B`` (which
  ``DFlashConfig`` requires) the reference's in-block window never removes anything.
* ``causal=True`` (``is_causal``): inside a block slot ``j`` sees slots ``<= j`` only (the context rule is
  unchanged). The structured form's context mask has no in-block part: there causality is
  ``block_attention(causal=True)``, which the drafter takes from its config.

The masks a drafter's forward wants, one per layer type, come from ``shared.models.dflash.layer_masks``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def seq_index(cu_seqlens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Sequence index ``[N] long`` of global packed ``positions [N]`` given ``cu_seqlens [S+1]``."""
    cu = cu_seqlens.to(device=positions.device, dtype=torch.long)
    return torch.searchsorted(cu[1:], positions.long(), right=True)


def check_window(window: int | None) -> int | None:
    """``window`` as an int (None: no window). Raises ``ValueError`` naming ``window`` unless it is None or an
    integer ``>= 1``."""
    if window is None:
        return None
    if isinstance(window, bool) or int(window) != window or int(window) < 1:
        raise ValueError(f"window: must be None or an integer >= 1, got {window!r}")
    return int(window)


def build_context_mask(anchors: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int, *,
                       window: int | None = None, causal: bool = False) -> torch.Tensor:
    """``[Q, T] bool``: the context part of the DFlash mask (True = may attend).

    Row ``q`` belongs to block ``q // B``; it sees packed context position ``c`` iff ``c`` is in its
    block's sequence and ``c < anchor`` (never the anchor's own target state, nothing of another
    sequence), and with ``window=W`` also ``anchor + q % B - c < W`` (packed distances equal in-sequence
    ones inside a sequence). Each block also sees its own ``B`` draft tokens (all of them, or with
    ``causal`` those up to its own slot); that part is implicit here (``block_attention``) and is built
    by ``build_attention_mask`` only when a dense mask is wanted, so ``causal`` does not change this mask
    (it is accepted so that the three builders take the same keywords). Memory: ``Q * T`` bytes.
    """
    del causal
    window = check_window(window)
    cu = cu_seqlens.to(anchors.device).long()
    t = int(cu[-1])
    a = anchors.long()
    b = int(block_size)
    dev = a.device
    rows = torch.arange(a.numel() * b, device=dev)
    blk = rows // b
    anchor_q = a[blk]
    start_q = cu[seq_index(cu, anchor_q)]
    c = torch.arange(t, device=dev)
    mask = (c[None, :] >= start_q[:, None]) & (c[None, :] < anchor_q[:, None])
    if window is not None:
        mask &= (anchor_q + rows % b)[:, None] - c[None, :] < window
    return mask


def build_attention_mask(anchors: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int, *,
                         window: int | None = None, causal: bool = False) -> torch.Tensor:
    """``[Q, T + Q] bool`` dense mask (True = may attend) for blocks anchored at global packed ``anchors [A]``.

    Columns ``0..T-1`` are the packed context (``build_context_mask``, with its ``window``), ``T..T+Q-1``
    the draft tokens, of which a row sees exactly those of its own block (with ``causal``: those of its
    own block up to its own slot). Memory: ``Q * (T + Q)`` bytes; the trainer uses the structured form
    (context mask + ``block_size``) instead, which needs ``Q * T``.
    """
    ctx = build_context_mask(anchors, cu_seqlens, block_size, window=window)
    q = ctx.shape[0]
    rows = torch.arange(q, device=ctx.device)
    blk = rows // int(block_size)
    own = blk[:, None] == blk[None, :]
    if causal:
        own &= rows[None, :] <= rows[:, None]
    return torch.cat([ctx, own], dim=1)


@dataclass
class FlexMask:
    """The DFlash attention pattern as a block-sparse ``torch.nn.attention.flex_attention`` mask.

    Key/value layout: ``[context padded to ctx_len ; draft tokens padded to q_len]``; queries: the draft
    tokens padded to ``q_len`` (both multiples of the tile, at least two tiles each). ``num_queries`` is the
    real ``Q = A*B``;
    ``block_size`` ``B``; ``window``/``causal`` the variant it was built for (``build_flex_mask``), which the
    drafter checks against each layer's.
    """
    block_mask: Any
    ctx_len: int
    q_len: int
    num_queries: int
    block_size: int = 0
    window: int | None = None
    causal: bool = False


def _ceil_to(n: int, m: int) -> int:
    """``n`` rounded up to a multiple of ``m``, and at least ``2 * m``: a compiled kernel traced with dynamic
    shapes assumes every dynamic size >= 2 (TorchDynamo specialises sizes 0 and 1), so a batch of one tile would
    be traced anew; the extra tile is padding the block mask skips."""
    return max(2 * m, -(-int(n) // m) * m)


def build_flex_mask(anchors: torch.Tensor, seq_start: torch.Tensor, ctx_len: int, block_size: int,
                    tile: int = 128, *, window: int | None = None, causal: bool = False) -> FlexMask:
    """Block-sparse DFlash mask for ``flex_attention``: each draft token sees the context of its own sequence
    strictly before its anchor (packed positions ``seq_start <= c < anchor``) and the ``B`` tokens of its own
    block; nothing else (the same pattern as ``build_attention_mask``, with the same ``window``: also
    ``anchor + slot - c < W``; and ``causal``: own-block tokens up to its own slot only).

    ``anchors [A]`` ascending packed positions and ``seq_start [A]`` (``BlockBatch.seq_start``), on the
    training device; ``ctx_len`` = ``T``. Built on the device without synchronising: per ``tile x tile``
    tile of (queries, keys), a context tile is *full* when every query row of the tile may see all of it
    (inside ``[max seq_start, min anchor)`` of the tile's blocks, which are contiguous because anchors are
    sorted), *partial* when some row may see part of it (the mask function decides per element), else
    skipped; the draft tiles holding the tile's own blocks are partial. Work is then about
    ``Q * (mean context before the anchor + B)`` scores instead of the dense ``Q * (T + Q)``. With a window
    the tile bounds narrow accordingly (rows of a tile see at least ``[max(s_max, a_max + B - W), a_min)``
    and at most ``[max(s_min, a_min - W + 1), a_max)``, anchors and starts being non-decreasing), so work is
    about ``Q * (min(context before the anchor, W) + B)``. ``causal`` leaves the draft tiles partial.

    Reference: the block-mask format of ``torch.nn.attention.flex_attention.BlockMask.from_kv_blocks``
    (PyTorch docs, "FlexAttention"). Raises ``ImportError`` on a torch without flex attention.
    """
    from torch.nn.attention.flex_attention import BlockMask

    window = check_window(window)
    causal = bool(causal)
    dev = anchors.device
    a, b = int(anchors.numel()), int(block_size)
    q_len = _ceil_to(a * b, tile)
    t_pad = _ceil_to(ctx_len, tile)
    a_pad = -(-q_len // b)
    anc = torch.zeros(a_pad, dtype=torch.long, device=dev)
    st = torch.zeros(a_pad, dtype=torch.long, device=dev)
    anc[:a] = anchors.long()
    st[:a] = seq_start.long()
    r0 = torch.arange(q_len // tile, device=dev) * tile                     # first row of each query tile
    blk_lo = r0 // b
    blk_hi_real = ((r0 + tile - 1) // b).clamp(max=max(a - 1, 0))
    blk_hi_all = (r0 + tile - 1) // b
    a_min, a_max = anc[blk_lo][:, None], anc[blk_hi_real][:, None]
    s_min, s_max = st[blk_lo][:, None], st[blk_hi_real][:, None]
    c0 = (torch.arange(t_pad // tile, device=dev) * tile)[None, :]
    lo_any, lo_full = s_min, s_max        # the lowest visible column of any row / of every row of the tile
    if window is not None:                # slot j of the block at a sees c >= a + j - W + 1 (j <= B - 1)
        lo_any = torch.maximum(s_min, a_min - window + 1)
        lo_full = torch.maximum(s_max, a_max + b - window)
    ctx_any = (c0 < a_max) & (c0 + tile > lo_any)
    ctx_full = (c0 >= lo_full) & (c0 + tile <= a_min)
    d0 = (t_pad + torch.arange(q_len // tile, device=dev) * tile)[None, :]
    lo_col, hi_col = (t_pad + blk_lo * b)[:, None], (t_pad + (blk_hi_all + 1) * b)[:, None]
    draft = (d0 < hi_col) & (d0 + tile > lo_col)
    partial = torch.cat([ctx_any & ~ctx_full, draft], dim=1)
    full = torch.cat([ctx_full, torch.zeros_like(draft)], dim=1)

    def ordered(m: torch.Tensor):
        num = m.sum(1, dtype=torch.int32)
        idx = torch.argsort((~m).to(torch.int32), dim=1, stable=True).to(torch.int32)
        return num[None, None].contiguous(), idx[None, None].contiguous()

    ctx_end = torch.full((), t_pad, dtype=torch.long, device=dev)  # a tensor, so a compiled kernel is not
                                                                     # specialised to one context length

    def mask_mod(_b, _h, q_idx, kv_idx):
        blk = q_idx // b
        is_ctx = kv_idx < ctx_end
        ctx_ok = is_ctx & (kv_idx >= st[blk]) & (kv_idx < anc[blk])
        if window is not None:
            ctx_ok = ctx_ok & (anc[blk] + (q_idx - blk * b) - kv_idx < window)
        own = ~is_ctx & ((kv_idx - ctx_end) // b == blk)
        if causal:
            own = own & (kv_idx - ctx_end <= q_idx)
        return ctx_ok | own

    kv_num, kv_idx = ordered(partial)
    full_num, full_idx = ordered(full)
    try:
        mask = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=tile, mask_mod=mask_mod,
                                        seq_lengths=(q_len, t_pad + q_len))
    except TypeError:  # torch < 2.6: lengths are the tile counts times the tile, which they are here
        mask = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=tile, mask_mod=mask_mod)
    return FlexMask(block_mask=mask, ctx_len=t_pad, q_len=q_len, num_queries=a * b, block_size=b, window=window,
                    causal=causal)


_COMPILED_FLEX = None

# ``kernel_options`` of every training-form ``flex_attention`` call (block sizes, warps, stages; keys prefixed
# ``fwd_``/``bwd_`` apply to one pass: PyTorch docs, "FlexAttention", ``FlexKernelOptions``); None: inductor's
# defaults. Set by ``benchmarks/trainer.py``'s ``+tuned`` form, which measures the configuration inductor's
# autotune chose on the H200 (docs/performance.md) against the defaults.
FLEX_KERNEL_OPTIONS: dict | None = None


def flex_attention_fn(compiled: bool):
    """``torch.nn.attention.flex_attention.flex_attention``, compiled with ``torch.compile`` when ``compiled``
    (CUDA: the fused block-sparse kernel; compiled once per process and reused) or eager (CPU tests: an
    unfused reference that materialises the scores)."""
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention
    if not compiled or torch.compiler.is_compiling():  # inside a compiled layer dynamo compiles it in place
        return flex_attention
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=True)  # one kernel for every batch shape
    return _COMPILED_FLEX


def block_attention(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, k_blk: torch.Tensor,
                    v_blk: torch.Tensor, ctx_mask: torch.Tensor, block_size: int, causal: bool = False) -> torch.Tensor:
    """Attention of ``A`` blocks of ``B`` draft queries over a masked context plus their own block.

    ``q [Hq, Q, D]`` (Q = A*B), ``k_ctx/v_ctx [Hkv, C, D]``, ``k_blk/v_blk [Hkv, Q, D]``, ``ctx_mask [Q, C]``
    bool (True = may attend). Returns ``[Hq, Q, D]``. Equal to softmax attention under the dense
    ``[Q, C+Q]`` mask whose draft part is block-diagonal (with ``causal``: lower-triangular inside each
    block, slot ``j`` seeing slots ``<= j``), but computes ``Q*(C+B)`` scores instead of ``Q*(C+Q)`` (one
    joint softmax over the context scores and the in-block scores). GQA without repeating keys: query
    heads are grouped onto their key/value head.
    """
    hq, qn, d = q.shape
    hkv, c = k_ctx.shape[0], k_ctx.shape[1]
    g, b = hq // hkv, int(block_size)
    a = qn // b
    scale = d ** -0.5
    qg = q.reshape(hkv, g, qn, d)
    s_ctx = torch.einsum("hgqd,hcd->hgqc", qg, k_ctx) * scale
    s_ctx = s_ctx.masked_fill(~ctx_mask[None, None], float("-inf"))
    s_blk = torch.einsum("hgaid,hajd->hgaij", qg.reshape(hkv, g, a, b, d), k_blk.reshape(hkv, a, b, d)) * scale
    if causal:
        upper = torch.ones(b, b, dtype=torch.bool, device=q.device).triu(1)
        s_blk = s_blk.masked_fill(upper, float("-inf"))
    probs = torch.softmax(torch.cat([s_ctx, s_blk.reshape(hkv, g, qn, b)], dim=-1).float(), dim=-1).to(q.dtype)
    out = torch.einsum("hgqc,hcd->hgqd", probs[..., :c], v_ctx)
    out = out + torch.einsum("hgaij,hajd->hgaid", probs[..., c:].reshape(hkv, g, a, b, b),
                             v_blk.reshape(hkv, a, b, d)).reshape(hkv, g, qn, d)
    return out.reshape(hq, qn, d)
