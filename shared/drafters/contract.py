"""The drafter contract: what the rest of specring asks of a drafter family, and the typed values it gets back.

A *family* (DFlash, DFlash2, EAGLE-3, ...) is one ``DrafterFamily`` subclass in its own module of this package,
named in the registry (``shared/drafters/__init__.py``). Everything outside the family's module reaches the
family through that object: the trainer (``objective``, ``stats_layout``, ``step_metrics``), the τ evaluation and
``launch.py eval`` (``proposer``, ``untrained_like``), ``launch.py export`` (``export``, ``load_export``), run
planning (``resolve_layer_ids``, ``plan_line``, ``needs_draft_vocab``; the label source and top-K a family needs
are declared with its name in ``shared/config/families.py``) and checkpoints (``name`` is the checkpoint's kind,
``config_file`` its config file). No module outside this package compares a
drafter-kind string (``tests/unit/test_house.py`` holds that).

Statistics of a training step are named (``StepStats``), not positions in a float vector: the family declares
the names and shapes it sums (``stats_layout``), the trainer adds micro-batches, all-reduces the window across
data-parallel ranks as one float64 buffer and hands the sums back to the family, which turns them into the
metrics record (``step_metrics``). The names every family must provide are ``COMMON_STATS``.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:  # typing only: the config module does not import the drafters
    from specring.shared.config.run_config import RunConfig, TrainerConfig
    from specring.shared.transport.slot_batch import SlotBatch

# name -> what it sums; every family's layout has these (scalars)
COMMON_STATS = {
    "loss_sum": "the objective summed over the window, unnormalised (its gradient is what was back-propagated)",
    "weight_sum": "sum of the loss weights over labelled positions: the normaliser of loss_sum and the gradients",
    "accept_sum": "sum over blocks (DFlash) or positions (EAGLE-3) of the acceptance proxy",
    "num_blocks": "blocks (DFlash) or positions (EAGLE-3) the proxy is averaged over",
    "num_tokens": "packed tokens of the batches",
    "nonfinite": "micro-batches whose loss was not finite",
}


class StepStats:
    """Named sums of one micro-batch or one optimizer window, on the trainer's device.

    ``layout``: ``name -> number of elements`` (1 for a scalar); every tensor is float64 of that many elements.
    ``stats["name"]`` is the tensor (add to it in place); ``add`` sums another ``StepStats`` of the same layout;
    ``flat()``/``load_flat()`` give and take the one float64 buffer that ``torch.distributed.all_reduce`` sums;
    ``host()`` copies to Python (one synchronisation): scalars as ``float``, vectors as ``list[float]``.
    Raises ``KeyError`` naming an unknown statistic, ``ValueError`` for a layout missing ``COMMON_STATS``.
    """

    def __init__(self, layout: dict[str, int], device: torch.device | str = "cpu"):
        missing = sorted(set(COMMON_STATS) - set(layout))
        if missing:
            raise ValueError(f"StepStats: layout lacks the common statistics {missing}")
        self.layout = dict(layout)
        self._flat = torch.zeros(sum(layout.values()), dtype=torch.float64, device=device)
        self._views: dict[str, torch.Tensor] = {}
        offset = 0
        for name, n in self.layout.items():
            self._views[name] = self._flat[offset:offset + n]
            offset += n

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._views:
            raise KeyError(f"StepStats: no statistic {name!r} (have {sorted(self._views)})")
        return self._views[name]

    def __setitem__(self, name: str, value) -> None:
        """``stats[name] = value`` (and ``stats[name] += x``, which adds in place): copied into the buffer."""
        view = self[name]
        if value is not view:
            view.copy_(torch.as_tensor(value, dtype=torch.float64, device=view.device).reshape(view.shape)
                       if not torch.is_tensor(value) else value.reshape(view.shape))

    def add(self, other: "StepStats") -> "StepStats":
        """Add ``other`` (same layout) in place; returns self."""
        if other.layout != self.layout:
            raise ValueError("StepStats.add: layouts differ")
        self._flat += other._flat
        return self

    def flat(self) -> torch.Tensor:
        """The float64 buffer holding every statistic (a view: reducing it in place updates the statistics)."""
        return self._flat

    def host(self) -> dict[str, Any]:
        """Every statistic on the host: ``float`` for one-element ones, ``list[float]`` for vectors."""
        values = self._flat.detach().cpu().tolist()
        out, offset = {}, 0
        for name, n in self.layout.items():
            part = values[offset:offset + n]
            out[name] = part[0] if n == 1 and name in COMMON_STATS else part
            offset += n
        return out


@dataclass
class ObjectiveContext:
    """What a family's ``objective`` may use of the trainer: set up by ``consumer.trainer.Trainer``.

    ``attention``: the resolved attention form (``flex``, ``dense``, ``structured``; the trainer may fall back at
    warm-up); ``max_mask_elems``: score budget per forward of the grouped forms; ``loss_chunk_rows``: rows of
    ``[rows, V]`` float32 logits alive at once; ``autocast``: the context the forward runs under (bfloat16 on
    CUDA); ``seed``: the run seed (anchors are drawn from ``(seed, batch_ids)``); ``linear_ce``: the fused linear +
    cross-entropy of ``trainer.fused_ce`` (``shared.drafters.linear_ce.resolve_linear_ce``), None for the
    chunked float32 loss.
    """
    model: nn.Module
    tcfg: "TrainerConfig"
    dcfg: Any
    device: torch.device
    attention: str
    max_mask_elems: int
    loss_chunk_rows: int
    autocast: Any = field(default_factory=contextlib.nullcontext)
    seed: int = 0
    linear_ce: Any = None        # a fused linear + cross-entropy (dflash_blocks.resolve_linear_ce) or None
    extras: dict[str, Any] = field(default_factory=dict)   # per-family cached tensors (loss weights, ...)


class DrafterFamily(ABC):
    """One drafter family (see the module docstring). Subclasses set the class attributes and implement the
    abstract methods; the defaults below fit the DFlash-style families."""

    name: ClassVar[str]                    # the --drafter value and the checkpoint's kind
    config_cls: ClassVar[type]             # the drafter config dataclass
    model_cls: ClassVar[type]              # the drafter nn.Module
    config_file: ClassVar[str]             # the checkpoint's drafter-config file name
    export_architecture: ClassVar[str]     # config.json "architectures" of its serving format
    description: ClassVar[str]             # one line for --help
    needs_draft_vocab: ClassVar[bool] = False        # the run builds a draft vocabulary (draft_vocab.safetensors)
    acc_key: ClassVar[str] = "per_slot_acc"          # the metrics key of per-position accuracy
    uses_flex_attention: ClassVar[bool] = True       # the objective runs flex attention on CUDA (warm-up compiles it)
    needs_anchors: ClassVar[bool] = True             # trains on anchors (two adjacent loss tokens): the plan checks
    drafts_chain: ClassVar[bool] = False             # drafts one token after another (eval's --num-draft-tokens)

    # ------------------------------------------------------------------ configuration
    @abstractmethod
    def config_from_run(self, run: "RunConfig"):
        """The drafter config of a run (target, captured layers, flags)."""

    @abstractmethod
    def config_from_dict(self, d: dict[str, Any]):
        """The drafter config of a checkpoint's config file; ``ValueError`` naming unknown keys."""

    @abstractmethod
    def resolve_layer_ids(self, num_layers: int, ids: list[int] | None, n: int | None) -> list[int]:
        """The captured target layers (``shared.models.layer_ids``); ``ConfigError`` with ``key`` set."""

    @abstractmethod
    def plan_line(self, run: "RunConfig", plan: Any) -> str:
        """The parenthesised drafter summary of ``train --plan`` (``plan``: the ``supervisor.runplan.RunPlan``)."""

    def plan_notes(self, run: "RunConfig", num_layers: int, vocab_size: int, ids: list[int]) -> list[str]:
        """Notes for ``train --plan`` about how the flags were read for this target (before ``run`` holds ``ids``,
        the resolved capture layers); default: none."""
        return []

    def check_run(self, run: "RunConfig") -> None:
        """Refuse flags this family cannot honour (``ConfigError`` naming the flag); default: nothing."""

    # ------------------------------------------------------------------ model
    @abstractmethod
    def build(self, dcfg, target_dir: str | Path | None = None, *, draft_vocab=None) -> nn.Module:
        """A drafter initialised from the global RNG on the CPU in float32; with ``target_dir`` its frozen
        tensors (embedding, LM head) loaded from the target."""

    def compiled_modules(self, model: nn.Module) -> list[nn.Module]:
        """The modules ``torch.compile`` wraps in place (parameter names unchanged); default: ``model.layers``."""
        return list(model.layers)

    def num_positions(self, dcfg, tcfg: "TrainerConfig") -> int:
        """How many draft positions the per-position statistics have (DFlash: block size)."""
        return int(tcfg.block_size)

    def warm_up_token(self, dcfg) -> int:
        """A token id to fill the synthetic warm-up batch with."""
        return int(getattr(dcfg, "mask_token_id", 0))

    # ------------------------------------------------------------------ training
    @abstractmethod
    def stats_layout(self, dcfg, tcfg: "TrainerConfig") -> dict[str, int]:
        """``name -> elements`` of the statistics ``objective`` sums (``COMMON_STATS`` included)."""

    @abstractmethod
    def objective(self, ctx: ObjectiveContext, batch: "SlotBatch", batch_ids: list[int], t: int,
                  backward: bool) -> StepStats:
        """Forward (and, with ``backward``, backward) of one checked micro-batch (a
        ``shared.transport.slot_batch.SlotBatch``: ``hidden [T, F]``, ``input_ids [T]``, ``loss_mask [T]``,
        ``cu_seqlens [S+1]``, optional target labels; host or device); returns its statistics. The gradient left in
        the parameters is that of ``loss_sum``."""

    @abstractmethod
    def step_metrics(self, sums: dict[str, Any]) -> dict[str, Any]:
        """The family's named metrics of a window from ``StepStats.host()``: at least ``loss`` and
        ``accept_proxy`` and the per-position accuracy under ``acc_key``."""

    def check_resume(self, model: nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
        """Refuse a checkpoint whose family-specific tensors differ from this trainer's; default: nothing."""

    # ------------------------------------------------------------------ decoding
    @abstractmethod
    def proposer(self, model: nn.Module, *, block_size: int | None = None, num_draft_tokens: int | None = None):
        """A proposer over ``model`` for ``shared.models.speculative`` (greedy ``propose`` and sampling
        ``propose_sample``)."""

    @abstractmethod
    def verify_block_size(self, model: nn.Module, block_size: int | None = None,
                          num_draft_tokens: int | None = None) -> int:
        """The verify block (drafts + 1) this drafter decodes with by default or as asked."""

    @abstractmethod
    def untrained_like(self, model: nn.Module, target_dir: str | Path, device, dtype: torch.dtype,
                       seed: int = 0) -> nn.Module:
        """The untrained baseline of ``model``: its shape, the target's frozen tensors, seeded initialisation
        (the global RNG untouched), eval mode."""

    # ------------------------------------------------------------------ checkpoints and export
    @abstractmethod
    def load_checkpoint_model(self, tensors: dict[str, torch.Tensor], config: dict[str, Any], where: str,
                              dtype: torch.dtype, require_head: bool) -> nn.Module:
        """The drafter of a checkpoint's tensors and config (frozen tensors installed when present);
        ``ValueError`` naming ``where`` for missing or unexpected weights."""

    @abstractmethod
    def export(self, step_dir: Path, output_dir: Path, target_dir: str | Path | None, dtype: str,
               overwrite: bool = False, trust_remote_code: bool = False) -> Path:
        """Write the serving directory of the checkpoint ``step_dir``; ``ValueError`` for every refusal."""

    @abstractmethod
    def export_summary(self, export_dir: Path) -> list[str]:
        """The lines ``launch.py export`` prints about a written export (what it is, how to serve it)."""

    @abstractmethod
    def load_export(self, export_dir: Path, device: str | torch.device = "cpu",
                    target_dir: str | Path | None = None, dtype: torch.dtype | None = None) -> nn.Module:
        """The drafter of an export directory as served (its dtype unless ``dtype``), frozen tensors from
        ``target_dir`` (default: the target recorded at export)."""
