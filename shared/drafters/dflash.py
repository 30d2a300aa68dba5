"""The DFlash family behind the drafter contract: config, objective, proposer, checkpoint and serving format.

The model is ``shared/models/dflash.py`` (``DFlashDrafter``); the training samples (anchors, blocks, labels, the
loss) are ``shared/drafters/dflash_blocks.py``; the serving format is ``shared/drafters/dflash_export.py``.

Objective (DFlash paper, training section; SpecForge ``specforge/core/dflash.py`` for the same loss): sample
anchors, build blocks and labels (the data's tokens, or with ``label_source="target"`` the target's greedy next
tokens the producer put in the slot), run the drafter (on CUDA one forward over the whole batch with block-sparse
flex attention; on CPU over groups of sequences whose attention scores stay under ``max_mask_elems``), and
back-propagate the *unnormalised* weighted cross-entropy ``sum_k w_k * CE_k`` (plus, with ``distill_topk``, the KL
divergence to the target's top-K distribution). ``w_k`` is the decay ``exp(-(k-1)/gamma)`` (``--trainer.loss ce``)
or the D-PACE weight (``--trainer.loss dpace``, ``dflash_blocks.dpace_weights``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from specring.shared.drafters.contract import COMMON_STATS, DrafterFamily, ObjectiveContext, StepStats
from specring.shared.drafters.dflash_blocks import (
    block_loss,
    build_block_batch,
    loss_weights,
    sample_anchors,
    split_sequences,
    to_device,
)
from specring.shared.models import layer_ids
from specring.shared.models.dflash import (
    EMBED_KEY,
    HEAD_KEY,
    DFlashConfig,
    DFlashDrafter,
    layer_masks,
)
from specring.shared.models.draft_attention import (
    build_attention_mask,
    build_context_mask,
    build_flex_mask,
)


def anchor_seed(seed: int, batch_ids: list[int]) -> int:
    """63-bit generator seed from the run seed and the batch ids (stable across processes and versions)."""
    h = hashlib.sha256(f"{int(seed)}:{','.join(str(int(b)) for b in batch_ids)}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


class DFlashFamily(DrafterFamily):
    """DFlash: a few decoder layers drafting a block of ``B - 1`` tokens in parallel (``DFlashDrafter``)."""

    name: ClassVar[str] = "dflash"
    config_cls: ClassVar[type] = DFlashConfig
    model_cls: ClassVar[type] = DFlashDrafter
    config_file: ClassVar[str] = "dflash_config.json"
    export_architecture: ClassVar[str] = "DFlashDraftModel"
    description: ClassVar[str] = "dflash (block drafter, shared/models/dflash.py)"

    # ------------------------------------------------------------------ configuration
    def config_kwargs(self, run) -> dict[str, Any]:
        """The keyword arguments of ``config_cls.from_target`` that a run's flags give."""
        p, t = run.producer, run.trainer
        return dict(block_size=t.block_size, mask_token_id=t.mask_token_id, num_draft_layers=t.num_draft_layers,
                    num_target_layers=p.num_target_layers, trust_remote_code=p.trust_remote_code,
                    sliding_window=t.sliding_window,
                    layer_types=None if t.sliding_window is None else "sliding_attention")

    def config_from_run(self, run) -> DFlashConfig:
        """The drafter config of a run: target and captured layers from ``run.producer``, block size, mask token
        and draft depth from ``run.trainer``."""
        return self.config_cls.from_target(run.producer.target, run.producer.target_layer_ids,
                                           **self.config_kwargs(run))

    def config_from_dict(self, d: dict[str, Any]) -> DFlashConfig:
        return self.config_cls.from_dict(d)

    def resolve_layer_ids(self, num_layers: int, ids, n) -> list[int]:
        return layer_ids.resolve_layer_ids(num_layers, ids, n)

    def plan_notes(self, run, num_layers, vocab_size, ids):
        p = run.producer
        if (p.target_layer_ids is None and p.num_target_layers is None
                and len(ids) < layer_ids.DEFAULT_NUM_TARGET_LAYERS):
            return [f"the {num_layers}-layer target gives {len(ids)} default capture layers {ids} (DFlash default "
                    f"{layer_ids.DEFAULT_NUM_TARGET_LAYERS} on deeper targets)"]
        return []

    DFLASH2_ONLY = ("conv_kernel_size", "conv_group_size", "selector_top_k", "selector_rank", "selector_loss_alpha")

    def check_run(self, run) -> None:
        """Refuse DFlash2's options on a DFlash run, where they would be ignored (``ConfigError`` naming the flag)."""
        import dataclasses

        from specring.shared.errors import ConfigError
        defaults = {f.name: f.default for f in dataclasses.fields(run.trainer)}
        for name in self.DFLASH2_ONLY:
            if getattr(run.trainer, name) != defaults[name]:
                key = f"trainer.{name}"
                detail = f"a DFlash2 option; this run trains drafter {self.name} (pass --drafter dflash2)"
                raise ConfigError(f"{run.origin(key)}: {detail}", key=key, detail=detail)
        self.check_config(run)

    def check_config(self, run) -> None:
        """Build the run's drafter config once at plan time, so that its own checks (a group size that does not
        divide the hidden size, a window under the block size, ...) are refused before any process starts,
        naming the flag: the config field that a message starts with is the ``trainer`` field of that name."""
        from specring.shared.errors import ConfigError
        kwargs = self.config_kwargs(run)
        if kwargs.get("mask_token_id") is None:
            kwargs["mask_token_id"] = 0  # the tokenizer's mask token is resolved by the consumer; no load here
        try:
            self.config_cls.from_target(run.producer.target, run.producer.target_layer_ids, **kwargs)
        except ConfigError:
            raise
        except ValueError as e:
            field = str(e).split(":", 1)[0].strip()
            key = f"trainer.{field}" if hasattr(run.trainer, field) else None
            if key is None:
                raise ConfigError(f"drafter config: {e}") from None
            detail = str(e).split(":", 1)[1].strip()
            raise ConfigError(f"{run.origin(key)}: {detail}", key=key, detail=detail) from None

    def plan_line(self, run, plan) -> str:
        t = run.trainer
        loss = "" if t.loss == "ce" else f", loss {t.loss} (alpha {t.dpace_alpha})"
        loss += "" if t.sliding_window is None else f", sliding window {t.sliding_window}"
        return (f"(drafter {self.name}, block size {t.block_size}, anchors {t.num_anchors}"
                f"{loss}{self.plan_extra(run)}, grad_accum {t.grad_accum})")

    def plan_extra(self, run) -> str:
        """What a derived family adds to the plan line (DFlash: nothing)."""
        return ""

    # ------------------------------------------------------------------ model
    def build(self, dcfg, target_dir=None, *, draft_vocab=None) -> nn.Module:
        model = self.model_cls(dcfg)
        if target_dir is not None:
            model.load_target_head(target_dir)
        return model

    # ------------------------------------------------------------------ training
    def stats_layout(self, dcfg, tcfg) -> dict[str, int]:
        b = self.num_positions(dcfg, tcfg)
        return {**{k: 1 for k in COMMON_STATS}, "correct": b, "counted": b}

    def loss_weights(self, ctx: ObjectiveContext) -> torch.Tensor:
        """``[B]`` decay weights of the block slots (cached in ``ctx.extras``)."""
        if "weights" not in ctx.extras:
            ctx.extras["weights"] = loss_weights(ctx.tcfg.block_size, ctx.tcfg.resolved_gamma()).to(ctx.device)
        return ctx.extras["weights"]

    def chunk_objective(self, ctx: ObjectiveContext, stats: StepStats, bb):
        """A per-chunk extra objective for ``block_loss`` (``extra=``), or None. DFlash has none; DFlash2 adds
        its selector loss here."""
        return None

    def objective(self, ctx: ObjectiveContext, batch, batch_ids, t, backward) -> StepStats:
        """Forward (+ backward) of one DFlash micro-batch (see the module docstring). Host work is kept out of
        the device's way: anchors, blocks, labels and the attention mask are built on the device, and the only
        synchronisation is the anchor count (``sample_anchors``)."""
        tc, dev, b = ctx.tcfg, ctx.device, ctx.tcfg.block_size
        model = ctx.model
        on_dev = batch.map_tokens(lambda x: to_device(x, dev))
        hidden, ids, lm = on_dev.hidden, on_dev.input_ids, on_dev.loss_mask
        cu_cpu = batch.cu_seqlens.detach().cpu().long()
        next_ids = on_dev.target_ids if tc.label_source == "target" else None
        gen = torch.Generator().manual_seed(anchor_seed(ctx.seed, batch_ids))
        anchors = sample_anchors(lm, cu_cpu, tc.num_anchors, b, gen)
        stats = StepStats(self.stats_layout(ctx.dcfg, tc), dev)
        stats["num_tokens"] += t
        if ctx.attention == "flex":
            groups = [(0, cu_cpu.numel() - 1, anchors)]
        else:
            groups = []
            anchors_cpu = anchors.cpu()
            for s0, s1 in split_sequences(cu_cpu, anchors_cpu, b, ctx.max_mask_elems, dense=ctx.attention == "dense"):
                lo, hi = int(cu_cpu[s0]), int(cu_cpu[s1])
                groups.append((s0, s1, anchors_cpu[(anchors_cpu >= lo) & (anchors_cpu < hi)].to(dev)))
        weights = self.loss_weights(ctx)
        for s0, s1, a_g in groups:
            if a_g.numel() == 0:
                continue
            lo, hi = int(cu_cpu[s0]), int(cu_cpu[s1])
            cu_g = cu_cpu[s0:s1 + 1] - lo
            bb = build_block_batch(ids[lo:hi], lm[lo:hi], cu_g, a_g - lo, b, ctx.dcfg.mask_token_id,
                                   next_token_ids=None if next_ids is None else next_ids[lo:hi], check=False)
            dc = ctx.dcfg  # one mask per draft-attention variant (full, sliding window, causal block)
            if ctx.attention == "flex":
                mask, form = layer_masks(dc, build_flex_mask, bb.anchors, bb.seq_start, hi - lo, b), None
            elif ctx.attention == "dense":
                mask, form = layer_masks(dc, build_attention_mask, bb.anchors, cu_g.to(dev), b), None
            else:
                mask, form = layer_masks(dc, build_context_mask, bb.anchors, cu_g.to(dev), b), b
            distill = {}
            if tc.distill_topk and on_dev.target_topk_ids is not None:
                src = (bb.label_pos - 1).clamp(min=0) + lo  # the position whose next token slot k predicts
                distill = dict(topk_ids=on_dev.target_topk_ids[src], topk_logprobs=on_dev.target_topk_logprobs[src],
                               distill_weight=tc.distill_weight)
            with ctx.autocast:
                h = model(bb.block_input_ids, bb.block_positions, hidden[lo:hi], bb.ctx_positions, mask,
                          block_size=form)
                # the loss back-propagates chunk by chunk into a detached copy of h (see block_loss), then
                # h.backward() carries that gradient through the drafter once
                h_leaf = h.detach().requires_grad_(True) if backward else h
                extra_fn = self.chunk_objective(ctx, stats, bb)
                fused = ctx.linear_ce is not None and tc.loss == "ce" and not distill and extra_fn is None
                out = block_loss(model.logits, h_leaf, bb.labels, weights, chunk_rows=ctx.loss_chunk_rows,
                                 backward=backward, loss=tc.loss, dpace_alpha=tc.dpace_alpha, extra=extra_fn,
                                 linear_ce=ctx.linear_ce if fused else None,
                                 head=model.head_spec() if fused else None, **distill)
            if backward and h_leaf.grad is not None:
                h.backward(h_leaf.grad)
            finite = torch.isfinite(out.weighted_ce.detach())
            stats["loss_sum"] += torch.where(finite, out.weighted_ce.detach(), 0.0).double()
            stats["weight_sum"] += out.weight_sum.double()
            stats["accept_sum"] += out.accept_sum.double()
            stats["num_blocks"] += out.num_blocks
            stats["nonfinite"] += (~finite).double()
            stats["correct"] += out.correct.double()
            stats["counted"] += out.counted.double()
        return stats

    def step_metrics(self, sums: dict[str, Any]) -> dict[str, Any]:
        correct, counted = sums["correct"], sums["counted"]
        acc = [c / n if n else None for c, n in zip(correct, counted)]
        return {"loss": sums["loss_sum"] / sums["weight_sum"] if sums["weight_sum"] > 0 else float("nan"),
                "per_slot_acc": acc[1:],  # block slots 1..B-1
                "accept_proxy": sums["accept_sum"] / sums["num_blocks"] if sums["num_blocks"] else float("nan")}

    # ------------------------------------------------------------------ decoding
    def proposer(self, model, *, block_size=None, num_draft_tokens=None):
        from specring.shared.models.speculative import DFlashProposer
        return DFlashProposer(model, block_size)

    def verify_block_size(self, model, block_size=None, num_draft_tokens=None) -> int:
        return int(block_size or model.config.block_size)

    def untrained_like(self, model, target_dir, device, dtype, seed=0) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            fresh = self.build(model.config, target_dir)
        return fresh.to(device=device, dtype=dtype).eval()

    # ------------------------------------------------------------------ checkpoints and export
    def load_checkpoint_model(self, tensors, config, where, dtype, require_head) -> nn.Module:
        dcfg = self.config_from_dict(config)
        missing_head = [k for k in (EMBED_KEY, HEAD_KEY) if k not in tensors]
        if missing_head and require_head:
            raise ValueError(f"{where} lacks {missing_head}: cannot use a drafter without the target's embedding "
                             "and LM head")
        model = self.model_cls(dcfg).to(dtype=dtype)
        model.load_trainable(tensors, where)
        if not missing_head:
            tied = dcfg.tie_word_embeddings and torch.equal(tensors[EMBED_KEY], tensors[HEAD_KEY])
            model.load_frozen(tensors[EMBED_KEY], None if tied else tensors[HEAD_KEY])
        return model

    def export(self, step_dir, output_dir, target_dir, dtype, overwrite=False, trust_remote_code=False) -> Path:
        from specring.shared.drafters.dflash_export import export_drafter
        return export_drafter(step_dir, output_dir, target_dir, dtype, overwrite, trust_remote_code)

    def export_summary(self, export_dir) -> list[str]:
        from specring.shared.drafters.dflash_export import export_summary
        return export_summary(export_dir)

    def load_export(self, export_dir, device="cpu", target_dir=None, dtype=None) -> nn.Module:
        from specring.shared.drafters import dflash_export
        if target_dir is None:
            return dflash_export.load_exported_as_served(export_dir, device)
        return dflash_export.load_exported(export_dir, target_dir, device, dtype or torch.float32)


FAMILY = DFlashFamily()
