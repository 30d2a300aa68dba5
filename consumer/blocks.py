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
    """``[T] bool``: positions that may be anchors (``loss_mask`` at p and p+1, p+1 in the same sequence)."""
    _check_packed(loss_mask, cu_seqlens)
    lm = loss_mask.bool()
    ok = torch.zeros_like(lm)
    ok[:-1] = lm[:-1] & lm[1:]
    last = cu_seqlens.long()[1:] - 1  # the last token of each sequence has no successor inside it
    last = last[last >= 0]
    ok[last.to(ok.device)] = False
    return ok


def sample_anchors(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor, num_anchors: int, block_size: int,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """Up to ``num_anchors`` anchors per sequence, without replacement, uniformly among eligible positions.

    ``loss_mask [T]`` (any int/bool dtype), ``cu_seqlens [S+1]``. Returns global packed positions
    ``[A] long`` on the CPU, ascending (so grouped by sequence). ``generator`` is a CPU generator; the same
    generator state gives the same anchors. ``block_size`` is accepted for the interface; blocks may run
    past a sequence end (those slots are unlabelled), so it does not restrict eligibility.
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors: must be >= 1, got {num_anchors}")
    del block_size
    lm = loss_mask.detach().cpu()
    cu = cu_seqlens.detach().cpu().long()
    ok = eligible_anchors(lm, cu)
    out = []
    for s in range(cu.numel() - 1):
        start, end = int(cu[s]), int(cu[s + 1])
        cand = torch.nonzero(ok[start:end]).flatten() + start
        if cand.numel() > num_anchors:
            pick = torch.randperm(cand.numel(), generator=generator)[:num_anchors]
            cand = cand[pick].sort().values
        out.append(cand)
    return torch.cat(out) if out else torch.empty(0, dtype=torch.long)


@dataclass
class BlockBatch:
    """The draft side of a packed batch (all ``long`` tensors on the batch's device).

    ``anchors [A]`` global packed positions; ``block_input_ids [Q]``; ``block_positions [Q]`` (positions
    inside the sequence); ``labels [A, B]`` (``-100`` = excluded); ``block_seq [A]`` sequence index of each
    block; ``ctx_positions [T]`` in-sequence position of each packed context token; ``ctx_seq [T]``.
    """
    anchors: torch.Tensor
    block_input_ids: torch.Tensor
    block_positions: torch.Tensor
    labels: torch.Tensor
    block_seq: torch.Tensor
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
                      anchors: torch.Tensor, block_size: int, mask_token_id: int) -> BlockBatch:
    """Blocks, positions and labels for ``anchors [A]`` over the packed ``input_ids [T]``/``loss_mask [T]``.

    Raises ``ValueError`` naming ``anchors`` when an anchor is outside ``0..T-2`` or is the last token of
    its sequence.
    """
    _check_packed(loss_mask, cu_seqlens)
    dev = input_ids.device
    ids = input_ids.long()
    lm = loss_mask.to(dev).bool()
    cu = cu_seqlens.to(dev).long()
    anchors = anchors.to(dev).long()
    t = ids.shape[0]
    b = int(block_size)
    if anchors.numel() and (int(anchors.min()) < 0 or int(anchors.max()) >= t):
        raise ValueError(f"anchors: outside 0..{t - 1}")
    ctx_seq = seq_index(cu, torch.arange(t, device=dev))
    ctx_positions = torch.arange(t, device=dev) - cu[ctx_seq]
    block_seq = ctx_seq[anchors]
    seq_end = cu[block_seq + 1]
    if bool((anchors + 1 >= seq_end).any()):
        raise ValueError("anchors: an anchor is the last token of its sequence (no slot 1 to predict)")
    offs = torch.arange(b, device=dev)
    glob = anchors[:, None] + offs[None, :]                                   # [A, B]
    inside = glob < seq_end[:, None]
    safe = glob.clamp(max=t - 1)
    valid = inside & lm[safe] & (offs[None, :] >= 1)
    labels = torch.where(valid, ids[safe], torch.full_like(safe, IGNORE))
    block_ids = torch.full((anchors.numel(), b), int(mask_token_id), dtype=torch.long, device=dev)
    block_ids[:, 0] = ids[anchors]
    block_positions = ctx_positions[anchors][:, None] + offs[None, :]
    return BlockBatch(anchors=anchors, block_input_ids=block_ids.reshape(-1),
                      block_positions=block_positions.reshape(-1), labels=labels, block_seq=block_seq,
                      ctx_positions=ctx_positions, ctx_seq=ctx_seq, block_size=b)


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
    weighted_ce: torch.Tensor     # scalar, carries the gradient: sum_k w_k * CE over valid labels
    weight_sum: torch.Tensor      # scalar float: sum_k w_k over valid labels (the normaliser's share)
    correct: torch.Tensor         # [B] long, correct predictions per slot (valid labels only)
    counted: torch.Tensor         # [B] long, valid labels per slot
    accept_sum: torch.Tensor      # scalar float: sum over blocks of (leading correct slots + 1)
    num_blocks: int


def block_loss(logits_fn, hidden: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
               chunk_rows: int | None = None, backward: bool = False) -> BlockLoss:
    """Weighted cross-entropy of draft hidden states ``hidden [A*B, H]`` against ``labels [A, B]``.

    ``logits_fn`` maps ``[N, H] -> [N, V]`` (the frozen LM head); it is applied only to rows with a label,
    which saves ``1/B`` of the largest matrix product at least. ``weights [B]`` from ``loss_weights``.
    Acceptance proxy per block: number of leading slots ``1, 2, ...`` predicted correctly (an excluded
    label ends the run), plus one.

    Memory: the logits are computed ``chunk_rows`` rows at a time (None: all at once). With
    ``backward=True`` each chunk's weighted CE is back-propagated into ``hidden`` (a leaf that requires
    grad; the caller then runs ``h.backward(hidden.grad)`` through the drafter) before the next chunk is
    computed, so only one chunk of ``[rows, V]`` float32 logits is alive at a time (the 152k-token vocab of
    an 8B target would otherwise need tens of GB); ``weighted_ce`` is then returned detached.
    """
    a, b = labels.shape
    flat = labels.reshape(-1)
    valid = flat != IGNORE
    rows = torch.nonzero(valid).flatten()
    w = weights.to(hidden.device)[torch.arange(a * b, device=hidden.device) % b][rows]
    pred = torch.full_like(flat, -1)
    step = int(chunk_rows) if chunk_rows else max(1, rows.numel())
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for i in range(0, rows.numel(), step):
        r = rows[i:i + step]
        logits = logits_fn(hidden[r]).float()
        wce = (F.cross_entropy(logits, flat[r], reduction="none") * w[i:i + step]).sum()
        pred[r] = logits.detach().argmax(-1)
        del logits
        if backward:
            wce.backward()
            wce = wce.detach()
        total = total + wce
    hit = (pred == flat) & valid
    hit2 = hit.view(a, b)
    lead = torch.cumprod(hit2[:, 1:].long(), dim=1).sum(dim=1)
    return BlockLoss(
        weighted_ce=total,
        weight_sum=w.sum().detach(),
        correct=hit2.long().sum(0),
        counted=valid.view(a, b).long().sum(0),
        accept_sum=(lead.float() + 1.0).sum(),
        num_blocks=a,
    )


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

