"""The drafter families by ``--drafter`` name, and the facts about each that a run's configuration checks: one
declaration, read by the configuration (``shared.config.run_config``: the flag's choices and default, the label
source a family needs, its default top-K) and by the registry (``shared.drafters``: which module defines each
family, imported on first use). Torch-free and importing nothing of ``shared/``, so that the configuration does
not import the drafters that read it.

Adding a family: write its module behind the contract (``shared/drafters/contract.py``) and add one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_EAGLE3_TOPK = 32  # top-K of the target's distribution an EAGLE-3 run learns by default


@dataclass(frozen=True)
class FamilyEntry:
    """One registered family. ``module``: ``"package.module:OBJECT"`` of its ``DrafterFamily`` instance;
    ``requires_target_labels``: it learns the target's distribution, so the run needs ``label_source=target``;
    ``default_distill_topk``: top-K of the target's distribution the producers send when ``distill_topk`` is
    not given (0: none)."""
    module: str
    requires_target_labels: bool = False
    default_distill_topk: int = 0


FAMILIES: dict[str, FamilyEntry] = {
    "dflash": FamilyEntry("specring.shared.drafters.dflash:FAMILY"),
    "dflash2": FamilyEntry("specring.shared.drafters.dflash2:FAMILY"),
    "eagle3": FamilyEntry("specring.shared.drafters.eagle3:FAMILY", requires_target_labels=True,
                          default_distill_topk=DEFAULT_EAGLE3_TOPK),
}

NAMES: tuple[str, ...] = tuple(FAMILIES)
DEFAULT_FAMILY = "dflash"  # what --drafter means when it is not given
