"""The target checkpoint's ``config.json``: the one place that reads it (no torch, no transformers).

``read_target_config(dir)`` returns the file as a dict; ``text_config(raw)`` the language-model part of it
(multimodal configs nest it in ``text_config``). Whoever needs the target's shape (the run plan, the
drafter's config, the export, the tokenizer's vocabulary) reads it through here; ``shared.models.target``
hands the same directory to transformers' ``AutoConfig`` for the model itself.
"""

from __future__ import annotations

import json
from pathlib import Path

from specring.shared.errors import ConfigError

CONFIG_FILE = "config.json"


def read_target_config(target_dir: str | Path, flag: str = "--target") -> dict:
    """``target_dir/config.json`` as a dict. Raises ``ConfigError`` naming ``flag`` and the path when the file
    is missing, cannot be read or parsed, or does not hold a JSON object."""
    path = Path(target_dir).expanduser() / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"{flag}: {path.parent} has no {CONFIG_FILE}: not a Hugging Face checkpoint directory")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{flag}: {path} cannot be read: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{flag}: {path} does not hold a JSON object")
    return raw


def text_config(raw: dict) -> dict:
    """The language-model part of a target config (multimodal configs nest it in ``text_config``: Qwen3.5 and
    Qwen3.5-MoE publish ``Qwen3_5*ForConditionalGeneration`` checkpoints whose language model transformers loads as
    a causal LM).

    A stack whose every MLP is a mixture of experts may publish no dense ``intermediate_size`` (Qwen3.5-MoE:
    ``moe_intermediate_size`` and ``shared_expert_intermediate_size`` only). The drafters' dense MLP layers then
    take ``dense_intermediate_size``'s width, added to the returned dict (a copy; ``raw`` is left as it is)."""
    cfg = raw.get("text_config", raw) if "hidden_size" not in raw else raw
    if isinstance(cfg, dict) and "intermediate_size" not in cfg and "moe_intermediate_size" in cfg \
            and "hidden_size" in cfg:
        cfg = {**cfg, "intermediate_size": dense_intermediate_size(cfg)}
    return cfg


def dense_intermediate_size(cfg: dict) -> int:
    """The MLP width of a dense drafter layer for a target text config ``cfg``: its ``intermediate_size`` when it has
    one (dense stacks, Qwen3-Next, gpt-oss's per-expert width), else ``3 * hidden_size``, the width z-lab's DFlash
    drafter for the MoE-only Qwen3.6-35B-A3B (hidden 2048) has (``intermediate_size`` 6144 in
    z-lab/Qwen3.6-35B-A3B-DFlash's config.json). Raises ``KeyError`` when ``cfg`` has neither field."""
    if cfg.get("intermediate_size"):
        return int(cfg["intermediate_size"])
    return 3 * int(cfg["hidden_size"])
