"""Configuration: one keyword-only dataclass per component, composed by ``RunConfig``.

Each dataclass validates itself in ``__post_init__`` and raises ``ConfigError`` (a ``ValueError``) naming
the field. The command line (``supervisor/cli.py``) and ``--config FILE`` (TOML or YAML) map onto these
fields one to one; ``RunConfig.to_dict()`` / ``RunConfig.from_dict()`` are the serialised form that is
passed to child processes and stored in the run directory.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable

from specring.shared.errors import ConfigError
from specring.shared.paths import DEFAULT_TARGET

LABEL_SOURCES = ("data", "target")


MAX_SECONDS = 10**6                  # ~11.6 days: the longest duration any timeout or interval may ask for
MAX_SEED = 2**63 - 1
MAX_INT32 = 2**31 - 1                # token positions, cu_seqlens and list offsets are int32
MAX_SLOT_BYTES = 2**40               # 1 TiB


def _require(cond: bool, field_name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{field_name}: {msg}", key=field_name, detail=msg)


def num(default: Any = dataclasses.MISSING, *, ge: float | None = None, gt: float | None = None,
        le: float | None = None, unit: str = "", **kw: Any) -> Any:
    """A numeric dataclass field with its bounds: ``check_numbers`` refuses NaN, infinities and values
    outside ``[ge, le]`` / ``(gt, le]`` (for a ``list`` field, each item). ``unit`` is shown in errors."""
    meta = {"ge": ge, "gt": gt, "le": le, "unit": unit}
    if default is dataclasses.MISSING:
        return field(metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


def _show(x: float) -> str:
    return f"{x:.4g}" if isinstance(x, float) or abs(x) >= 10**15 else str(x)


def check_numbers(obj: Any) -> None:
    """Check every number of the dataclass ``obj`` against its field: finite (no NaN or infinity, which
    TOML, YAML and ``float()`` all accept) and inside the bounds that ``num`` declared.

    Items of list fields are checked one by one; ``None`` and non-numbers are left to the type check.
    Raises ``ConfigError`` whose ``key`` is the field name and whose message names the field and value.
    """
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        items = value if isinstance(value, (list, tuple)) else [value]
        m = f.metadata
        for x in items:
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                continue
            unit = f" {m['unit']}" if m.get("unit") else ""
            if isinstance(x, float) and not math.isfinite(x):
                _require(False, f.name, f"must be a finite number, got {x!r}")
            if m.get("ge") is not None:
                _require(x >= m["ge"], f.name, f"must be >= {_show(m['ge'])}{unit}, got {_show(x)}")
            if m.get("gt") is not None:
                _require(x > m["gt"], f.name, f"must be > {_show(m['gt'])}{unit}, got {_show(x)}")
            if m.get("le") is not None:
                _require(x <= m["le"], f.name, f"must be <= {_show(m['le'])}{unit}, got {_show(x)}")


def finite_number(kind: type = float, scale: float = 1.0) -> Callable[[str], Any]:
    """An ``argparse`` ``type=`` for every numeric flag: the text as a finite ``kind`` (``int`` or
    ``float``), times ``scale`` (``--slot-mb`` gives bytes, ``scale=2**20``).

    NaN and infinities (which ``float()`` accepts) are refused, and so is an ``int`` flag whose value is
    not a whole number (``1e3`` is 1000, ``2.5`` is refused) or exceeds 2**62 after scaling, with
    ``argparse.ArgumentTypeError`` (argparse then names the flag). Range checks stay with the config
    field the flag maps onto (``check_numbers``), so they are declared once.
    """
    import argparse

    def parse(text: str) -> Any:
        try:
            x: Any = int(text) if kind is int and scale == 1.0 else float(text)
        except ValueError:
            try:
                x = float(text)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
        if isinstance(x, float) and not math.isfinite(x):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        x = x * scale if scale != 1.0 else x
        if kind is float:
            if not math.isfinite(x):
                raise argparse.ArgumentTypeError(f"{text!r} is too large")
            return float(x)
        if isinstance(x, float) and scale == 1.0 and not x.is_integer():
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
        if not abs(x) <= 2**62:
            raise argparse.ArgumentTypeError(f"{text!r} is too large")
        return int(x)

    parse.__name__ = kind.__name__
    return parse


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
    """``cls(**values)`` after checking names and types; ``ConfigError`` names ``where.field`` (its ``key``)."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    bad = sorted(set(values) - known)
    if bad:
        raise ConfigError(f"unknown key(s) {bad} in config section {where!r} (known: {sorted(known)})")
    for k, v in values.items():
        if not _type_ok(v, hints[k]):
            detail = f"expected {getattr(hints[k], '__name__', hints[k])}, got {type(v).__name__} {v!r}"[:300]
            raise ConfigError(f"{where}.{k}: {detail}", key=f"{where}.{k}", detail=detail)
    try:
        return cls(**values)
    except ConfigError as e:
        if e.key and "." not in e.key:
            key = f"{where}.{e.key}"
            raise ConfigError(f"{key}: {e.detail}", key=key, detail=e.detail) from None
        raise


@dataclass(kw_only=True)
class DataConfig:
    """Where the tokenized data lives and how it is cut into batches (see ``shared.data.BatchPlan``)."""
    data: str = ""                     # Arrow IPC file written by `launch.py prepare`; "" = demo corpus
    heldout: str = ""                  # held-out Arrow file for evaluation; "" = demo held-out split
    max_tokens: int = num(8192, ge=1, le=MAX_INT32)        # padded tokens per batch
    max_batch_size: int = num(64, ge=1, le=2**20)          # sequences per batch
    bucket_edges: list[int] | None = num(None, ge=0, le=MAX_INT32)
    num_buckets: int = num(8, ge=1, le=2**16)
    seed: int = num(0, ge=0, le=MAX_SEED)

    def __post_init__(self):
        check_numbers(self)
        if self.bucket_edges is not None:
            e = list(self.bucket_edges)
            _require(all(a < b for a, b in zip(e, e[1:])), "bucket_edges", f"must be increasing, got {e}")


@dataclass(kw_only=True)
class RingConfig:
    """One ring per producer: ``num_slots`` slots of ``slot_bytes`` (0 = sized from the batch plan)."""
    num_slots: int = num(4, ge=2, le=4096)   # >= 2: one slot being written, one being read
    slot_bytes: int = num(0, ge=0, le=MAX_SLOT_BYTES, unit="bytes")
    checksum: bool = False             # CRC32 of every payload, verified by the consumer

    def __post_init__(self):
        check_numbers(self)


@dataclass(kw_only=True)
class ProducerConfig:
    """The target model a producer runs and the layers it captures."""
    target: str = str(DEFAULT_TARGET)  # local Hugging Face checkpoint directory
    devices: list[str] = field(default_factory=lambda: ["cpu", "cpu"])  # one producer per entry
    dtype: str = "auto"                # auto = bfloat16 on CUDA, float32 on CPU
    # DFlash convention: id i = output of decoder layer i
    target_layer_ids: list[int] | None = num(None, ge=0, le=2**16)
    # used when target_layer_ids is None; None = the DFlash default (5, fewer on a shallow target)
    num_target_layers: int | None = num(None, ge=1, le=2**16)
    random_weights: bool = False       # benchmarks: random target weights of the checkpoint's shape

    def __post_init__(self):
        check_numbers(self)
        _require(len(self.devices) >= 1, "devices", "at least one producer device is needed")
        _require(self.dtype in ("auto", "bfloat16", "float16", "float32"), "dtype",
                 f"must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        if self.target_layer_ids is not None:
            ids = list(self.target_layer_ids)
            _require(len(ids) >= 1, "target_layer_ids", "must name at least one layer")
            dup = sorted({i for i in ids if ids.count(i) > 1})
            _require(not dup, "target_layer_ids", f"duplicate layer ids {dup}")


@dataclass(kw_only=True)
class TrainerConfig:
    """DFlash drafter and its optimisation (see ``consumer/dflash.py`` and ``consumer/trainer.py``)."""
    devices: list[str] = field(default_factory=lambda: ["cpu"])  # one consumer (DP rank) per entry
    block_size: int = num(16, ge=2, le=1024)
    num_anchors: int = num(512, ge=1, le=2**20)    # per sequence, at most
    gamma: float | None = num(None, gt=0, le=1e6)  # loss decay; None = 7 for B=16, 5 for B=10, 4 for B=8, else B/2.3
    num_draft_layers: int | None = num(None, ge=1, le=1024)  # None = number of captured target layers
    mask_token_id: int | None = num(None, ge=0, le=MAX_INT32)  # None = tokenizer's mask token, else its pad token
    label_source: str = "target"       # target = the target's greedy next tokens (measured better); data = the corpus's
    distill_topk: int = num(0, ge=0, le=1024)  # > 0: the producer also sends the target's top-K log-probs; KL added
    distill_weight: float = num(1.0, ge=0, le=1e6)  # weight of that KL term
    compile: bool | None = None        # torch.compile the draft layers; None = on CUDA (benchmarks/trainer.py)
    attention: str = "auto"            # auto (flex on CUDA, structured on CPU), flex, dense, structured
    lr: float = num(6e-4, gt=0, le=1e3)
    min_lr_ratio: float = num(0.1, ge=0, le=1)
    warmup_steps: int = num(20, ge=0, le=10**9)
    weight_decay: float = num(0.01, ge=0, le=1e3)
    grad_clip: float = num(1.0, gt=0, le=1e9)
    grad_accum: int = num(1, ge=1, le=2**16)
    max_steps: int = num(300, ge=1, le=10**9)
    epochs: int | None = num(None, ge=1, le=10**6)  # when set, train this many epochs (max_steps ignored)
    checkpoint_every: int = num(100, ge=1, le=10**9)
    eval_every: int = num(0, ge=0, le=10**9)       # optimizer steps between tau evaluations; 0 = at every checkpoint
    eval_prompts: int = num(8, ge=0, le=10**6)     # held-out prompts per tau evaluation; 0 = no tau during training
    eval_max_new_tokens: int = num(32, ge=1, le=2**20)
    eval_prompt_len: int = num(64, ge=1, le=MAX_INT32)  # tokens of each held-out prompt (samples must be longer)
    max_nonfinite_in_row: int = num(5, ge=1, le=10**9)
    seed: int = num(0, ge=0, le=MAX_SEED)

    def __post_init__(self):
        check_numbers(self)
        _require(len(self.devices) >= 1, "devices", "at least one consumer device is needed")
        _require(self.label_source in LABEL_SOURCES, "label_source",
                 f"must be one of {', '.join(LABEL_SOURCES)}, got {self.label_source!r}")
        _require(self.distill_topk == 0 or self.label_source == "target", "distill_topk",
                 "needs label_source=target (the producer computes the target's distribution only then)")
        _require(self.attention in ("auto", "flex", "dense", "structured"), "attention",
                 f"must be auto, flex, dense or structured, got {self.attention!r}")

    def resolved_gamma(self) -> float:
        """The loss-decay γ for this block size (DFlash paper defaults: 7 / 5 / 4 for B = 16 / 10 / 8)."""
        if self.gamma is not None:
            return float(self.gamma)
        return {16: 7.0, 10: 5.0, 8: 4.0}.get(self.block_size, max(1.0, self.block_size / 2.3))


@dataclass(kw_only=True)
class MonitorConfig:
    """Health monitor: heartbeats, hang detection and the restart policy (durations in seconds, at most
    ``MAX_SECONDS``)."""
    heartbeat_interval_s: float = num(1.0, gt=0, le=MAX_SECONDS)
    hang_timeout_s: float = num(60.0, gt=0, le=MAX_SECONDS)       # no heartbeat and no progress for this long = hung
    startup_timeout_s: float = num(300.0, ge=0, le=MAX_SECONDS)   # a child must say Hello within this long
    max_restarts: int = num(10, ge=0, le=10**6)                   # per producer per window
    restart_window_s: float = num(600.0, ge=0, le=MAX_SECONDS)
    backoff_base_s: float = num(0.5, ge=0, le=MAX_SECONDS)
    backoff_max_s: float = num(15.0, ge=0, le=MAX_SECONDS)
    # a consumer silent this long after Shutdown is terminated (a checkpoint write is silent)
    shutdown_timeout_s: float = num(120.0, ge=0, le=MAX_SECONDS)
    # one batch (forward, training step, checkpoint) may take this long; longer = hung
    batch_timeout_s: float = num(1800.0, gt=0, le=MAX_SECONDS)

    def __post_init__(self):
        check_numbers(self)
        _require(self.hang_timeout_s > 2 * self.heartbeat_interval_s, "hang_timeout_s",
                 f"must exceed twice heartbeat_interval_s ({self.heartbeat_interval_s})")
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

    def __post_init__(self):
        # Where each value came from, for error messages: "section.field" -> "--flag" or "--config F: key"
        # (filled by the command line; not part of the serialised configuration).
        self.sources: dict[str, str] = {}

    def origin(self, key: str) -> str:
        """How to name the configuration key ``key`` ("producer.num_target_layers") in an error: the flag
        or config file it came from (``sources``), else the key itself."""
        return self.sources.get(key, key)

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
