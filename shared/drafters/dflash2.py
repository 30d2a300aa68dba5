"""The DFlash2 family behind the drafter contract: DFlash plus grouped dynamic causal convolutions and a candidate
selector (model: ``shared/models/dflash2.py``; serving format: ``shared/drafters/dflash2_export.py``).

Definition: the public contract, z-lab/dflash ``dflash/model.py`` (``GroupedDynamicCausalConv``,
``CandidateSelector``, ``DFlash2DraftModel``, ``dflash_generate``; commit 10129599), and the serving loaders of
SGLang (PR #35371) and vLLM (PR #52816); read, not copied. The reference has no training code; the objective
here is DFlash's block loss (``shared/drafters/dflash.py``) plus the selector's:

* Selector loss (``--trainer.selector-loss-alpha``): for every labelled slot ``j`` of a block the candidates are the
  top-``selector_top_k`` tokens of the slot's unary logits (chosen without gradient); where the gold token is not
  among them it replaces the last candidate (gold insertion), so every labelled slot has a target. The scores
  ``unary[c] + <P[prev] * proj(h_j), S[c]>`` take as predecessor ``prev`` the gold token of slot ``j - 1`` (the
  anchor for slot 1: teacher forcing, which is what the walk sees when the previous draft was right). The K-way
  cross-entropy of the scores against the gold candidate, weighted like the slot's CE, times alpha, joins the loss.
* Metrics: ``selector_acc`` per slot (the selector's argmax over the true top-K is the gold token) and
  ``topk_recall`` per slot (the gold token is in the top-K at all), beside DFlash's unary ``per_slot_acc``.

Decoding (``shared.models.speculative.DFlash2Proposer``): the block's unary logits and final hidden states
(``DFlashDrafter.draft_block``), then the selector's left-to-right walk from the anchor, greedy at temperature 0,
sampled from ``softmax(scores / T)`` over the K candidates otherwise, filtered by the same top-k/top-p as the target's
side (the reference applies the temperature alone), whose ``q`` (zero outside the candidates) drives lossless
rejection sampling.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from specring.shared.drafters.contract import ObjectiveContext, StepStats
from specring.shared.drafters.dflash import DFlashFamily
from specring.shared.drafters.dflash_blocks import IGNORE
from specring.shared.models.dflash2 import DFlash2Config, DFlash2Drafter


def selector_targets(logits: torch.Tensor, gold: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                     torch.Tensor]:
    """Candidates for the selector loss: ``logits [N, V]``, ``gold [N] long`` (``-100`` = unlabelled).

    Returns ``(cand [N, K] long, target [N] long, in_top [N] bool)``: the top-``K`` ids of each row (no gradient
    flows through the choice), with the gold id written over the last candidate where it is missing (gold
    insertion; unlabelled rows keep their top-K), the index of the gold id in ``cand`` (0 for unlabelled rows), and
    whether the gold id was among the true top-K.
    """
    k = min(int(top_k), logits.shape[-1])
    cand = logits.detach().topk(k, dim=-1).indices
    g = gold.clamp(min=0)
    hit = cand == g[:, None]
    in_top = hit.any(-1) & (gold != IGNORE)
    insert = (gold != IGNORE) & ~in_top
    cand = cand.clone()
    cand[:, -1] = torch.where(insert, g, cand[:, -1])
    target = (cand == g[:, None]).float().argmax(-1)
    return cand, target, in_top


class DFlash2Family(DFlashFamily):
    """DFlash2: DFlash's block drafter with grouped dynamic causal convolutions around every sublayer and a
    candidate selector over the top-K of each slot's unary logits (``DFlash2Drafter``)."""

    name: ClassVar[str] = "dflash2"
    config_cls: ClassVar[type] = DFlash2Config
    model_cls: ClassVar[type] = DFlash2Drafter
    config_file: ClassVar[str] = "dflash2_config.json"
    export_architecture: ClassVar[str] = "DFlash2DraftModel"
    description: ClassVar[str] = ("dflash2 (DFlash + dynamic convolutions + candidate selector, "
                                  "shared/models/dflash2.py)")

    def config_kwargs(self, run) -> dict[str, Any]:
        t = run.trainer
        return {**super().config_kwargs(run), "conv_kernel_size": t.conv_kernel_size,
                "conv_group_size": t.conv_group_size, "selector_top_k": t.selector_top_k,
                "selector_rank": t.selector_rank}

    def check_run(self, run) -> None:
        """Every DFlash option applies, and DFlash2's own; the config's checks run at plan time."""
        self.check_config(run)

    def plan_extra(self, run) -> str:
        t = run.trainer
        return (f", conv kernel {t.conv_kernel_size} group {t.conv_group_size}, selector top-K {t.selector_top_k} "
                f"rank {t.selector_rank} alpha {t.selector_loss_alpha}")

    # ------------------------------------------------------------------ training
    def stats_layout(self, dcfg, tcfg) -> dict[str, int]:
        b = self.num_positions(dcfg, tcfg)
        return {**super().stats_layout(dcfg, tcfg), "selector_correct": b, "topk_hit": b, "selector_loss_sum": 1}

    def chunk_objective(self, ctx: ObjectiveContext, stats: StepStats, bb):
        """The selector loss of one chunk of blocks (see the module docstring), added by ``block_loss``, each slot
        weighted by its cross-entropy's weight in that chunk (``slot_w [a, B-1]``: the decay, or D-PACE's)."""
        model, tc = ctx.model, ctx.tcfg
        b = tc.block_size
        anchors_tok = bb.block_input_ids.view(-1, b)[:, 0]
        alpha = float(tc.selector_loss_alpha)
        top_k = model.config.selector_top_k

        def extra(logits: torch.Tensor, hidden: torch.Tensor, lab: torch.Tensor, i: int, j: int,
                  slot_w: torch.Tensor) -> torch.Tensor:
            prev = torch.cat([anchors_tok[i:j, None], lab[:, :-1]], dim=1).clamp(min=0).reshape(-1)
            gold = lab.reshape(-1)
            valid = gold != IGNORE
            cand, target, in_top = selector_targets(logits, gold, top_k)
            unary = logits.gather(1, cand)
            scores = model.candidate_selector.scores(hidden, unary, cand, prev)
            ce = F.cross_entropy(scores.float(), target, reduction="none")
            w = (slot_w.reshape(-1) * valid).to(ce.dtype)   # the slot's own CE weight (decay or D-PACE)
            loss = alpha * (ce * w).sum()
            correct = ((scores.detach().argmax(-1) == target) & in_top).view(j - i, b - 1)
            zero = torch.zeros(1, dtype=torch.float64, device=logits.device)
            stats["selector_correct"] += torch.cat([zero, correct.sum(0).double()])
            stats["topk_hit"] += torch.cat([zero, in_top.view(j - i, b - 1).sum(0).double()])
            stats["selector_loss_sum"] += loss.detach().double()
            return loss

        return extra

    def step_metrics(self, sums: dict[str, Any]) -> dict[str, Any]:
        """DFlash's metrics, its ``loss`` the block cross-entropy alone (comparable with DFlash's), plus the
        selector's: ``selector_loss`` (its weighted K-way cross-entropy, times alpha, over the same normaliser),
        ``selector_acc`` and ``topk_recall`` per slot 1..B-1."""
        sel = sums["selector_loss_sum"][0]
        out = super().step_metrics({**sums, "loss_sum": sums["loss_sum"] - sel})
        counted = sums["counted"]
        out["selector_acc"] = [c / n if n else None for c, n in zip(sums["selector_correct"], counted)][1:]
        out["topk_recall"] = [c / n if n else None for c, n in zip(sums["topk_hit"], counted)][1:]
        out["selector_loss"] = (sums["selector_loss_sum"][0] / sums["weight_sum"]
                                if sums["weight_sum"] > 0 else float("nan"))
        return out

    # ------------------------------------------------------------------ decoding
    def proposer(self, model, *, block_size=None, num_draft_tokens=None):
        from specring.shared.models.speculative import DFlash2Proposer
        return DFlash2Proposer(model, block_size)

    # ------------------------------------------------------------------ export
    def export(self, step_dir, output_dir, target_dir, dtype, overwrite=False, trust_remote_code=False) -> Path:
        from specring.shared.drafters.dflash2_export import export_dflash2
        return export_dflash2(step_dir, output_dir, target_dir, dtype, overwrite, trust_remote_code)

    def export_summary(self, export_dir) -> list[str]:
        from specring.shared.drafters.dflash2_export import export_summary
        return export_summary(export_dir)

    def load_export(self, export_dir, device="cpu", target_dir=None, dtype=None) -> nn.Module:
        from specring.shared.drafters.dflash2_export import load_dflash2_export
        return load_dflash2_export(export_dir, device, target_dir, dtype)


FAMILY = DFlash2Family()
