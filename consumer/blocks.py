"""DFlash training samples from a packed batch: anchors, blocks, attention mask, labels and loss weights.

Algorithm: "DFlash: Block Diffusion for Flash Speculative Decoding" (training section), as also
implemented in sgl-project/SpecForge ``specforge/core/dflash.py`` (anchor sampling, ``kv_idx < anchor``
context rule, same-position labels, ``exp(-(k-1)/gamma)`` decay). Written here for *packed* batches
(several sequences concatenated, boundaries in ``cu_seqlens``), not copied.

Conventions (``T`` packed tokens, ``S`` sequences, ``A`` anchors, ``B`` block size, ``Q = A*B``):

* An anchor is a global packed position ``p`` with ``loss_mask[p] == loss_mask[p+1] == 1`` and ``p + 1``
  inside the same sequence. Its block is ``[token[p], MASK x (B-1)]`` at in-sequence positions
  ``pos(p) .. pos(p)+B-1`` (a block may run past the end of its sequence; those slots get no label).
* Attention, columns ``[context (T) ; draft tokens (Q)]``: a draft token of the block anchored at ``p``
  sees the context tokens of its own sequence at positions ``< p`` (never the anchor's own target state,
  which at inference time does not exist yet) and every slot of its own block; nothing else.
* Labels: slot ``k`` predicts ``token[p+k]`` (same position, no shift); slot 0 is excluded, and so is any
  slot past the sequence end or with ``loss_mask == 0``; excluded labels are ``-100``.
* Loss weight of slot ``k``: ``exp(-(k-1)/gamma)`` for ``k >= 1``, 0 for slot 0.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F

IGNORE = -100


def seq_index(cu_seqlens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Sequence index ``[N] long`` of global packed ``positions [N]`` given ``cu_seqlens [S+1]``."""
    cu = cu_seqlens.to(device=positions.device, dtype=torch.long)
    return torch.searchsorted(cu[1:], positions.long(), right=True)


def _check_packed(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    cu = cu_seqlens.long()
    if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens: must be 1-D, start at 0 and have >= 2 entries, got {cu.tolist()[:8]}")
    if bool((cu[1:] < cu[:-1]).any()):
        raise ValueError("cu_seqlens: must be non-decreasing")
    if int(cu[-1]) != loss_mask.shape[0]:
        raise ValueError(f"cu_seqlens: ends at {int(cu[-1])} but the batch has {loss_mask.shape[0]} tokens")


def eligible_anchors(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[T] bool``: positions that may be anchors (``loss_mask`` at p and p+1, p+1 in the same sequence).

    Checks ``cu_seqlens`` on the host when it is a CPU tensor (cheap); a device ``cu_seqlens`` is trusted (no
    synchronisation in the training hot path). Raises ``ValueError`` naming ``cu_seqlens`` when the check fails.
    """
    if cu_seqlens.device.type == "cpu":
        _check_packed(loss_mask, cu_seqlens)
    lm = loss_mask.bool()
    seq = seq_index(cu_seqlens, torch.arange(lm.shape[0], device=lm.device))
    ok = torch.zeros_like(lm)
    ok[:-1] = lm[:-1] & lm[1:] & (seq[:-1] == seq[1:])
    return ok


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``; a CPU tensor goes to a GPU through pinned memory without blocking the host (a
    pageable copy would wait for every kernel queued before it)."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def sample_anchors(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor, num_anchors: int, block_size: int,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """Up to ``num_anchors`` anchors per sequence, without replacement, uniformly among eligible positions.

    ``loss_mask [T]`` (any int/bool dtype, any device), ``cu_seqlens [S+1]``. Returns global packed positions
    ``[A] long`` on ``loss_mask``'s device, ascending (so grouped by sequence). ``generator`` is a CPU
    generator: it draws one uniform key per token on the CPU (``T`` floats, the only host work), so the same
    generator state gives the same anchors on any device. Everything else runs on the device: tokens are
    sorted by (sequence, key), the first ``num_anchors`` eligible tokens of each sequence are kept. One
    device-to-host synchronisation (the number of anchors ``A``). ``block_size`` is accepted for the
    interface; blocks may run past a sequence end (those slots are unlabelled), so it does not restrict
    eligibility.
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors: must be >= 1, got {num_anchors}")
    del block_size
    dev = loss_mask.device
    ok = eligible_anchors(loss_mask, cu_seqlens)
    cu = to_device(cu_seqlens.long(), dev)
    t = loss_mask.shape[0]
    keys = to_device(torch.rand(t, generator=generator, dtype=torch.float64), dev)
    seq = seq_index(cu, torch.arange(t, device=dev))
    # ineligible tokens sort last inside their sequence (key 2 > any uniform key)
    order = torch.argsort(seq.double() * 4.0 + torch.where(ok, keys, torch.full_like(keys, 2.0)))
    rank = torch.arange(t, device=dev) - cu[seq[order]]  # position of each token inside its sequence's run
    keep = order[(rank < num_anchors) & ok[order]]
    return keep.sort().values


@dataclass
class BlockBatch:
    """The draft side of a packed batch (all ``long`` tensors on the batch's device).

    ``anchors [A]`` global packed positions; ``block_input_ids [Q]``; ``block_positions [Q]`` (positions
    inside the sequence); ``labels [A, B]`` (``-100`` = excluded); ``label_pos [A, B]`` the packed position
    whose token slot ``k`` predicts (``anchor + k``, clamped into the batch; meaningful where the label is
    not excluded); ``block_seq [A]`` sequence index of each block; ``seq_start [A]`` packed start of each
    block's sequence; ``ctx_positions [T]`` in-sequence position of each packed context token; ``ctx_seq [T]``.
    """
    anchors: torch.Tensor
    block_input_ids: torch.Tensor
    block_positions: torch.Tensor
    labels: torch.Tensor
    label_pos: torch.Tensor
    block_seq: torch.Tensor
    seq_start: torch.Tensor
    ctx_positions: torch.Tensor
    ctx_seq: torch.Tensor
    block_size: int

    @property
    def num_blocks(self) -> int:
        return int(self.anchors.shape[0])

    def to(self, device) -> "BlockBatch":
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        return BlockBatch(**{k: (v.to(device) if torch.is_tensor(v) else v) for k, v in kw.items()})


def build_block_batch(input_ids: torch.Tensor, loss_mask: torch.Tensor, cu_seqlens: torch.Tensor,
                      anchors: torch.Tensor, block_size: int, mask_token_id: int,
                      next_token_ids: torch.Tensor | None = None, check: bool = True) -> BlockBatch:
    """Blocks, positions and labels for ``anchors [A]`` over the packed ``input_ids [T]``/``loss_mask [T]``.

    Label source: with ``next_token_ids=None`` slot ``k`` of the block anchored at ``p`` learns the data's
    token ``input_ids[p+k]``; with ``next_token_ids [T]`` (the target's greedy next token after each
    position, from the producer) it learns ``next_token_ids[p+k-1]``, the token the target itself would put
    at ``p+k`` after the data's prefix (for ``k = 1`` exactly what block-verify decoding accepts). Which
    slots are labelled does not depend on the source (see the module docstring).

    ``check=False`` skips the validation below, which synchronises with the device; for anchors from
    ``sample_anchors`` it holds by construction. Raises ``ValueError`` naming ``anchors`` when an anchor is
    outside ``0..T-2`` or is the last token of its sequence, or naming ``cu_seqlens``.
    """
    if check:
        _check_packed(loss_mask, cu_seqlens.cpu())
    dev = input_ids.device
    ids = input_ids.long()
    lm = loss_mask.to(dev).bool()
    cu = to_device(cu_seqlens.long(), dev)
    anchors = anchors.to(dev).long()
    t = ids.shape[0]
    b = int(block_size)
    if check and anchors.numel() and (int(anchors.min()) < 0 or int(anchors.max()) >= t):
        raise ValueError(f"anchors: outside 0..{t - 1}")
    ctx_seq = seq_index(cu, torch.arange(t, device=dev))
    ctx_positions = torch.arange(t, device=dev) - cu[ctx_seq]
    block_seq = ctx_seq[anchors]
    seq_end = cu[block_seq + 1]
    if check and bool((anchors + 1 >= seq_end).any()):
        raise ValueError("anchors: an anchor is the last token of its sequence (no slot 1 to predict)")
    offs = torch.arange(b, device=dev)
    glob = anchors[:, None] + offs[None, :]                                   # [A, B]
    inside = glob < seq_end[:, None]
    safe = glob.clamp(max=t - 1)
    valid = inside & lm[safe] & (offs[None, :] >= 1)
    if next_token_ids is None:
        source = ids[safe]
    else:
        source = next_token_ids.to(dev).long()[(safe - 1).clamp(min=0)]
    labels = torch.where(valid, source, torch.full_like(safe, IGNORE))
    block_ids = torch.full((anchors.numel(), b), int(mask_token_id), dtype=torch.long, device=dev)
    block_ids[:, 0] = ids[anchors]
    block_positions = ctx_positions[anchors][:, None] + offs[None, :]
    return BlockBatch(anchors=anchors, block_input_ids=block_ids.reshape(-1),
                      block_positions=block_positions.reshape(-1), labels=labels, label_pos=safe,
                      block_seq=block_seq, seq_start=cu[block_seq], ctx_positions=ctx_positions,
                      ctx_seq=ctx_seq, block_size=b)


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


def loss_weights(block_size: int, gamma: float) -> torch.Tensor:
    """``[B] float32``: 0 for slot 0, ``exp(-(k-1)/gamma)`` for slot ``k >= 1`` (DFlash loss decay)."""
    if gamma <= 0:
        raise ValueError(f"gamma: must be > 0, got {gamma}")
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / float(gamma))
    w[0] = 0.0
    return w


@dataclass
class BlockLoss:
    """Sums over the blocks of one forward (not yet normalised; see ``block_loss``)."""
    weighted_ce: torch.Tensor     # scalar, carries the gradient: sum_k w_k * (CE_k + distill_weight * KL_k)
    weight_sum: torch.Tensor      # scalar float: sum_k w_k over valid labels (the normaliser's share)
    correct: torch.Tensor         # [B] long, correct predictions per slot (valid labels only)
    counted: torch.Tensor         # [B] long, valid labels per slot
    accept_sum: torch.Tensor      # scalar float: sum over blocks of (leading correct slots + 1)
    num_blocks: int


def block_loss(logits_fn, hidden: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
               chunk_rows: int | None = None, backward: bool = False, *,
               topk_ids: torch.Tensor | None = None, topk_logprobs: torch.Tensor | None = None,
               distill_weight: float = 0.0) -> BlockLoss:
    """Weighted cross-entropy of draft hidden states ``hidden [A*B, H]`` against ``labels [A, B]``.

    ``logits_fn`` maps ``[N, H] -> [N, V]`` (the frozen LM head); it is applied to the rows of slots
    ``1..B-1`` only (slot 0, the anchor, is never a prediction). Rows whose label is ``-100`` (past a
    sequence end, ``loss_mask`` 0) are computed and weighted 0, so nothing here waits for the device (no
    data-dependent shapes). ``weights [B]`` from ``loss_weights``. Acceptance proxy per block: number of
    leading slots ``1, 2, ...`` predicted correctly (an excluded label ends the run), plus one.

    Distillation (optional): ``topk_ids [A, B, K]`` long and ``topk_logprobs [A, B, K]`` float, the
    target's ``K`` most likely tokens for the position each slot predicts and their log-probabilities;
    the loss of a slot then adds ``distill_weight * KL(p || q)``, ``p`` the target's top-K distribution
    renormalised over those ``K`` tokens, ``q`` the drafter's distribution at the same tokens (the KL
    term of EAGLE/DFlash-style distillation, written here over a top-K support).

    Memory: the logits are computed about ``chunk_rows`` rows at a time (whole blocks; None: all at once).
    With ``backward=True`` each chunk's loss is back-propagated into ``hidden`` (a leaf that requires grad;
    the caller then runs ``h.backward(hidden.grad)`` through the drafter) before the next chunk is computed,
    so only one chunk of ``[rows, V]`` float32 logits is alive at a time (the 152k-token vocab of an 8B target
    would otherwise need tens of GB); ``weighted_ce`` is then returned detached.
    """
    a, b = labels.shape
    dev = hidden.device
    h3 = hidden.view(a, b, hidden.shape[-1])
    lab = labels[:, 1:]                                                       # [A, B-1]
    valid = lab != IGNORE
    w = weights.to(dev, torch.float32)[1:][None, :] * valid                   # [A, B-1]
    pred = torch.full_like(lab, -1)
    blocks_per_chunk = max(1, int(chunk_rows) // max(1, b - 1)) if chunk_rows else max(1, a)
    total = torch.zeros((), dtype=torch.float32, device=dev)
    distill = topk_ids is not None and distill_weight > 0
    for i in range(0, a, blocks_per_chunk):
        j = min(a, i + blocks_per_chunk)
        logits = logits_fn(h3[i:j, 1:].reshape((j - i) * (b - 1), -1)).float()
        target = lab[i:j].reshape(-1)
        wc = w[i:j].reshape(-1)
        loss = (F.cross_entropy(logits, target, reduction="none", ignore_index=IGNORE) * wc).sum()
        if distill:
            k = topk_ids.shape[-1]
            logq = torch.log_softmax(logits, dim=-1).gather(1, topk_ids[i:j, 1:].reshape(-1, k).long())
            logp = torch.log_softmax(topk_logprobs[i:j, 1:].reshape(-1, k).float(), dim=-1)
            kl = (logp.exp() * (logp - logq)).sum(-1)
            loss = loss + float(distill_weight) * (kl * wc).sum()
        pred[i:j] = logits.detach().argmax(-1).view(j - i, b - 1)
        del logits
        if backward:
            loss.backward()
            loss = loss.detach()
        total = total + loss
    hit = (pred == lab) & valid                                               # [A, B-1]
    lead = torch.cumprod(hit.long(), dim=1).sum(dim=1)
    zero = torch.zeros(1, dtype=torch.long, device=dev)
    return BlockLoss(
        weighted_ce=total,
        weight_sum=w.sum().detach(),
        correct=torch.cat([zero, hit.long().sum(0)]),
        counted=torch.cat([zero, valid.long().sum(0)]),
        accept_sum=(lead.float() + 1.0).sum(),
        num_blocks=a,
    )


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


def split_sequences(cu_seqlens: torch.Tensor, anchors: torch.Tensor, block_size: int,
                    max_mask_elems: int, dense: bool = False) -> list[tuple[int, int]]:
    """Cut the sequences into consecutive groups ``[(s0, s1), ...]`` whose attention scores stay small.

    A group's scores per head have ``Q_g * (T_g + B)`` elements in the structured form (context mask plus
    own block, see ``build_context_mask``) and its dense mask ``Q_g * (T_g + Q_g)`` (``dense=True``,
    ``build_attention_mask``); sequences are added to a group while that stays ``<= max_mask_elems`` (a
    single sequence that exceeds it forms its own group). Context of another sequence in the same group is
    masked out, so large groups waste work: the budget trades that against per-group overhead. Sequences
    without anchors are folded into their neighbours (they cost context columns only).
    """
    cu = cu_seqlens.detach().cpu().long()
    s_count = cu.numel() - 1
    per_seq = torch.bincount(seq_index(cu, anchors.detach().cpu().long()), minlength=s_count).tolist()
    groups: list[tuple[int, int]] = []
    s0, tok, q = 0, 0, 0
    for s in range(s_count):
        t_s = int(cu[s + 1] - cu[s])
        q_s = per_seq[s] * block_size
        cols = tok + t_s + (q + q_s if dense else block_size)
        if s > s0 and (q + q_s) * cols > max_mask_elems:
            groups.append((s0, s))
            s0, tok, q = s, 0, 0
        tok += t_s
        q += q_s
    if s_count:
        groups.append((s0, s_count))
    return groups

