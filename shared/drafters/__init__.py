"""The drafter registry: every drafter family specring trains, by its ``--drafter`` name.

The families are declared in ``shared/config/families.py`` (``FAMILIES``: each entry names the module that
defines the family, a ``DrafterFamily`` subclass of ``shared/drafters/contract.py``, and the object in it, with the
facts the configuration checks); the module is imported on first use, so that reading the names (flags, help,
config checks) imports no model code. Adding a family: write its module (config, model, objective, proposer,
export) behind the contract and add one entry there; nothing else in specring names a family (docs/DESIGN.md,
"Drafter families").
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specring.shared.drafters.contract import DrafterFamily

from specring.shared.config.families import DEFAULT_FAMILY, FAMILIES, NAMES  # noqa: F401 - the registry's names

_loaded: dict[str, "DrafterFamily"] = {}


def get_family(name: str) -> "DrafterFamily":
    """The family registered as ``name``. Raises ``ValueError`` naming the known families for another name."""
    if name not in FAMILIES:
        raise ValueError(f"drafter: unknown drafter family {name!r} (known: {', '.join(NAMES)})")
    if name not in _loaded:
        module, attr = FAMILIES[name].module.split(":")
        _loaded[name] = getattr(importlib.import_module(module), attr)
    return _loaded[name]


def family_of(obj: Any) -> "DrafterFamily":
    """The family whose drafter config or drafter model ``obj`` is (by class, most derived first). Raises
    ``TypeError`` when no registered family owns it."""
    best = None
    for name in NAMES:
        fam = get_family(name)
        for cls in (fam.config_cls, fam.model_cls):
            if type(obj) is cls:
                return fam
            if isinstance(obj, cls) and (best is None or issubclass(cls, best[1])):
                best = (fam, cls)
    if best is None:
        raise TypeError(f"{type(obj).__name__} is not the config or model of a registered drafter family")
    return best[0]


def family_of_export(export_dir: str | Path) -> "DrafterFamily":
    """The family whose serving format the export at ``export_dir`` is (its ``config.json`` ``architectures``).
    Raises ``ValueError`` naming the file when no registered family writes that architecture."""
    from specring.shared.json_file import read_json
    path = Path(export_dir) / "config.json"
    cfg = read_json(path)  # CorruptFile naming it when it is not JSON
    archs = (cfg.get("architectures") if isinstance(cfg, dict) else None) or []
    for name in NAMES:
        fam = get_family(name)
        if fam.export_architecture in archs:
            return fam
    raise ValueError(f"{path}: architectures {archs} are not the serving format of a drafter family "
                     f"({', '.join(get_family(n).export_architecture for n in NAMES)})")


def load_export(export_dir: str | Path, device: Any = "cpu"):
    """The drafter of an export directory as it is served, by its family (``family_of_export``)."""
    return family_of_export(export_dir).load_export(Path(export_dir), device)
