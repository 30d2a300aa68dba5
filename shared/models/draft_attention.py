"""The DFlash attention pattern and the three forms that compute it.

A draft token of the block anchored at packed position ``p`` sees the context of its own sequence strictly
before ``p`` (never the anchor's own target state) and every token of its own block; nothing else
(DFlash paper, training section; SpecForge ``specforge/core/dflash.py``). Forms:

* dense: ``build_attention_mask`` ``[Q, C+Q]`` into ``scaled_dot_product_attention``;
* structured: ``build_context_mask`` ``[Q, C]`` plus the own block implicit, ``block_attention``;
* flex: ``build_flex_mask``, a block-sparse ``flex_attention`` mask (the CUDA training form).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def seq_index(cu_seqlens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Sequence index ``[N] long`` of global packed ``positions [N]`` given ``cu_seqlens [S+1]``."""
    cu = cu_seqlens.to(device=positions.device, dtype=torch.long)
    return torch.searchsorted(cu[1:], positions.long(), right=True)


def build_context_mask(anchors: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[Q, T] bool``: the context part of the DFlash mask (True = may attend).

    Row ``q`` belongs to block ``q // B``; it sees packed context position ``c`` iff ``c`` is in its
    block's sequence and ``c < anchor`` (never the anchor's own target state, nothing of another
    sequence). Each block also sees all of its own ``B`` draft tokens; that part is implicit here and
    is built by ``build_attention_mask`` only when a dense mask is wanted. Memory: ``Q * T`` bytes.
    """
    cu = cu_seqlens.to(anchors.device).long()
    t = int(cu[-1])
    a = anchors.long()
    b = int(block_size)
    dev = a.device
    blk = torch.arange(a.numel() * b, device=dev) // b
    anchor_q = a[blk]
    start_q = cu[seq_index(cu, anchor_q)]
    c = torch.arange(t, device=dev)
    return (c[None, :] >= start_q[:, None]) & (c[None, :] < anchor_q[:, None])


def build_attention_mask(anchors: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[Q, T + Q] bool`` dense mask (True = may attend) for blocks anchored at global packed ``anchors [A]``.

    Columns ``0..T-1`` are the packed context (``build_context_mask``), ``T..T+Q-1`` the draft tokens, of
    which a row sees exactly those of its own block. Memory: ``Q * (T + Q)`` bytes; the trainer uses the
    structured form (context mask + ``block_size``) instead, which needs ``Q * T``.
    """
    ctx = build_context_mask(anchors, cu_seqlens, block_size)
    q = ctx.shape[0]
    blk = torch.arange(q, device=ctx.device) // int(block_size)
    return torch.cat([ctx, blk[:, None] == blk[None, :]], dim=1)


@dataclass
class FlexMask:
    """The DFlash attention pattern as a block-sparse ``torch.nn.attention.flex_attention`` mask.

    Key/value layout: ``[context padded to ctx_len ; draft tokens padded to q_len]``; queries: the draft
    tokens padded to ``q_len`` (both multiples of the tile). ``num_queries`` is the real ``Q = A*B``.
    """
    block_mask: Any
    ctx_len: int
    q_len: int
    num_queries: int


def _ceil_to(n: int, m: int) -> int:
    return max(m, -(-int(n) // m) * m)


def build_flex_mask(anchors: torch.Tensor, seq_start: torch.Tensor, ctx_len: int, block_size: int,
                    tile: int = 128) -> FlexMask:
    """Block-sparse DFlash mask for ``flex_attention``: each draft token sees the context of its own sequence
    strictly before its anchor (packed positions ``seq_start <= c < anchor``) and the ``B`` tokens of its own
    block; nothing else (the same pattern as ``build_attention_mask``).

    ``anchors [A]`` ascending packed positions and ``seq_start [A]`` (``BlockBatch.seq_start``), on the
    training device; ``ctx_len`` = ``T``. Built on the device without synchronising: per ``tile x tile``
    tile of (queries, keys), a context tile is *full* when every query row of the tile may see all of it
    (inside ``[max seq_start, min anchor)`` of the tile's blocks, which are contiguous because anchors are
    sorted), *partial* when some row may see part of it (the mask function decides per element), else
    skipped; the draft tiles holding the tile's own blocks are partial. Work is then about
    ``Q * (mean context before the anchor + B)`` scores instead of the dense ``Q * (T + Q)``.

    Reference: the block-mask format of ``torch.nn.attention.flex_attention.BlockMask.from_kv_blocks``
    (PyTorch docs, "FlexAttention"). Raises ``ImportError`` on a torch without flex attention.
    """
    from torch.nn.attention.flex_attention import BlockMask

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
    ctx_any = (c0 < a_max) & (c0 + tile > s_min)
    ctx_full = (c0 >= s_max) & (c0 + tile <= a_min)
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
        return ctx_ok | (~is_ctx & ((kv_idx - ctx_end) // b == blk))

    kv_num, kv_idx = ordered(partial)
    full_num, full_idx = ordered(full)
    try:
        mask = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=tile, mask_mod=mask_mod,
                                        seq_lengths=(q_len, t_pad + q_len))
    except TypeError:  # torch < 2.6: lengths are the tile counts times the tile, which they are here
        mask = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=tile, mask_mod=mask_mod)
    return FlexMask(block_mask=mask, ctx_len=t_pad, q_len=q_len, num_queries=a * b)


_COMPILED_FLEX = None


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
                    v_blk: torch.Tensor, ctx_mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """Attention of ``A`` blocks of ``B`` draft queries over a masked context plus their own block.

    ``q [Hq, Q, D]`` (Q = A*B), ``k_ctx/v_ctx [Hkv, C, D]``, ``k_blk/v_blk [Hkv, Q, D]``, ``ctx_mask [Q, C]``
    bool (True = may attend). Returns ``[Hq, Q, D]``. Equal to softmax attention under the dense
    ``[Q, C+Q]`` mask whose draft part is block-diagonal, but computes ``Q*(C+B)`` scores instead of
    ``Q*(C+Q)`` (one joint softmax over the context scores and the in-block scores). GQA without
    repeating keys: query heads are grouped onto their key/value head.
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
    probs = torch.softmax(torch.cat([s_ctx, s_blk.reshape(hkv, g, qn, b)], dim=-1).float(), dim=-1).to(q.dtype)
    out = torch.einsum("hgqc,hcd->hgqd", probs[..., :c], v_ctx)
    out = out + torch.einsum("hgaij,hajd->hgaid", probs[..., c:].reshape(hkv, g, a, b, b),
                             v_blk.reshape(hkv, a, b, d)).reshape(hkv, g, qn, d)
    return out.reshape(hq, qn, d)
