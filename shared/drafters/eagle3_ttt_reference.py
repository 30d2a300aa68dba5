"""The unbatched EAGLE-3 training-time-test loss, as it was before issue 25: the reference, not the training path.

``reference_eagle3_loss`` is the implementation ``shared/drafters/eagle3_ttt.py`` had until the batched one
replaced it (commit 0991dcd): one Python loop over TTT steps, inside it one attention call per
packed sequence (``eagle3_attention`` with a fresh causal mask each time), one LM head and loss per step, the
top-K soft targets gathered and renormalised again at every step. It defines the loss and the statistics the
batched ``eagle3_loss`` must reproduce (``tests/unit/test_eagle3_batched.py``: float32, CPU, ~1e-5) and is the
baseline ``benchmarks/eagle3_step.py`` times beside it. Same inputs, outputs and errors as ``eagle3_loss``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specring.shared.models.eagle3 import Eagle3Drafter, draft_to_target, eagle3_attention, target_to_draft
from specring.shared.transport.slot_batch import SlotBatch


def reference_ttt_inputs(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, steps: int):
    """``(step_ids [K] list of [T] long, pred_pos [K, T] long, inside [K, T] bool, positions [T] long)``, one
    step at a time (see ``eagle3_ttt.ttt_inputs``, which returns the same values with ``step_ids`` stacked)."""
    dev = input_ids.device
    t = input_ids.shape[0]
    cu = cu_seqlens.to(dev).long()
    idx = torch.arange(t, device=dev)
    seq = torch.searchsorted(cu[1:], idx, right=True)
    end = cu[seq + 1]
    positions = idx - cu[seq]
    ids = input_ids.long()
    step_ids, pred, inside = [], [], []
    for k in range(steps):
        read = idx + 1 + k
        step_ids.append(torch.where(read < end, ids[read.clamp(max=t - 1)], torch.zeros_like(ids)))
        p = idx + 2 + k
        pred.append(p.clamp(max=t - 1))
        inside.append(p < end)
    return step_ids, torch.stack(pred), torch.stack(inside), positions


def reference_ttt_forward(model: Eagle3Drafter, step_ids: list[torch.Tensor], positions: torch.Tensor,
                          cu_seqlens: torch.Tensor, features: torch.Tensor) -> list[torch.Tensor]:
    """One pre-norm output ``[T, H]`` per TTT step, sequence by sequence (``Eagle3Drafter.ttt_forward`` computes
    the same, batched)."""
    cu = [int(x) for x in cu_seqlens.tolist()]
    h = model.fuse(features)
    keys: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(len(cu) - 1)]
    outs = []
    for k, ids in enumerate(step_ids):
        cos, sin = model.rope(positions + k)
        q, kk, vv = model.midlayer.qkv(model.embed(ids), h, cos, sin)
        parts = []
        for s in range(len(cu) - 1):
            a, b = cu[s], cu[s + 1]
            if a == b:
                continue
            keys[s].append((kk[:, a:b], vv[:, a:b]))
            k0, v0 = keys[s][0]
            causal = torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).tril()
            parts.append(eagle3_attention(q[:, a:b], k0, v0, causal, [x[0] for x in keys[s][1:]],
                                          [x[1] for x in keys[s][1:]]))
        h = model.midlayer.finish(h, torch.cat(parts, dim=1))
        outs.append(h)
    return outs


def reference_eagle3_loss(model: Eagle3Drafter, batch: SlotBatch, cu_cpu: torch.Tensor,
                          label_source: str, backward: bool):
    """The loss of ``eagle3_ttt.eagle3_loss`` (same arguments and returns), one TTT step at a time."""
    cfg = model.config
    ids, lm = batch.input_ids.long(), batch.loss_mask.bool()
    step_ids, pred, inside, positions = reference_ttt_inputs(ids, cu_cpu, cfg.ttt_steps)
    outs = reference_ttt_forward(model, step_ids, positions, cu_cpu, batch.hidden)
    d2t_full = draft_to_target(model.d2t)
    t2d_index = target_to_draft(model.d2t, cfg.vocab_size)
    topk = batch.target_topk_ids is not None and label_source == "target"
    total = torch.zeros((), dtype=torch.float32, device=ids.device)
    weight_sum = torch.zeros((), dtype=torch.float32, device=ids.device)
    hits = []
    valids = []
    for k, h in enumerate(outs):
        valid = inside[k] & lm[pred[k]]
        src = pred[k] - 1
        label = batch.target_ids.long()[src] if label_source == "target" else ids[pred[k]]
        draft_label = t2d_index[label]
        carries = valid & (draft_label >= 0)
        w = float(cfg.ttt_decay ** k)
        logq = torch.log_softmax(model.logits(h).float(), dim=-1)
        if topk:
            tk = t2d_index[batch.target_topk_ids.long()[src]]
            lp = batch.target_topk_logprobs.float()[src].masked_fill(tk < 0, float("-inf"))
            p = torch.softmax(lp, dim=-1).nan_to_num(0.0)
            ce = -(p * logq.gather(1, tk.clamp(min=0))).sum(-1)
        else:
            ce = F.nll_loss(logq, draft_label.clamp(min=0), reduction="none")
        total = total + w * (ce * carries).sum()
        weight_sum = weight_sum + w * carries.sum()
        hits.append((d2t_full[logq.argmax(-1)] == label) & valid)
        valids.append(valid)
    if backward:
        total.backward()
        total = total.detach()
    hit = torch.stack(hits, 1)
    val = torch.stack(valids, 1)
    lead = torch.cumprod(hit.long(), dim=1).sum(1)
    counted0 = val[:, 0]
    return (total, weight_sum, hit.long().sum(0), val.long().sum(0), ((lead + 1).float() * counted0).sum(),
            counted0.sum())
