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
    """The language-model part of a target config (multimodal configs nest it in ``text_config``)."""
    return raw.get("text_config", raw) if "hidden_size" not in raw else raw
