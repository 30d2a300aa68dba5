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

from specring.shared.drafters.linear_ce import IGNORE, LinearCE
from specring.shared.models.dflash import HeadSpec
from specring.shared.models.draft_attention import seq_index


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


def dpace_weights(ce: torch.Tensor, valid: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """D-PACE loss weights of the predicted slots of each block, detached: ``[A, B-1] float32``.

    ``ce [A, B-1]``: each slot's cross-entropy; ``valid [A, B-1] bool``: labelled slots. Per slot ``q = exp(-CE)``
    (the drafter's probability of the label, a proxy for the chance the slot is accepted; 0 for an unlabelled
    slot, which cannot be accepted), ``q' = (1 - alpha) * q + alpha``, and ``w_j = sum_{m >= j} prod_{i <= m} q'_i``:
    the expected number of accepted slots that slot ``j``'s acceptance is a prefix of, so early slots, on which
    every later one depends, weigh most. Unlabelled slots get weight 0. ``alpha`` in ``[0, 1]`` (``ValueError``
    otherwise). Source: D-PACE as vllm-project/speculators PR #980 and NVIDIA Model-Optimizer PR #1724 use it
    by default (SpecForge PR #578 as an option); written here from that description.
    """
    if not 0.0 <= float(alpha) <= 1.0:
        raise ValueError(f"dpace_alpha: must be in [0, 1], got {alpha}")
    with torch.no_grad():
        q = torch.where(valid, torch.exp(-ce.detach().float()), torch.zeros_like(ce, dtype=torch.float32))
        qp = (1.0 - float(alpha)) * q + float(alpha)
        prefix = torch.cumprod(qp, dim=1)                                     # prod_{i <= m} q'_i
        w = torch.flip(torch.cumsum(torch.flip(prefix, [1]), dim=1), [1])    # sum_{m >= j}
        return w * valid


def _fused_block_loss(linear_ce: LinearCE, head: HeadSpec, h3: torch.Tensor, lab: torch.Tensor,
                      wk: torch.Tensor, pred: torch.Tensor, backward: bool) -> torch.Tensor:
    """``block_loss``'s cross-entropy by one fused linear + CE call per block slot: the rows of slot ``k`` share
    the weight ``wk[k]``, so each call reduces by sum and the weight scales its scalar (unlabelled rows are
    ``-100``, weight 0). Fills ``pred``; returns the weighted sum (detached when ``backward``)."""
    total = torch.zeros((), dtype=torch.float32, device=h3.device)
    rows = h3[:, 1:].transpose(0, 1)                                       # [B-1, A, H]
    weight = head.weight  # under autocast as is (bf16); else in the hidden dtype, as the drafter's logits
    if not torch.is_autocast_enabled(h3.device.type):
        weight = weight.to(h3.dtype)
    for k in range(lab.shape[1]):
        x = rows[k].contiguous()
        if head.scale != 1.0:
            x = x * head.scale
        ce, pk = linear_ce(x, weight, lab[:, k].long(), head.softcap)
        loss_k = ce.float() * wk[k]
        pred[:, k] = pk
        if backward:
            loss_k.backward()
            loss_k = loss_k.detach()
        total = total + loss_k
    return total


def block_loss(logits_fn, hidden: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
               chunk_rows: int | None = None, backward: bool = False, *,
               topk_ids: torch.Tensor | None = None, topk_logprobs: torch.Tensor | None = None,
               distill_weight: float = 0.0, loss: str = "ce", dpace_alpha: float = 0.5,
               extra=None, linear_ce: LinearCE | None = None, head: HeadSpec | None = None) -> BlockLoss:
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

    ``loss="dpace"`` replaces the decay ``weights`` by the D-PACE weights of each block (``dpace_weights``, from the
    chunk's own cross-entropies, detached). ``extra(logits [n, V], hidden [n, H], labels [a, B-1], i, j, w)``, when
    given, is called for each chunk of blocks ``i..j-1`` (``n = (j - i) * (B - 1)`` rows of slots 1..B-1) (``w [j - i,
    B-1]`` the chunk's slot weights as the cross-entropy used them: the decay or D-PACE's, 0 where unlabelled) and
    returns a scalar loss added to the chunk's before its backward (DFlash2's selector loss). ``linear_ce`` with
    ``head`` (``shared.drafters.linear_ce.resolve_linear_ce``): the cross-entropy and the argmax by a fused linear +
    cross-entropy kernel, one call per slot (``_fused_block_loss``), ``logits_fn`` unused; the same loss and gradient up
    to the kernels' rounding. Only the plain ``ce`` loss without distillation or ``extra`` (those need the logits):
    ``ValueError`` otherwise. Raises ``ValueError`` for another ``loss``.
    """
    if loss not in ("ce", "dpace"):
        raise ValueError(f"loss: must be ce or dpace, got {loss!r}")
    if linear_ce is not None and (loss != "ce" or extra is not None or head is None
                                  or (topk_ids is not None and distill_weight > 0)):
        raise ValueError("fused linear cross-entropy: only the ce loss without distillation or an extra objective, "
                         "with the head given")
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
    dpace = loss == "dpace"
    if dpace:
        w = w.clone()
    if linear_ce is not None:
        total = _fused_block_loss(linear_ce, head, h3, lab, weights.to(dev, torch.float32)[1:], pred, backward)
    for i in range(0, a if linear_ce is None else 0, blocks_per_chunk):
        j = min(a, i + blocks_per_chunk)
        logits = logits_fn(h3[i:j, 1:].reshape((j - i) * (b - 1), -1)).float()
        target = lab[i:j].reshape(-1)
        ce = F.cross_entropy(logits, target, reduction="none", ignore_index=IGNORE)
        if dpace:
            w[i:j] = dpace_weights(ce.view(j - i, b - 1), valid[i:j], dpace_alpha)
        wc = w[i:j].reshape(-1)
        chunk_loss = (ce * wc).sum()
        if distill:
            k = topk_ids.shape[-1]
            logq = torch.log_softmax(logits, dim=-1).gather(1, topk_ids[i:j, 1:].reshape(-1, k).long())
            logp = torch.log_softmax(topk_logprobs[i:j, 1:].reshape(-1, k).float(), dim=-1)
            kl = (logp.exp() * (logp - logq)).sum(-1)
            chunk_loss = chunk_loss + float(distill_weight) * (kl * wc).sum()
        if extra is not None:
            chunk_loss = chunk_loss + extra(logits, h3[i:j, 1:].reshape((j - i) * (b - 1), -1), lab[i:j], i, j,
                                            w[i:j])
        pred[i:j] = logits.detach().argmax(-1).view(j - i, b - 1)
        del logits
        if backward:
            chunk_loss.backward()
            chunk_loss = chunk_loss.detach()
        total = total + chunk_loss
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
