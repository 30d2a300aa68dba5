"""The EAGLE-3 family behind the drafter contract: config, TTT objective, chain proposer, checkpoint and serving format.

The model is ``shared/models/eagle3.py`` (``Eagle3Drafter``); its training-time-test loss is
``shared/drafters/eagle3_ttt.py``; its serving format (``LlamaForCausalLMEagle3``) ``shared/drafters/eagle3_export.py``.
An EAGLE-3 run learns the target's distribution (``label_source=target``,
top-``shared.config.families.DEFAULT_EAGLE3_TOPK`` of it by default) over a draft vocabulary built from the run's data
(``shared/drafters/draft_vocab.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from specring.shared.drafters.contract import COMMON_STATS, DrafterFamily, ObjectiveContext, StepStats
from specring.shared.drafters.dflash_blocks import to_device
from specring.shared.drafters.eagle3_ttt import eagle3_loss
from specring.shared.models import layer_ids
from specring.shared.models.eagle3 import Eagle3Config, Eagle3Drafter


class Eagle3Family(DrafterFamily):
    """EAGLE-3: one decoder layer over fused low/mid/high target features, trained by training-time test."""

    name: ClassVar[str] = "eagle3"
    config_cls: ClassVar[type] = Eagle3Config
    model_cls: ClassVar[type] = Eagle3Drafter
    config_file: ClassVar[str] = "eagle3_config.json"
    export_architecture: ClassVar[str] = "LlamaForCausalLMEagle3"
    description: ClassVar[str] = "eagle3 (one layer, training-time test, shared/models/eagle3.py)"
    needs_draft_vocab: ClassVar[bool] = True
    acc_key: ClassVar[str] = "per_step_acc"
    uses_flex_attention: ClassVar[bool] = False
    needs_anchors: ClassVar[bool] = False
    drafts_chain: ClassVar[bool] = True
    #: the TTT loss ``objective`` calls (``eagle3_ttt.eagle3_loss``); ``benchmarks/eagle3_step.py`` swaps in the
    #: unbatched reference to time the old step beside the new one
    ttt_loss: ClassVar = staticmethod(eagle3_loss)

    # ------------------------------------------------------------------ configuration
    def config_from_run(self, run) -> Eagle3Config:
        """Target and its three captured layers from ``run.producer``, draft vocabulary size (capped at the
        target's vocabulary) and TTT steps from ``run.trainer``."""
        p, t = run.producer, run.trainer
        return Eagle3Config.from_target(p.target, p.target_layer_ids, draft_vocab_size=t.draft_vocab,
                                        ttt_steps=t.ttt_steps)

    def config_from_dict(self, d):
        return Eagle3Config.from_dict(d)

    def resolve_layer_ids(self, num_layers, ids, n):
        return layer_ids.resolve_eagle3_layer_ids(num_layers, ids, n)

    def plan_line(self, run, plan) -> str:
        t = run.trainer
        return (f"(drafter eagle3, draft vocab {plan.draft_vocab_size}, TTT steps {t.ttt_steps}, "
                f"label source {t.label_source}, top-K {t.distill_topk}, grad_accum {t.grad_accum})")

    def plan_notes(self, run, num_layers, vocab_size, ids):
        t = run.trainer
        if vocab_size and t.draft_vocab > vocab_size:
            return [f"--draft-vocab {t.draft_vocab} exceeds the target's vocabulary of {vocab_size}: the draft "
                    f"vocabulary is the whole vocabulary"]
        return []

    def check_run(self, run) -> None:
        """Refuse the block-drafter options EAGLE-3 has no use for (``ConfigError`` naming the flag)."""
        from specring.shared.errors import ConfigError
        t = run.trainer
        import dataclasses
        defaults = {f.name: f.default for f in dataclasses.fields(t)}
        block_only = ("loss", "sliding_window", "dpace_alpha", "conv_kernel_size", "conv_group_size", "selector_top_k",
                      "selector_rank", "selector_loss_alpha")
        for name in block_only:
            if getattr(t, name) != defaults[name]:
                key = f"trainer.{name}"
                detail = "applies to the DFlash families (block drafters), not to drafter eagle3"
                raise ConfigError(f"{run.origin(key)}: {detail}", key=key, detail=detail)

    # ------------------------------------------------------------------ model
    def build(self, dcfg, target_dir=None, *, draft_vocab=None) -> nn.Module:
        if draft_vocab is None:
            raise ValueError("draft_vocab: an EAGLE-3 drafter needs the run's draft vocabulary (d2t, t2d)")
        model = Eagle3Drafter(dcfg)
        model.set_draft_vocab(*draft_vocab)
        if target_dir is not None:
            model.load_target_head(target_dir)
        return model

    def compiled_modules(self, model):
        """The layer: its ``forward`` is one whole TTT step (``Eagle3Layer.forward``), called ``K`` times a batch."""
        return [model.midlayer]

    def num_positions(self, dcfg, tcfg) -> int:
        return int(dcfg.ttt_steps)

    def warm_up_token(self, dcfg) -> int:
        return 0

    # ------------------------------------------------------------------ training
    def stats_layout(self, dcfg, tcfg):
        k = self.num_positions(dcfg, tcfg)
        return {**{n: 1 for n in COMMON_STATS}, "correct": k, "counted": k}

    def objective(self, ctx: ObjectiveContext, batch, batch_ids, t, backward) -> StepStats:
        """Training-time test over every position (``shared.drafters.eagle3_ttt.eagle3_loss``)."""
        cu_cpu = batch.cu_seqlens.detach().cpu().long()
        on_dev = batch.map_tokens(lambda x: to_device(x, ctx.device))
        stats = StepStats(self.stats_layout(ctx.dcfg, ctx.tcfg), ctx.device)
        stats["num_tokens"] += t
        with ctx.autocast:
            loss, wsum, correct, counted, accept, npos = self.ttt_loss(ctx.model, on_dev, cu_cpu,
                                                                       ctx.tcfg.label_source, backward)
        finite = torch.isfinite(loss)
        stats["loss_sum"] += torch.where(finite, loss, 0.0).double()
        stats["weight_sum"] += wsum.double()
        stats["accept_sum"] += accept.double()
        stats["num_blocks"] += npos.double()
        stats["nonfinite"] += (~finite).double()
        stats["correct"] += correct.double()
        stats["counted"] += counted.double()
        return stats

    def step_metrics(self, sums):
        acc = [c / n if n else None for c, n in zip(sums["correct"], sums["counted"])]
        return {"loss": sums["loss_sum"] / sums["weight_sum"] if sums["weight_sum"] > 0 else float("nan"),
                "per_step_acc": acc,  # TTT steps 0..K-1
                "accept_proxy": sums["accept_sum"] / sums["num_blocks"] if sums["num_blocks"] else float("nan")}

    def check_resume(self, model, tensors, where):
        for key in ("d2t", "t2d"):
            if key in tensors and not torch.equal(tensors[key], getattr(model, key).cpu()):
                raise ValueError(f"{where}: its draft vocabulary ({key}) differs from the one this trainer was given "
                                 f"(the run's draft_vocab.safetensors)")

    # ------------------------------------------------------------------ decoding
    def proposer(self, model, *, block_size=None, num_draft_tokens=None):
        from specring.shared.models.speculative import Eagle3Proposer
        return Eagle3Proposer(model, self.verify_block_size(model, block_size, num_draft_tokens) - 1)

    def verify_block_size(self, model, block_size=None, num_draft_tokens=None) -> int:
        """Chain drafting, as deep as training-time test unrolled it unless asked otherwise."""
        if num_draft_tokens is not None:
            return int(num_draft_tokens) + 1
        return int(block_size or model.config.ttt_steps + 1)

    def untrained_like(self, model, target_dir, device, dtype, seed=0):
        """Its shape and draft vocabulary, the target's embedding and head rows, every other weight at its seeded
        initialisation (the global RNG is left alone)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            fresh = self.build(model.config, target_dir, draft_vocab=(model.d2t.cpu(), model.t2d.cpu()))
        return fresh.to(device=device, dtype=dtype).eval()

    # ------------------------------------------------------------------ checkpoints and export
    def load_checkpoint_model(self, tensors, config, where, dtype, require_head):
        model = Eagle3Drafter(Eagle3Config.from_dict(config)).to(dtype=dtype)
        if "embed_tokens.weight" not in tensors and require_head:
            raise ValueError(f"{where} lacks embed_tokens.weight: cannot use a drafter without the target's embedding")
        model.load_trainable(tensors, where)
        if "embed_tokens.weight" in tensors:
            model.load_frozen(tensors["embed_tokens.weight"])
        return model

    def export(self, step_dir, output_dir, target_dir, dtype, overwrite=False, trust_remote_code=False) -> Path:
        """``launch.py export`` of an EAGLE-3 checkpoint (``shared.drafters.eagle3_export``); ``dtype="auto"`` is
        the target's dtype (else bfloat16). Raises what ``export_eagle3`` raises, and ``FileExistsError`` for a
        non-empty ``output_dir`` without ``overwrite``."""
        from specring.shared.drafters.eagle3_export import export_eagle3
        from specring.shared.drafters.serving_format import check_output_dir, resolve_export_dtype

        out = check_output_dir(output_dir, overwrite)
        return export_eagle3(step_dir, out, resolve_export_dtype(dtype, step_dir, target_dir))

    def export_summary(self, export_dir) -> list[str]:
        cfg = json.loads((Path(export_dir) / "config.json").read_text())
        out = export_dir
        return [f"exported {out}: EAGLE-3 ({cfg['architectures'][0]}), draft vocabulary {cfg['draft_vocab_size']} "
                f"of {cfg['vocab_size']}, target layers {cfg['eagle_config']['eagle_aux_hidden_state_layer_ids']}, "
                f"dtype {cfg['torch_dtype']}",
                f"serve (SGLang): --speculative-algorithm EAGLE3 --speculative-draft-model-path {out} "
                f"--speculative-eagle-topk 1 --speculative-num-steps K --speculative-num-draft-tokens K+1",
                f"serve (vLLM): --speculative-config '{{\"method\": \"eagle3\", \"model\": \"{out}\", "
                f"\"num_speculative_tokens\": K}}'"]

    def load_export(self, export_dir, device="cpu", target_dir=None, dtype=None):
        from specring.shared.drafters.eagle3_export import load_eagle3_export
        return load_eagle3_export(export_dir, device)


FAMILY = Eagle3Family()
