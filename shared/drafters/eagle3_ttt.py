"""EAGLE-3 training samples and loss from a packed batch: training-time test (TTT) over every position.

Algorithm: EAGLE-3 training-time test as SpecForge ``specforge/core/eagle3.py`` and SafeAILab/EAGLE
``eagle/traineagle3/cnets.py`` define it (see ``specring.shared.models.eagle3``); written here for packed
batches (sequences back to back, ``cu_seqlens``), not copied.

For every position ``t`` of a sequence ending at ``e`` and every step ``k < K``:

* the drafter reads token ``x[t+1+k]`` (``ttt_inputs``) and predicts the token at ``t+2+k``;
* the step counts (is *valid*) when ``t+2+k < e`` and ``loss_mask[t+2+k] == 1`` (the predicted token exists
  and is a training token; SpecForge aligns the mask one token earlier, an artefact of its shifting);
* its label is the target's own next token after ``t+1+k`` (``target_ids[t+1+k]``, label source ``target``)
  or the data's token ``x[t+2+k]`` (label source ``data``); the loss is the soft cross-entropy against the
  target's top-K distribution at ``t+1+k`` restricted to the draft vocabulary and renormalised (when the slot
  carries ``target_topk_*``), else the cross-entropy against the label;
* a valid step whose label is outside the draft vocabulary carries no loss (the references' ``pmask``) but
  counts as a miss in the per-step accuracy;
* step ``k``'s weight is ``decay**k``. Normalised, like DFlash's loss, by the sum of weights of the steps
  that carry loss over the whole accumulation window (SpecForge divides by all positions instead).

Statistics per step ``k``: correct/counted over valid steps; the acceptance proxy of a position is one plus
its number of leading correct steps.
"""

from __future__ import annotations

import torch

from specring.shared.drafters.dflash_blocks import to_device
from specring.shared.models.eagle3 import Eagle3Drafter, PaddedLayout, draft_to_target, target_to_draft
from specring.shared.transport.slot_batch import SlotBatch


def ttt_inputs(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, steps: int):
    """Per-step inputs of a packed batch: ``(step_ids [K, T] long, pred_pos [K, T] long, inside [K, T] bool,
    positions [T] long)``: the token each position reads at step ``k`` (``x[t+1+k]``; 0 where that runs past the
    sequence), the packed position of the token step ``k`` predicts (``t+2+k``, clamped), whether it exists in
    the same sequence, and each token's position inside its sequence. All steps at once, on ``input_ids``'s
    device (``cu_seqlens`` on the host is copied without a synchronisation)."""
    dev = input_ids.device
    t = input_ids.shape[0]
    cu = to_device(cu_seqlens.long(), dev)
    idx = torch.arange(t, device=dev)
    seq = torch.searchsorted(cu[1:], idx, right=True)
    end = cu[seq + 1]
    positions = idx - cu[seq]
    ids = input_ids.long()
    ks = torch.arange(steps, device=dev)[:, None]
    read = idx[None] + 1 + ks                                                   # [K, T]
    step_ids = torch.where(read < end, ids[read.clamp(max=t - 1)], torch.zeros_like(read))
    p = idx[None] + 2 + ks
    return step_ids, p.clamp(max=t - 1), p < end, positions


class _SoftCrossEntropy(torch.autograd.Function):
    """``soft_cross_entropy`` with a hand-written backward: ``g * (sum(p) * softmax - scatter(p))`` computed in
    place of the saved float32 log-softmax (one ``exp`` pass, a scale and a scatter), instead of autograd's
    zero-filled gather gradient, scatter and log-softmax backward (measured on CPU at the fixture shape, the
    loss forward+backward 0.6 s against 0.8 s; ``logsumexp`` + ``exp`` without the saved log-softmax was
    slower there, 1.05 s). A second backward through the same graph raises ``RuntimeError``."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, idx: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        logq = torch.log_softmax(logits.float(), dim=-1)
        ctx.save_for_backward(logq, idx, p)
        ctx.done = False
        return -(p * logq.gather(-1, idx)).sum(-1)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        if ctx.done:
            raise RuntimeError("soft_cross_entropy: its backward reuses the saved log-softmax in place and runs once")
        ctx.done = True
        logq, idx, p = ctx.saved_tensors
        grad = logq.exp_().mul_((grad_out * p.sum(-1))[..., None])         # softmax * g * sum(p), in place
        grad.scatter_add_(-1, idx, -(grad_out[..., None] * p))
        return grad, None, None


def soft_cross_entropy(logits: torch.Tensor, idx: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``-sum_j p[..., j] * log_softmax(logits)[..., idx[..., j]]``, ``[...]`` float32: the cross-entropy of
    ``logits [..., V]`` (any float dtype; the softmax in float32) against the weights ``p [..., J]`` float32
    (a distribution, or zeros) on the classes ``idx [..., J]`` long (a hard label: ``J = 1``, ``p = 1``).
    Equal to ``log_softmax`` + ``gather`` (``eagle3_ttt_reference``), with its gradient, to float32 rounding
    (the gradient is returned in float32; autograd casts it to ``logits``' dtype)."""
    return _SoftCrossEntropy.apply(logits, idx, p)


def eagle3_loss(model: Eagle3Drafter, batch: SlotBatch, cu_cpu: torch.Tensor, label_source: str,
                backward: bool) -> tuple[torch.Tensor, ...]:
    """Forward (+ backward) of one micro-batch; returns ``(weighted_loss, weight_sum, correct [K], counted [K],
    accept_sum, num_positions)`` (device tensors; the loss detached after backward).

    ``batch``: a ``shared.transport.slot_batch.SlotBatch`` whose ``hidden [T, 3*Ht]``, ``input_ids [T]``,
    ``loss_mask [T]`` and, for ``label_source="target"``, ``target_ids [T]`` (optionally
    ``target_topk_ids``/``target_topk_logprobs [T, K']``) are on the model's device; ``cu_cpu [S+1]`` on the
    host (its ``cu_seqlens`` is not read). Raises ``ValueError`` for an empty batch.

    Batched over the TTT steps wherever they do not depend on each other: the labels, masks and renormalised
    top-K soft targets are built once for all positions and gathered per step, the LM head, the cross-entropy
    (``soft_cross_entropy``, its backward written out) and the statistics run once over ``[K, T]``; the layer
    steps run in ``Eagle3Drafter.ttt_forward``. No host synchronisation and no data-dependent shapes (index
    gathers, no boolean-mask indexing). The loss, its gradients and the statistics equal the step-by-step
    ``eagle3_ttt_reference.reference_eagle3_loss`` (``tests/unit/test_eagle3_batched.py``).
    """
    cfg = model.config
    dev = batch.input_ids.device
    ids, lm = batch.input_ids.long(), batch.loss_mask.bool()
    step_ids, pred, inside, _ = ttt_inputs(ids, cu_cpu, cfg.ttt_steps)
    outs = model.ttt_forward(step_ids, cu_cpu, batch.hidden, PaddedLayout.of(cu_cpu, dev))   # [K, T, H]
    d2t_full = draft_to_target(model.d2t)
    t2d_index = target_to_draft(model.d2t, cfg.vocab_size)
    src = pred - 1                                                      # the position whose next token is predicted
    label = batch.target_ids.long()[src] if label_source == "target" else ids[pred]         # [K, T]
    draft_label = t2d_index[label]
    valid = inside & lm[pred]
    carries = valid & (draft_label >= 0)
    logits = model.logits(outs)                                         # [K, T, Vd]
    if batch.target_topk_ids is not None and label_source == "target":
        tk = t2d_index[batch.target_topk_ids.long()]                    # [T, K'] draft ids or -1
        lp = batch.target_topk_logprobs.float().masked_fill(tk < 0, float("-inf"))
        p = torch.softmax(lp, dim=-1).nan_to_num(0.0)                  # renormalised over the draft vocabulary
        ce = soft_cross_entropy(logits, tk.clamp(min=0)[src], p[src])  # [K, T]
    else:
        ones = torch.ones(label.shape + (1,), dtype=torch.float32, device=dev)
        ce = soft_cross_entropy(logits, draft_label.clamp(min=0)[..., None], ones)
    w = (cfg.ttt_decay ** torch.arange(cfg.ttt_steps, device=dev, dtype=torch.float64)).float()    # decay**k
    total = (w * (ce * carries).sum(-1)).sum()
    weight_sum = (w * carries.sum(-1)).sum()
    if backward:
        total.backward()
        total = total.detach()
    hit = (d2t_full[logits.detach().argmax(-1)] == label) & valid      # [K, T]
    lead = torch.cumprod(hit.long(), dim=0).sum(0)
    counted0 = valid[0]
    return (total, weight_sum, hit.long().sum(1), valid.long().sum(1), ((lead + 1).float() * counted0).sum(),
            counted0.sum())
