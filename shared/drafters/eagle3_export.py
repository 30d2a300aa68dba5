"""``launch.py export`` of an EAGLE-3 checkpoint: the directory SGLang and vLLM load as an EAGLE-3 draft.

Format, as the engines' loaders read it (SGLang ``python/sglang/srt/models/llama_eagle3.py`` and vLLM
``vllm/model_executor/models/llama_eagle3.py``, ``load_weights``; SpecForge ``configs/*-eagle3.json`` and its
``export/to_sglang.py``; read, not vendored):

* ``config.json``: ``architectures: ["LlamaForCausalLMEagle3"]``, ``model_type: "llama"``, one hidden layer,
  the drafter's shape (``hidden_size``, ``intermediate_size``, heads, ``head_dim``, ``rms_norm_eps``,
  ``hidden_act: "silu"``, ``rope_theta``, ``max_position_embeddings``), ``vocab_size`` (the target's),
  ``draft_vocab_size``, ``tie_word_embeddings: false``, ``target_hidden_size`` when it differs from
  ``hidden_size``; ``eagle_config`` with the capture layers (``eagle_aux_hidden_state_layer_ids`` in the
  output-of-layer convention, SGLang adds one) and ``use_aux_hidden_state``, and the top-level
  ``eagle_aux_hidden_state_layer_ids`` (vLLM's ``hidden_states`` index: those plus one) when the layers are
  not the engines' default, so both engines capture what the drafter was trained on.
* ``model.safetensors``: ``fc.weight [H, 3*Ht]``, ``midlayer.*`` (attention q/k/v over ``2H``, o, MLP, the three
  norms), ``norm.weight``, ``lm_head.weight [Vd, H]``, ``d2t [Vd]`` int64 offsets and ``t2d [V]`` bool; no
  ``model.`` prefix, no embedding (both engines use the target's), nothing else (vLLM refuses unknown names,
  SGLang skips them silently).
* ``specring_export.json``: provenance (checkpoint, dtype, target, TTT steps); ``load_eagle3_export`` reads an
  export back as served (``launch.py eval --drafter EXPORT_DIR``).

An export that would lack a required field or tensor, or whose shapes disagree, is refused before anything
is written (``check_eagle3_export``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from specring.shared.drafters import checkpoint as ckpt
from specring.shared.models.eagle3 import (
    DEFAULT_TTT_STEPS,
    Eagle3Config,
    Eagle3Drafter,
)
from specring.shared.models.layer_ids import default_eagle3_layer_ids
from specring.shared.run.run_dir import RunDir

ARCHITECTURE = "LlamaForCausalLMEagle3"
REQUIRED_CONFIG = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "num_hidden_layers", "rms_norm_eps", "hidden_act", "rope_theta",
                   "max_position_embeddings", "vocab_size", "draft_vocab_size", "tie_word_embeddings")


def eagle3_export_config(cfg: Eagle3Config, num_target_layers: int | None, dtype: str) -> dict[str, Any]:
    """``config.json`` of an EAGLE-3 export (module docstring); ``num_target_layers`` (the target's depth, None
    when unknown) decides whether the capture layers are the engines' default, when the top-level vLLM key can
    be left out."""
    ids = list(cfg.target_layer_ids)
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "num_hidden_layers": 1,
        "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": "silu", "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size, "tie_word_embeddings": False, "attention_bias": False,
        "torch_dtype": dtype,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
    }
    if cfg.target_hidden_size != cfg.hidden_size:
        out["target_hidden_size"] = cfg.target_hidden_size
    if num_target_layers is None or ids != default_eagle3_layer_ids(num_target_layers):
        out["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in ids]
    return out


def eagle3_export_tensors(model: Eagle3Drafter, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors of an export: trainable weights in ``dtype``, ``d2t`` int64, ``t2d`` bool (no embedding)."""
    out = {}
    for name, t in model.trainable_state_dict().items():
        out[name] = (t.detach().cpu().contiguous() if name in ("d2t", "t2d")
                     else t.detach().to("cpu", dtype).contiguous())
    return out


def expected_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor an EAGLE-3 export must hold, with its shape, from its ``config.json`` (what the engines'
    ``load_weights`` size their parameters to)."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    ht = cfg.get("target_hidden_size", h)
    m = "midlayer."
    return {"fc.weight": (h, 3 * ht), f"{m}self_attn.q_proj.weight": (nh * hd, 2 * h),
            f"{m}self_attn.k_proj.weight": (nkv * hd, 2 * h), f"{m}self_attn.v_proj.weight": (nkv * hd, 2 * h),
            f"{m}self_attn.o_proj.weight": (h, nh * hd), f"{m}mlp.gate_proj.weight": (i, h),
            f"{m}mlp.up_proj.weight": (i, h), f"{m}mlp.down_proj.weight": (h, i),
            f"{m}input_layernorm.weight": (h,), f"{m}hidden_norm.weight": (h,),
            f"{m}post_attention_layernorm.weight": (h,), "norm.weight": (h,),
            "lm_head.weight": (cfg["draft_vocab_size"], h), "d2t": (cfg["draft_vocab_size"],),
            "t2d": (cfg["vocab_size"],)}


def check_eagle3_export(cfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Refuse (``ValueError`` naming what is wrong) an export the engines would not load as trained: a missing
    config field, a missing, extra or misshapen tensor, ``d2t`` that is not int64 offsets or ``t2d`` that does
    not mark the same ids."""
    missing = [k for k in REQUIRED_CONFIG if k not in cfg]
    if missing:
        raise ValueError(f"EAGLE-3 export: config.json lacks {missing}")
    if cfg["architectures"] != [ARCHITECTURE] or cfg["num_hidden_layers"] != 1 or cfg["tie_word_embeddings"]:
        raise ValueError("EAGLE-3 export: architectures must be [LlamaForCausalLMEagle3], one layer, untied")
    want = expected_shapes(cfg)
    if set(tensors) != set(want):
        raise ValueError(f"EAGLE-3 export: tensors missing {sorted(set(want) - set(tensors))}, unexpected "
                         f"{sorted(set(tensors) - set(want))}")
    bad = {k: tuple(t.shape) for k, t in tensors.items() if tuple(t.shape) != want[k]}
    if bad:
        raise ValueError(f"EAGLE-3 export: shapes {bad} differ from the config's {({k: want[k] for k in bad})}")
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        raise ValueError(f"EAGLE-3 export: d2t must be int64 offsets and t2d bool, got {d2t.dtype} and {t2d.dtype}")
    if not torch.equal(torch.nonzero(t2d).flatten(), d2t + torch.arange(d2t.numel())):
        raise ValueError("EAGLE-3 export: t2d does not mark the ids d2t maps to (d2t must be offsets)")


def export_eagle3(checkpoint: str | Path, output_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """Write the export of the EAGLE-3 checkpoint at ``checkpoint`` into ``output_dir`` (atomically: a temporary
    directory renamed into place). Raises ``ValueError`` for a checkpoint that is not EAGLE-3 or an export that
    ``check_eagle3_export`` refuses."""
    from safetensors.torch import save_file
    step_dir = ckpt.resolve_checkpoint(checkpoint)
    if ckpt.drafter_kind(step_dir) != "eagle3":
        raise ValueError(f"{step_dir} is not an EAGLE-3 checkpoint")
    model = ckpt.load_drafter(step_dir)
    cfg = model.config
    run = RunDir(step_dir.parent.parent)  # the run that holds checkpoints/step-N, when it is one
    target = run.read_config().producer.target if run.is_run else None
    num_layers = (json.loads((Path(target) / "config.json").read_text()).get("num_hidden_layers")
                  if target and (Path(target) / "config.json").is_file() else None)
    out_cfg = eagle3_export_config(cfg, int(num_layers) if num_layers else None, dtype)
    tensors = eagle3_export_tensors(model, {"bfloat16": torch.bfloat16, "float16": torch.float16,
                                            "float32": torch.float32}[dtype])
    check_eagle3_export(out_cfg, tensors)
    out = Path(output_dir)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(out_cfg, indent=2) + "\n")
    (tmp / "specring_export.json").write_text(json.dumps(
        {"drafter": "eagle3", "checkpoint": str(step_dir), "dtype": dtype, "target": target,
         "ttt_steps": cfg.ttt_steps}, indent=1) + "\n")
    for f in tmp.iterdir():
        ckpt.usual_mode(f)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def load_eagle3_export(export_dir: str | Path, device: str | torch.device = "cpu") -> Eagle3Drafter:
    """The drafter of an EAGLE-3 export as it is served (eval mode): its weights in the exported dtype, the
    embedding of the target recorded in ``specring_export.json`` (an export holds none: the engines use the
    target's). Raises ``shared.errors.CorruptFile`` (a ``ValueError``) naming a file that does not read, and
    ``ValueError`` when the export fails ``check_eagle3_export``, its shape is not the recorded
    target's, or that target is not recorded or gone."""
    from specring.shared.drafters.checkpoint import read_json, read_safetensors
    from specring.shared.models.building_blocks import read_target_head

    export_dir = Path(export_dir)
    cfg = read_json(export_dir / "config.json")
    tensors = read_safetensors(export_dir / "model.safetensors")
    check_eagle3_export(cfg, tensors)
    try:
        prov = json.loads((export_dir / "specring_export.json").read_text())
        target = Path(prov["target"])
    except (OSError, ValueError, KeyError, TypeError):
        prov, target = {}, None
    if target is None or not (target / "config.json").is_file():
        raise ValueError(f"{export_dir}: the target it was exported for is not recorded in specring_export.json or "
                         f"is gone ({target})")
    ecfg = Eagle3Config.from_target(target, cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
                                    draft_vocab_size=int(cfg["draft_vocab_size"]),
                                    ttt_steps=int(prov.get("ttt_steps") or DEFAULT_TTT_STEPS))
    mine = eagle3_export_config(ecfg, None, cfg.get("torch_dtype", "float32"))
    differ = sorted(k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                "head_dim", "vocab_size", "draft_vocab_size") if mine[k] != cfg[k])
    if differ:
        raise ValueError(f"{export_dir}: config.json differs from a drafter of the target {target} in {differ}")
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(cfg.get("torch_dtype"), torch.float32)
    model = Eagle3Drafter(ecfg).to(dtype=dtype)
    model.load_trainable(tensors, f"{export_dir}/model.safetensors")
    embed, _ = read_target_head(target, ecfg.tie_word_embeddings)
    model.load_frozen(embed)
    return model.to(device).eval()
