"""The DFlash serving format: export a DFlash checkpoint (``launch.py export``) and load an export back.

The format is that of the public DFlash draft models, defined by z-lab/dflash ``dflash/model.py``
(``DFlashDraftModel``, a ``Qwen3PreTrainedModel``) and read by the serving loaders SGLang
``python/sglang/srt/models/dflash.py`` + ``speculative/dflash_utils.py`` (``parse_dflash_draft_config``)
and vLLM ``vllm/model_executor/models/qwen3_dflash.py``. An export directory holds:

* ``config.json``: a Qwen3-style config (``model_type`` = the target's, ``qwen3`` for the fixture) with
  ``architectures: ["DFlashDraftModel"]``; the draft's sizes (``num_hidden_layers`` = *draft* layers);
  ``block_size`` both at the top level (z-lab Qwen3 releases, SpecForge/speculators converters) and in
  ``dflash_config`` (newer releases; SGLang reads it there first); ``dflash_config`` with
  ``mask_token_id``, ``mask_token`` (its string, for SGLang versions that resolve the mask by name) and
  ``target_layer_ids``; ``num_target_layers`` = the number of layers of the *target* (as in z-lab's
  configs; SGLang checks the layer ids against it; specring's ``DFlashConfig.num_target_layers`` is the
  number of captured layers instead); ``layer_types`` all ``full_attention`` (non-causal draft attention in
  the reference, SGLang and vLLM alike); ``eagle_aux_hidden_state_layer_ids`` = ``target_layer_ids + 1``
  (vLLM's capture index is the *input* of a layer; vLLM versions that read only this field need it, newer
  ones derive the same ``+1`` from ``dflash_config``); RoPE as ``rope_theta`` and ``rope_parameters``
  (transformers 4 and 5 forms); ``dtype``/``torch_dtype``.
* ``model.safetensors`` (metadata ``format: pt``): the trainable weights under the reference's names
  (``fc``, ``hidden_norm``, ``norm``, ``layers.{i}.self_attn.{q,k,v,o}_proj``, ``.{q,k}_norm``,
  ``layers.{i}.mlp.{gate,up,down}_proj``, ``layers.{i}.{input,post_attention}_layernorm``). *No*
  ``embed_tokens``/``lm_head``: like z-lab's released drafts, the draft borrows the target's at run time
  (the reference calls ``target.get_input_embeddings()`` and the target's head; SGLang's draft model has
  neither; vLLM shares the target's when the checkpoint has none).
* ``modeling_dflash.py`` and ``auto_map`` in ``config.json``: transformers' ``AutoModel.from_pretrained(dir,
  trust_remote_code=True, dtype="auto")`` gives a ``DFlashDraftModel`` (as z-lab's README loads their drafts),
  specring's own definition: ``shared/drafters/dflash_hf_model.py`` with the drafter's building blocks from
  ``shared/models/building_blocks.py`` and ``shared/models/dflash.py`` inlined (``modeling_source``), computing the same
  logits as ``DFlashDrafter``.
* ``specring_export.json``: provenance (checkpoint, step, target), the exported ``dtype`` and the dtype
  the checkpoint held (``checkpoint_dtype``, the one tau during training was measured in, with that tau);
  ``launch.py eval --drafter EXPORT_DIR`` measures the exported weights in the exported dtype.

Every file gets the usual mode (``0666 & ~umask``: 0644), the directory ``0777 & ~umask``.

Because the served draft uses the *target's* embedding and head, export refuses a checkpoint whose own
frozen copies are missing or differ from the target's, and one whose layer ids are not recorded or do not
fit the target: such a directory would load without error and accept nothing.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from specring.shared.drafters import checkpoint as ckpt
from specring.shared.drafters.dflash_hf_model import modeling_source
from specring.shared.drafters.serving_format import (
    CONFIG_FILE,
    PROVENANCE_FILE,
    WEIGHTS_FILE,
    check_output_dir,
    resolve_export_dtype,
    write_export_dir,
)
from specring.shared.machine.devices import MODEL_DTYPES as DTYPES  # the dtypes an export may be written in
from specring.shared.models.building_blocks import read_target_head, rope_theta_from_config
from specring.shared.models.dflash import (
    EMBED_KEY,
    FROZEN_KEYS,
    HEAD_KEY,
    DFlashConfig,
    DFlashDrafter,
)
from specring.shared.models.target_config import read_target_config
from specring.shared.models.target_config import text_config as _text_config
from specring.shared.run.run_dir import RunDir

logger = logging.getLogger(__name__)

MODELING_FILE = "modeling_dflash.py"
ARCHITECTURE = "DFlashDraftModel"
AUTO_MAP = {"AutoModel": f"{MODELING_FILE[:-3]}.{ARCHITECTURE}"}


def reference_weight_names(num_draft_layers: int) -> set[str]:
    """The tensor names of a DFlash draft checkpoint with ``num_draft_layers`` layers, as the public
    definition (z-lab/dflash ``dflash/model.py``) names its parameters (rotary buffers are not saved)."""
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    per_layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                 "input_layernorm", "post_attention_layernorm"]
    for i in range(num_draft_layers):
        names.update(f"layers.{i}.{p}.weight" for p in per_layer)
    return names


def _target_config(target_dir: Path) -> tuple[dict, dict]:
    raw = read_target_config(target_dir)
    return raw, _text_config(raw)


def _mask_token_string(target_dir: Path, mask_token_id: int, trust_remote_code: bool = False) -> str | None:
    try:
        from specring.shared.models.hub import load_pretrained
        tok = load_pretrained("tokenizer", target_dir, trust_remote_code=trust_remote_code)
        return str(tok.convert_ids_to_tokens(int(mask_token_id)))
    except Exception as e:  # a target without a tokenizer still exports (mask by id only)
        logger.warning("mask token string not resolved from %s: %s", target_dir, e)
        return None


def exported_config(dcfg: DFlashConfig, target_raw: dict, dtype: str, mask_token: str | None = None) -> dict[str, Any]:
    """The ``config.json`` of an export (see the module docstring for every field and its source).

    ``target_raw``: the target's ``config.json``; ``dtype``: ``bfloat16``/``float16``/``float32``.
    """
    tcfg = _text_config(target_raw)
    n_draft = dcfg.num_hidden_layers
    dflash_config: dict[str, Any] = {"mask_token_id": int(dcfg.mask_token_id),
                                     "target_layer_ids": [int(i) for i in dcfg.target_layer_ids],
                                     "block_size": int(dcfg.block_size)}
    if mask_token:
        dflash_config["mask_token"] = mask_token
    cfg = {
        "architectures": [ARCHITECTURE],
        "auto_map": dict(AUTO_MAP),
        "model_type": dcfg.target_model_type,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": dcfg.hidden_size,
        "intermediate_size": dcfg.intermediate_size,
        "num_hidden_layers": n_draft,
        "num_attention_heads": dcfg.num_attention_heads,
        "num_key_value_heads": dcfg.num_key_value_heads,
        "head_dim": dcfg.head_dim,
        "rms_norm_eps": dcfg.rms_norm_eps,
        "rope_theta": dcfg.rope_theta,
        "rope_parameters": {"rope_theta": dcfg.rope_theta, "rope_type": "default"},
        "rope_scaling": None,
        "max_position_embeddings": dcfg.max_position_embeddings,
        "vocab_size": dcfg.vocab_size,
        "tie_word_embeddings": dcfg.tie_word_embeddings,
        "initializer_range": dcfg.initializer_range,
        "layer_types": ["full_attention"] * n_draft,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": n_draft,
        "block_size": int(dcfg.block_size),
        "dflash_config": dflash_config,
        "num_target_layers": int(tcfg["num_hidden_layers"]),
        "eagle_aux_hidden_state_layer_ids": [int(i) + 1 for i in dcfg.target_layer_ids],
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in tcfg or key in target_raw:
            cfg[key] = tcfg.get(key, target_raw.get(key))
    try:
        import transformers
        cfg["transformers_version"] = transformers.__version__
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    return cfg


def config_from_exported(cfg: dict[str, Any]) -> DFlashConfig:
    """The ``DFlashConfig`` of an export's ``config.json``. Raises ``ValueError`` naming a missing field."""
    dfc = cfg.get("dflash_config") or {}
    ids = dfc.get("target_layer_ids", cfg.get("target_layer_ids"))
    if not ids:
        raise ValueError("config.json: dflash_config.target_layer_ids missing")
    mask = dfc.get("mask_token_id", cfg.get("mask_token_id"))
    if mask is None:
        raise ValueError("config.json: dflash_config.mask_token_id missing")
    try:
        heads = int(cfg["num_attention_heads"])
        return DFlashConfig(
            hidden_size=int(cfg["hidden_size"]), intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]), num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta_from_config(cfg),
            vocab_size=int(cfg["vocab_size"]), max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            target_layer_ids=[int(i) for i in ids], num_target_layers=len(ids),
            block_size=int(dfc.get("block_size", cfg.get("block_size", 16))), mask_token_id=int(mask),
            target_model_type=str(cfg.get("model_type", "qwen3")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            initializer_range=float(cfg.get("initializer_range", 0.02)))
    except KeyError as e:
        raise ValueError(f"config.json: field {e.args[0]!r} missing") from None


def _check_checkpoint(step_dir: Path, target_dir: Path) -> tuple[DFlashDrafter, dict]:
    """Load the checkpoint's drafter after every refusal check; returns ``(drafter, target_raw_config)``."""
    tensors, _, raw_cfg = ckpt.load_checkpoint(step_dir)
    if not raw_cfg.get("target_layer_ids"):
        raise ValueError(f"checkpoint {step_dir}: target_layer_ids not recorded in {ckpt.CONFIG_FILE}; "
                         "refusing to export a drafter whose capture layers are unknown")
    missing = [k for k in (EMBED_KEY, HEAD_KEY) if k not in tensors]
    if missing:
        raise ValueError(f"checkpoint {step_dir}: {missing} missing; refusing to export a drafter whose "
                         "embedding/LM head cannot be checked against the target's")
    drafter = ckpt.load_drafter(step_dir, device="cpu", dtype=torch.float32)
    dcfg = drafter.config
    target_raw, tcfg = _target_config(target_dir)
    num_layers = int(tcfg["num_hidden_layers"])
    bad = [i for i in dcfg.target_layer_ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"checkpoint {step_dir}: target_layer_ids {bad} do not exist in the {num_layers}-layer "
                         f"target {target_dir}")
    for field, theirs in (("hidden_size", tcfg.get("hidden_size")), ("vocab_size", tcfg.get("vocab_size"))):
        if int(theirs) != getattr(dcfg, field):
            raise ValueError(f"checkpoint {step_dir}: {field} {getattr(dcfg, field)} != target's {theirs} "
                             f"({target_dir})")
    embed, head = read_target_head(target_dir, dcfg.tie_word_embeddings)
    head = embed if head is None else head
    for key, theirs in ((EMBED_KEY, embed), (HEAD_KEY, head)):
        mine = tensors[key]
        if mine.shape != theirs.shape or not torch.equal(mine.float(), theirs.float()):
            raise ValueError(f"checkpoint {step_dir}: {key} differs from the target's in {target_dir}; the "
                             "served draft would use the target's and accept nothing (wrong --target?)")
    return drafter, target_raw


def export_drafter(checkpoint: str | Path, output_dir: str | Path, target_dir: str | Path | None = None,
                   dtype: str = "auto", overwrite: bool = False, trust_remote_code: bool = False) -> Path:
    """Write the serving directory for ``checkpoint`` (step, checkpoints or run directory) to ``output_dir``.

    ``target_dir``: the target, a directory or a hub id (``shared.models.hub.resolve_model_dir``; default: the run's,
    from ``run_dir/config.json``, else the fixture); ``trust_remote_code``: its tokenizer's own code may run;
    ``dtype``: ``auto`` (the target's ``dtype``, else bfloat16), ``bfloat16``, ``float16`` or ``float32``.
    The directory is written under a temporary name and renamed into place. Raises ``FileNotFoundError``
    (no checkpoint, no target), ``FileExistsError`` (a non-empty ``output_dir`` without ``overwrite``) and
    ``ValueError`` for every refusal listed in the module docstring. Returns ``output_dir``.
    """
    from specring.shared.paths import DEFAULT_TARGET

    step_dir = ckpt.resolve_checkpoint(checkpoint)
    if ckpt.is_export(step_dir):
        raise ValueError(f"--drafter: {step_dir} is an export already; export from a checkpoint or run directory")
    from specring.shared.models.hub import resolve_model_dir
    target = resolve_model_dir(target_dir or ckpt.target_of_checkpoint(step_dir) or DEFAULT_TARGET, "--target")
    out = check_output_dir(output_dir, overwrite)
    drafter, target_raw = _check_checkpoint(step_dir, target)
    if not drafter.config.plain_attention:  # the modelling file (dflash_hf_model.py) drafts with full attention
        raise ValueError(f"checkpoint {step_dir}: its draft attention is not plain (layer_types "
                         f"{drafter.config.resolved_layer_types()}, is_causal {drafter.config.is_causal}); the "
                         f"DFlashDraftModel export's modelling file would compute it with full attention: train "
                         f"without --trainer.sliding-window, or as --drafter dflash2, whose export carries it")
    dtype = resolve_export_dtype(dtype, step_dir, target)
    weights = {k: v.to(DTYPES[dtype]).contiguous() for k, v in drafter.trainable_state_dict().items()}
    expected = reference_weight_names(drafter.config.num_hidden_layers)
    assert set(weights) == expected, f"weight names drifted from the reference: {set(weights) ^ expected}"
    cfg = exported_config(drafter.config, target_raw, dtype, _mask_token_string(target, drafter.config.mask_token_id,
                                                                               trust_remote_code))
    measured = _measured(step_dir, drafter, dtype)
    write_export_dir(out, weights, {
        CONFIG_FILE: json.dumps(cfg, indent=2) + "\n",
        MODELING_FILE: modeling_source(),
        PROVENANCE_FILE: json.dumps({
            "exported_by": "specring", "checkpoint": str(step_dir.resolve()), "step_dir": step_dir.name,
            "target": str(target.resolve()), "dtype": dtype, **measured,
            "note": "embed_tokens/lm_head are not included: the draft uses the target's (checked equal at export)",
        }, indent=2) + "\n"})
    logger.info("export written path=%s checkpoint=%s target=%s dtype=%s tensors=%d", out, step_dir, target,
                dtype, len(weights))
    return out


def _measured(step_dir: Path, drafter: DFlashDrafter, dtype: str) -> dict[str, Any]:
    """What was measured of this drafter, for ``specring_export.json``: the checkpoint's dtype, the last tau
    of its run (``eval.jsonl``, measured with the checkpoint's weights), and a note when the export's dtype
    differs (its logits then differ too; ``launch.py eval --drafter EXPORT`` measures the export)."""
    ck = str(drafter.fc.weight.dtype).replace("torch.", "")
    out: dict[str, Any] = {"checkpoint_dtype": ck, "tau_measured": None}
    try:
        step = int(step_dir.name.split("-")[1])
        for rec in RunDir(step_dir.parent.parent).read_evals():  # the run that holds checkpoints/step-N
            if int(-1 if rec.step is None else rec.step) == step:
                out["tau_measured"] = {"step": step, "tau_mean": rec.tau_mean, "dtype": ck}
    except (OSError, ValueError, IndexError, TypeError):
        pass
    if dtype != ck:
        out["dtype_note"] = (f"exported in {dtype}; the checkpoint (and tau during training) is {ck}: logits "
                             f"differ slightly; `launch.py eval --drafter <this directory>` measures the "
                             f"{dtype} export")
    return out


def load_exported_as_served(export_dir: str | Path, device: str | torch.device = "cpu") -> DFlashDrafter:
    """The drafter of an export as it is served: its weights in the exported dtype (``config.json``
    ``dtype``), the frozen head from the target in its ``specring_export.json``. Raises ``ValueError``
    when that target is not recorded or does not exist (then use ``load_exported`` with a target)."""
    from specring.shared.drafters.checkpoint import read_json
    export_dir = Path(export_dir)
    cfg = read_json(export_dir / CONFIG_FILE)  # CorruptFile (a ValueError) naming it when it is not JSON
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    try:
        target = Path(json.loads((export_dir / PROVENANCE_FILE).read_text())["target"])
    except (OSError, ValueError, KeyError, TypeError):
        target = None
    if target is None or not (target / "config.json").is_file():
        raise ValueError(f"{export_dir}: the target it was exported for is not recorded in {PROVENANCE_FILE} or "
                         f"is gone ({target}); load it with load_exported(dir, target)")
    logger.info("export_loaded path=%s dtype=%s target=%s (evaluated as served, in its exported dtype)",
                export_dir, dtype, target)
    return load_exported(export_dir, target, device, DTYPES.get(dtype, torch.float32))


def load_exported(export_dir: str | Path, target_dir: str | Path, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    """A ``DFlashDrafter`` (eval mode) from an export directory, with the frozen head read from ``target_dir``.

    Raises ``FileNotFoundError`` for missing files, ``shared.errors.CorruptFile`` (a ``ValueError``) naming a
    file that does not read (empty, truncated, garbage) and ``ValueError`` naming missing/unexpected tensors or a
    ``num_target_layers`` that does not match the target.
    """
    from specring.shared.drafters.checkpoint import read_json, read_safetensors

    export_dir, target_dir = Path(export_dir), Path(target_dir)
    cfg = read_json(export_dir / CONFIG_FILE)
    if ARCHITECTURE not in (cfg.get("architectures") or []):
        raise ValueError(f"{export_dir}/{CONFIG_FILE}: architectures {cfg.get('architectures')} lack {ARCHITECTURE}")
    dcfg = config_from_exported(cfg)
    _, tcfg = _target_config(target_dir)
    if "num_target_layers" in cfg and int(cfg["num_target_layers"]) != int(tcfg["num_hidden_layers"]):
        raise ValueError(f"{export_dir}: num_target_layers {cfg['num_target_layers']} != the target's "
                         f"{tcfg['num_hidden_layers']} layers ({target_dir})")
    model = DFlashDrafter(dcfg).to(dtype=dtype)
    tensors = read_safetensors(export_dir / WEIGHTS_FILE)
    unexpected_frozen = sorted(set(tensors) & set(FROZEN_KEYS))
    if unexpected_frozen:
        raise ValueError(f"{export_dir}/{WEIGHTS_FILE}: unexpected {unexpected_frozen} (an export holds no frozen "
                         f"target tensors; the server uses the target's)")
    model.load_trainable(tensors, f"{export_dir}/{WEIGHTS_FILE}")
    model.load_target_head(target_dir)
    return model.to(device).eval()


def export_summary(export_dir: str | Path) -> list[str]:
    """What ``launch.py export`` prints about a DFlash export: its shape, a dtype note, how to load and serve it."""
    out = Path(export_dir)
    cfg = json.loads((out / CONFIG_FILE).read_text())
    lines = [f"exported {out}: {cfg['architectures'][0]}, {cfg['num_hidden_layers']} draft layers, block_size "
             f"{cfg['block_size']}, target_layer_ids {cfg['dflash_config']['target_layer_ids']}, dtype {cfg['dtype']}"]
    prov = json.loads((out / PROVENANCE_FILE).read_text())
    if prov.get("dtype_note"):
        lines.append(f"note: {prov['dtype_note']}")
    lines.append(f"load (transformers): AutoModel.from_pretrained({str(out)!r}, trust_remote_code=True, "
                 f"dtype=\"auto\")")
    lines.append(f"serve (SGLang): --speculative-algorithm DFLASH --speculative-draft-model-path {out}")
    return lines
