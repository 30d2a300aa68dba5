"""The DFlash2 serving format: export a DFlash2 checkpoint as ``DFlash2DraftModel`` and load an export back.

Format: the public checkpoints and their loaders, z-lab/dflash ``dflash/model.py`` (``DFlash2DraftModel``, commit
10129599) with that repository's ``dflash:tests/fixtures/dflash2-config.json`` and
``dflash:tests/fixtures/dflash2-safetensors-header.json``, and the SGLang (PR #35371) and vLLM (PR #52816)
``DFlash2DraftModel`` loaders; read, not copied.

* ``config.json``: DFlash's (``dflash_export.exported_config``: Qwen3 sizes, ``num_target_layers`` = the target's
  depth, ``eagle_aux_hidden_state_layer_ids``, RoPE in both forms) with ``architectures: ["DFlash2DraftModel"]``,
  no ``auto_map`` (no modelling file: the engines and z-lab's package define the class), ``layer_types``,
  ``sliding_window``, ``use_sliding_window`` and ``is_causal`` as the drafter was trained, and in
  ``dflash_config`` beside ``block_size``/``mask_token_id``/``target_layer_ids`` the DFlash2 fields
  ``conv_kernel_size``, ``conv_group_size``, ``selector_rank``, ``selector_top_k``, ``output_multiplier`` and
  ``final_logit_softcapping`` (the reference reads each from ``dflash_config`` first).
* ``model.safetensors``: the trainable weights under the header's names: DFlash's, plus per layer
  ``layers.N.attention_conv.base_kernel [2, K, H]``, ``layers.N.attention_conv.kernel_projection.weight
  [2*K*H/G, H]`` and the same for ``mlp_conv``, and ``candidate_selector.hidden_projection.weight [R, H]``,
  ``candidate_selector.predecessor_codebook [V, R]`` and ``candidate_selector.successor_codebook [V, R]`` (the two
  codebooks *without* a ``.weight`` suffix, as the published header has them; loaders map them back). No
  embedding, no LM head: the target's are used.
* ``specring_export.json``: provenance, as for DFlash.

Refusals (``ValueError``, before anything is written): every refusal of the DFlash export (frozen head not the
target's, layer ids outside the target), and any tensor that is not a name of the format (the engines would skip it
silently) or a name of the format that is missing.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from specring.shared.drafters import checkpoint as ckpt
from specring.shared.drafters import dflash_export
from specring.shared.drafters.serving_format import (
    CONFIG_FILE,
    PROVENANCE_FILE,
    WEIGHTS_FILE,
    check_output_dir,
    resolve_export_dtype,
    write_export_dir,
)
from specring.shared.machine.devices import MODEL_DTYPES
from specring.shared.models.dflash2 import DFlash2Config, DFlash2Drafter

logger = logging.getLogger(__name__)

ARCHITECTURE = "DFlash2DraftModel"
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "output_multiplier",
                  "final_logit_softcapping")


def reference_weight_names(num_draft_layers: int) -> set[str]:
    """The tensor names of a DFlash2 checkpoint with ``num_draft_layers`` layers, as the public header names them."""
    names = set(dflash_export.reference_weight_names(num_draft_layers))
    for i in range(num_draft_layers):
        for conv in ("attention_conv", "mlp_conv"):
            names.update({f"layers.{i}.{conv}.base_kernel", f"layers.{i}.{conv}.kernel_projection.weight"})
    names.update({"candidate_selector.hidden_projection.weight", *CODEBOOKS})
    return names


def to_served_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Parameter names -> the header's names (the codebooks lose ``.weight``)."""
    return {(k[:-len(".weight")] if k[:-len(".weight")] in CODEBOOKS else k): v for k, v in tensors.items()}


def from_served_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The header's names -> parameter names (the codebooks get ``.weight`` back)."""
    return {(f"{k}.weight" if k in CODEBOOKS else k): v for k, v in tensors.items()}


def exported_config(dcfg: DFlash2Config, target_raw: dict, dtype: str, mask_token: str | None = None) -> dict[str, Any]:
    """The ``config.json`` of a DFlash2 export (see the module docstring)."""
    cfg = dflash_export.exported_config(dcfg, target_raw, dtype, mask_token)
    cfg["architectures"] = [ARCHITECTURE]
    cfg.pop("auto_map", None)
    n = dcfg.num_hidden_layers
    types = list(dcfg.layer_types or ["full_attention"] * n)
    cfg["layer_types"] = types
    cfg["use_sliding_window"] = "sliding_attention" in types
    cfg["sliding_window"] = dcfg.sliding_window if "sliding_attention" in types else None
    cfg["is_causal"] = bool(dcfg.is_causal)
    for f in DFLASH2_FIELDS:
        cfg["dflash_config"][f] = getattr(dcfg, f)
    return cfg


def config_from_exported(cfg: dict[str, Any]) -> DFlash2Config:
    """The ``DFlash2Config`` of an export's ``config.json``; ``ValueError`` naming a missing field."""
    base = dflash_export.config_from_exported(cfg).to_dict()
    dfc = cfg.get("dflash_config") or {}
    extra = {}
    for f in DFLASH2_FIELDS:
        if f in dfc:
            extra[f] = dfc[f]
        elif f in cfg:
            extra[f] = cfg[f]
        elif f in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            raise ValueError(f"config.json: dflash_config.{f} missing")
    types = cfg.get("layer_types")
    if types and any(t != "full_attention" for t in types):
        extra["layer_types"] = list(types)
        extra["sliding_window"] = cfg.get("sliding_window")
    extra["is_causal"] = bool(cfg.get("is_causal") or False)
    return DFlash2Config.from_dict({**base, **extra})


def check_dflash2_tensors(names: set[str], num_draft_layers: int, where: str) -> None:
    """Refuse tensors the format does not name (the engines would skip them silently) and missing ones."""
    ref = reference_weight_names(num_draft_layers)
    extra, missing = sorted(names - ref), sorted(ref - names)
    if extra or missing:
        raise ValueError(f"{where}: not the DFlash2DraftModel format: tensors no loader reads {extra}, "
                         f"missing {missing}")


def export_dflash2(checkpoint: str | Path, output_dir: str | Path, target_dir: str | Path | None = None,
                   dtype: str = "auto", overwrite: bool = False, trust_remote_code: bool = False) -> Path:
    """Write the DFlash2 serving directory for ``checkpoint`` to ``output_dir`` (a temporary directory renamed
    into place). Raises ``FileNotFoundError``, ``FileExistsError`` (non-empty ``output_dir`` without
    ``overwrite``) and ``ValueError`` for every refusal of the module docstring. Returns ``output_dir``."""
    from specring.shared.models.hub import resolve_model_dir
    from specring.shared.paths import DEFAULT_TARGET

    step_dir = ckpt.resolve_checkpoint(checkpoint)
    if ckpt.is_export(step_dir):
        raise ValueError(f"--drafter: {step_dir} is an export already; export from a checkpoint or run directory")
    target = resolve_model_dir(target_dir or ckpt.target_of_checkpoint(step_dir) or DEFAULT_TARGET, "--target")
    out = check_output_dir(output_dir, overwrite)
    drafter, target_raw = dflash_export._check_checkpoint(step_dir, target)
    if not isinstance(drafter, DFlash2Drafter):
        raise ValueError(f"{step_dir} is not a DFlash2 checkpoint")
    dtype = resolve_export_dtype(dtype, step_dir, target)
    weights = to_served_names({k: v.to(MODEL_DTYPES[dtype]).contiguous()
                               for k, v in drafter.trainable_state_dict().items()})
    check_dflash2_tensors(set(weights), drafter.config.num_hidden_layers, f"checkpoint {step_dir}")
    cfg = exported_config(drafter.config, target_raw, dtype,
                          dflash_export._mask_token_string(target, drafter.config.mask_token_id, trust_remote_code))
    write_export_dir(out, weights, {
        CONFIG_FILE: json.dumps(cfg, indent=2) + "\n",
        PROVENANCE_FILE: json.dumps({
            "exported_by": "specring", "drafter": "dflash2", "checkpoint": str(step_dir.resolve()),
            "step_dir": step_dir.name, "target": str(Path(target).resolve()), "dtype": dtype,
            **dflash_export._measured(step_dir, drafter, dtype),
            "note": "embed_tokens/lm_head are not included: the draft uses the target's (checked equal at export)",
        }, indent=2) + "\n"})
    logger.info("export written path=%s checkpoint=%s target=%s dtype=%s tensors=%d format=%s", out, step_dir,
                target, dtype, len(weights), ARCHITECTURE)
    return out


def export_summary(export_dir: str | Path) -> list[str]:
    """What ``launch.py export`` prints about a DFlash2 export."""
    out = Path(export_dir)
    cfg = json.loads((out / CONFIG_FILE).read_text())
    d = cfg["dflash_config"]
    return [f"exported {out}: {ARCHITECTURE}, {cfg['num_hidden_layers']} draft layers, block_size {d['block_size']}, "
            f"conv kernel {d['conv_kernel_size']} group {d['conv_group_size']}, selector top-K {d['selector_top_k']} "
            f"rank {d['selector_rank']}, target_layer_ids {d['target_layer_ids']}, dtype {cfg['dtype']}",
            f"serve (SGLang, vLLM): a DFlash2DraftModel draft, e.g. SGLang --speculative-algorithm DFLASH "
            f"--speculative-draft-model-path {out}"]


def load_dflash2_export(export_dir: str | Path, device: str | torch.device = "cpu",
                        target_dir: str | Path | None = None, dtype: torch.dtype | None = None) -> DFlash2Drafter:
    """A ``DFlash2Drafter`` (eval mode) of an export: weights in the exported dtype (unless ``dtype``), the frozen
    head from ``target_dir`` (default: the target recorded in ``specring_export.json``). Raises ``ValueError`` for
    a config or tensor set that is not the format, or an unknown target."""
    from specring.shared.drafters.checkpoint import read_json
    export_dir = Path(export_dir)
    cfg = read_json(export_dir / CONFIG_FILE)  # CorruptFile (a ValueError) naming it when it is not JSON
    if ARCHITECTURE not in (cfg.get("architectures") or []):
        raise ValueError(f"{export_dir}/{CONFIG_FILE}: architectures {cfg.get('architectures')} lack {ARCHITECTURE}")
    dcfg = config_from_exported(cfg)
    if target_dir is None:
        try:
            target_dir = Path(json.loads((export_dir / PROVENANCE_FILE).read_text())["target"])
        except (OSError, ValueError, KeyError, TypeError):
            target_dir = None
        if target_dir is None or not (Path(target_dir) / "config.json").is_file():
            raise ValueError(f"{export_dir}: the target it was exported for is not recorded in {PROVENANCE_FILE} or "
                             f"is gone ({target_dir}); pass the target")
    from specring.shared.drafters.checkpoint import read_safetensors
    tensors = read_safetensors(export_dir / WEIGHTS_FILE)  # CorruptFile naming it when it does not read
    check_dflash2_tensors(set(tensors), dcfg.num_hidden_layers, f"{export_dir}/{WEIGHTS_FILE}")
    if dtype is None:
        dtype = MODEL_DTYPES.get(str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"), torch.float32)
    model = DFlash2Drafter(dcfg).to(dtype=dtype)
    model.load_trainable(from_served_names(tensors), f"{export_dir}/{WEIGHTS_FILE}")
    model.load_target_head(target_dir)
    return model.to(device).eval()
