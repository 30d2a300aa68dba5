"""Configuration: one keyword-only dataclass per component, composed by ``RunConfig``.

Each dataclass validates itself in ``__post_init__`` and raises ``ConfigError`` (a ``ValueError``) naming
the field. The command line (``supervisor/cli.py``) and ``--config FILE`` (TOML or YAML) map onto these
fields one to one; ``RunConfig.to_dict()`` / ``RunConfig.from_dict()`` are the serialised form that is
passed to child processes and stored in the run directory.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TARGET = REPO_ROOT / "assets" / "tiny-code-lm"
DEFAULT_DATA_DIR = REPO_ROOT / "data" / "demo"
LABEL_SOURCES = ("data", "target")


def _require(cond: bool, field_name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{field_name}: {msg}")


def _type_ok(value: Any, hint: Any) -> bool:
    """Whether ``value`` (from JSON/TOML/YAML) fits the annotation ``hint`` (int, float, str, bool,
    ``list[T]``, ``X | None``); bools are not ints, ints are floats."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    if hint is Any:
        return True
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint)


def _build(cls, values: dict[str, Any], where: str):
    """``cls(**values)`` after checking names and types; ``ConfigError`` names ``where.field``."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    bad = sorted(set(values) - known)
    if bad:
        raise ConfigError(f"unknown key(s) {bad} in config section {where!r} (known: {sorted(known)})")
    for k, v in values.items():
        if not _type_ok(v, hints[k]):
            raise ConfigError(f"{where}.{k}: expected {getattr(hints[k], '__name__', hints[k])}, "
                              f"got {type(v).__name__} {v!r}"[:300])
    return cls(**values)


@dataclass(kw_only=True)
class DataConfig:
    """Where the tokenized data lives and how it is cut into batches (see ``shared.data.BatchPlan``)."""
    data: str = ""                     # Arrow IPC file written by `launch.py prepare`; "" = demo corpus
    heldout: str = ""                  # held-out Arrow file for evaluation; "" = demo held-out split
    max_tokens: int = 8192             # padded tokens per batch
    max_batch_size: int = 64           # sequences per batch
    bucket_edges: list[int] | None = None
    num_buckets: int = 8
    seed: int = 0

    def __post_init__(self):
        _require(self.max_tokens > 0, "max_tokens", f"must be > 0, got {self.max_tokens}")
        _require(self.max_batch_size > 0, "max_batch_size", f"must be > 0, got {self.max_batch_size}")
        _require(self.num_buckets > 0, "num_buckets", f"must be > 0, got {self.num_buckets}")
        if self.bucket_edges is not None:
            e = list(self.bucket_edges)
            _require(all(a < b for a, b in zip(e, e[1:])), "bucket_edges", f"must be increasing, got {e}")


@dataclass(kw_only=True)
class RingConfig:
    """One ring per producer: ``num_slots`` slots of ``slot_bytes`` (0 = sized from the batch plan)."""
    num_slots: int = 4
    slot_bytes: int = 0
    checksum: bool = False             # CRC32 of every payload, verified by the consumer

    def __post_init__(self):
        _require(self.num_slots >= 2, "num_slots", f"must be >= 2 (one writing, one being read), got {self.num_slots}")
        _require(self.slot_bytes >= 0, "slot_bytes", f"must be >= 0, got {self.slot_bytes}")


@dataclass(kw_only=True)
class ProducerConfig:
    """The target model a producer runs and the layers it captures."""
    target: str = str(DEFAULT_TARGET)  # local Hugging Face checkpoint directory
    devices: list[str] = field(default_factory=lambda: ["cpu", "cpu"])  # one producer per entry
    dtype: str = "auto"                # auto = bfloat16 on CUDA, float32 on CPU
    target_layer_ids: list[int] | None = None  # DFlash convention: id i = output of decoder layer i
    num_target_layers: int = 5         # used when target_layer_ids is None
    random_weights: bool = False       # benchmarks: random target weights of the checkpoint's shape

    def __post_init__(self):
        _require(len(self.devices) >= 1, "producers", "at least one producer device is needed")
        _require(self.dtype in ("auto", "bfloat16", "float16", "float32"), "dtype",
                 f"must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        _require(self.num_target_layers >= 1, "num_target_layers", f"must be >= 1, got {self.num_target_layers}")
        if self.target_layer_ids is not None:
            ids = list(self.target_layer_ids)
            _require(len(ids) >= 1, "target_layers", "must name at least one layer")
            dup = sorted({i for i in ids if ids.count(i) > 1})
            _require(not dup, "target_layers", f"duplicate layer ids {dup}")
            _require(all(i >= 0 for i in ids), "target_layers", f"negative layer ids in {ids}")


@dataclass(kw_only=True)
class TrainerConfig:
    """DFlash drafter and its optimisation (see ``consumer/dflash.py`` and ``consumer/trainer.py``)."""
    devices: list[str] = field(default_factory=lambda: ["cpu"])  # one consumer (DP rank) per entry
    block_size: int = 16
    num_anchors: int = 512             # per sequence, at most
    gamma: float | None = None         # loss decay; None = 7 for B=16, 5 for B=10, 4 for B=8, else B/2.3
    num_draft_layers: int | None = None  # None = number of captured target layers
    mask_token_id: int | None = None   # None = tokenizer's mask token, else its pad token
    label_source: str = "target"       # target = the target's greedy next tokens (measured better); data = the corpus's
    distill_topk: int = 0              # > 0: the producer also sends the target's top-K log-probs; KL added to the loss
    distill_weight: float = 1.0        # weight of that KL term
    compile: bool | None = None        # torch.compile the draft layers; None = on CUDA (benchmarks/trainer.py)
    attention: str = "auto"            # auto (flex on CUDA, structured on CPU), flex, dense, structured
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    grad_accum: int = 1
    max_steps: int = 300
    epochs: int | None = None          # when set, train this many epochs (max_steps ignored)
    checkpoint_every: int = 100
    eval_every: int = 0                # optimizer steps between tau evaluations; 0 = at every checkpoint
    eval_prompts: int = 8              # held-out prompts per tau evaluation; 0 = no tau during training
    eval_max_new_tokens: int = 32
    eval_prompt_len: int = 64          # tokens of each held-out prompt (samples must be longer)
    max_nonfinite_in_row: int = 5
    seed: int = 0

    def __post_init__(self):
        _require(len(self.devices) >= 1, "consumers", "at least one consumer device is needed")
        _require(self.block_size >= 2, "block_size", f"must be >= 2, got {self.block_size}")
        _require(self.num_anchors >= 1, "num_anchors", f"must be >= 1, got {self.num_anchors}")
        _require(self.num_draft_layers is None or self.num_draft_layers >= 1, "num_draft_layers",
                 f"must be >= 1, got {self.num_draft_layers}")
        _require(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        _require(self.label_source in LABEL_SOURCES, "label_source",
                 f"must be one of {', '.join(LABEL_SOURCES)}, got {self.label_source!r}")
        _require(0 <= self.distill_topk <= 1024, "distill_topk", f"must be in 0..1024, got {self.distill_topk}")
        _require(self.distill_topk == 0 or self.label_source == "target", "distill_topk",
                 "needs label_source=target (the producer computes the target's distribution only then)")
        _require(self.distill_weight >= 0, "distill_weight", f"must be >= 0, got {self.distill_weight}")
        _require(self.attention in ("auto", "flex", "dense", "structured"), "attention",
                 f"must be auto, flex, dense or structured, got {self.attention!r}")
        _require(self.grad_accum >= 1, "grad_accum", f"must be >= 1, got {self.grad_accum}")
        _require(self.max_steps >= 1, "max_steps", f"must be >= 1, got {self.max_steps}")
        _require(self.epochs is None or self.epochs >= 1, "epochs", f"must be >= 1, got {self.epochs}")
        _require(self.checkpoint_every >= 1, "checkpoint_every", f"must be >= 1, got {self.checkpoint_every}")
        _require(self.max_nonfinite_in_row >= 1, "max_nonfinite_in_row", "must be >= 1")
        _require(self.eval_every >= 0, "eval_every", f"must be >= 0, got {self.eval_every}")
        _require(self.eval_prompts >= 0, "eval_prompts", f"must be >= 0, got {self.eval_prompts}")
        _require(self.eval_prompt_len >= 1, "eval_prompt_len", f"must be >= 1, got {self.eval_prompt_len}")

    def resolved_gamma(self) -> float:
        """The loss-decay γ for this block size (DFlash paper defaults: 7 / 5 / 4 for B = 16 / 10 / 8)."""
        if self.gamma is not None:
            return float(self.gamma)
        return {16: 7.0, 10: 5.0, 8: 4.0}.get(self.block_size, max(1.0, self.block_size / 2.3))


@dataclass(kw_only=True)
class MonitorConfig:
    """Health monitor: heartbeats, hang detection and the restart policy."""
    heartbeat_interval_s: float = 1.0
    hang_timeout_s: float = 60.0       # no heartbeat and no progress for this long = hung
    startup_timeout_s: float = 300.0   # a child must say Hello within this long
    max_restarts: int = 10             # per producer per window
    restart_window_s: float = 600.0
    backoff_base_s: float = 0.5
    backoff_max_s: float = 15.0
    shutdown_timeout_s: float = 120.0  # a consumer silent this long after Shutdown is terminated (a checkpoint write is silent)
    batch_timeout_s: float = 1800.0    # one batch (forward, training step, checkpoint) may take this long; longer = hung

    def __post_init__(self):
        _require(self.heartbeat_interval_s > 0, "heartbeat_interval_s", "must be > 0")
        _require(self.hang_timeout_s > 2 * self.heartbeat_interval_s, "hang_timeout_s",
                 f"must exceed twice heartbeat_interval_s ({self.heartbeat_interval_s})")
        _require(self.max_restarts >= 0, "max_restarts", "must be >= 0")
        for name in ("startup_timeout_s", "restart_window_s", "backoff_base_s", "backoff_max_s", "shutdown_timeout_s"):
            _require(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        _require(self.batch_timeout_s >= self.hang_timeout_s, "batch_timeout_s",
                 f"must be >= hang_timeout_s ({self.hang_timeout_s}), got {self.batch_timeout_s}")


@dataclass(kw_only=True)
class RunConfig:
    """Everything a run needs; child processes receive it as ``to_dict()``."""
    run_dir: str = "runs/default"
    run_id: str = ""
    resume: bool = False
    tcp: str = ""                      # "" = ipc:// sockets in run_dir; else "tcp://HOST:PORT"
    data: DataConfig = field(default_factory=DataConfig)
    ring: RingConfig = field(default_factory=RingConfig)
    producer: ProducerConfig = field(default_factory=ProducerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunConfig":
        """Build from a (possibly partial) nested mapping; unknown keys raise ``ConfigError`` naming them."""
        sections = {"data": DataConfig, "ring": RingConfig, "producer": ProducerConfig,
                    "trainer": TrainerConfig, "monitor": MonitorConfig}
        kwargs: dict[str, Any] = {}
        top = {f.name for f in dataclasses.fields(cls)}
        for key, value in d.items():
            if key not in top:
                raise ConfigError(f"unknown config key {key!r} (known: {sorted(top)})")
            if key in sections:
                if not isinstance(value, dict):
                    raise ConfigError(f"config section {key!r} must be a mapping, got {type(value).__name__}")
                kwargs[key] = _build(sections[key], value, key)
            else:
                kwargs[key] = value
        top_hints = {k: v for k, v in typing.get_type_hints(cls).items() if k not in sections}
        for k, v in kwargs.items():
            if k in top_hints and not _type_ok(v, top_hints[k]):
                raise ConfigError(f"{k}: expected {top_hints[k].__name__}, got {type(v).__name__} {v!r}")
        if kwargs.get("run_id") and not str(kwargs["run_id"]).isalnum():
            raise ConfigError(f"run_id: must be alphanumeric, got {kwargs['run_id']!r}")
        return cls(**kwargs)
