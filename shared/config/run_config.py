"""Configuration: one keyword-only dataclass per component, composed by ``RunConfig``; each field declared once.

Every field of ``DataConfig``, ``RingConfig``, ``ProducerConfig``, ``TrainerConfig``, ``MonitorConfig`` and
the plain fields of ``RunConfig`` is declared with ``num(...)`` (a number, with its bounds) or
``setting(...)`` (anything else): type (the annotation), default, bounds and, in the field's metadata, a
help line and what the command line needs to know about it (``FieldSpec`` lists the keys). From that one
declaration come:

* validation: ``__post_init__`` checks bounds and choices (``check_fields``) and raises ``ConfigError``
  (a ``ValueError``) naming the field;
* ``--config FILE`` (TOML or YAML): ``RunConfig.from_dict`` accepts exactly these sections and fields,
  refusing any other key by name;
* the flags of ``launch.py train`` (``specring.cli.flags``): ``--SECTION.FIELD-NAME`` for every field
  (``--trainer.grad-clip``, ``--monitor.backoff-max-s``; ``--run-dir`` for ``RunConfig``'s own), the
  declared short aliases (``--lr``, ``--producers``, ``--slot-mb`` with its scale), the parsing of each
  type, ``--help`` with every default, the CPU defaults and what ``--resume`` may change.

``RunConfig.to_dict()`` / ``RunConfig.from_dict()`` are the serialised form that is passed to child
processes and stored in the run directory (``config.json``).

The other commands' options (``eval``, ``export``, ``regenerate``, ``prepare``, ``status``, ``restart``, ``clean``,
``report``) are declared the same way, in ``specring.shared.commands.command_config``; ``option_specs`` walks such a
class as ``field_specs`` walks ``RunConfig``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping

from specring.shared import envs
from specring.shared.config.families import DEFAULT_EAGLE3_TOPK, DEFAULT_FAMILY, FAMILIES
from specring.shared.config.families import NAMES as DRAFTER_NAMES
from specring.shared.errors import ConfigError
from specring.shared.paths import DEFAULT_TARGET

LABEL_SOURCES = ("target", "data")
REPORT_BACKENDS = ("tensorboard", "wandb", "mlflow")   # --report-to (supervisor/reporting.py writes them)
DRAFTERS = DRAFTER_NAMES            # the --drafter choices: every registered family (shared/config/families.py)
LOSSES = ("ce", "dpace")
FUSED_CE = ("auto", "liger", "torch", "off")  # shared.drafters.linear_ce.resolve_linear_ce
LIGER_AUTO_MIN_VOCAB = 65_536  # fused_ce auto: Liger from this vocabulary size up (resolve_linear_ce says why)


MAX_SECONDS = 10**6                  # ~11.6 days: the longest duration any timeout or interval may ask for
MAX_SEED = 2**63 - 1
MAX_INT32 = 2**31 - 1                # token positions, cu_seqlens and list offsets are int32
MAX_SLOT_BYTES = 2**40               # 1 TiB


def _require(cond: bool, field_name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{field_name}: {msg}", key=field_name, detail=msg)


@dataclass(frozen=True)
class Alias:
    """A short flag of a field, e.g. ``Alias("--slot-mb", scale=2**20, unit="MiB")``: the flag's value
    times ``scale`` is the field's value (``unit`` names the flag's unit in help and errors)."""
    flag: str
    scale: int = 1
    unit: str = ""


def setting(default: Any = dataclasses.MISSING, *, help: str = "", aliases: tuple = (),
            choices: tuple = (), cpu_default: Any = dataclasses.MISSING, resume: bool = False,
            group: str | None = None, metavar: str | None = None, default_text: str | None = None,
            machine_default: Callable[[], Any] | None = None, follows: str | None = None,
            filled_at_start: bool = False, path: bool = False, hub: bool = False, switch: bool = False,
            nargs: str | None = None, repeat: bool = False, positional: bool = False, ge: float | None = None,
            gt: float | None = None, le: float | None = None, unit: str = "", **kw: Any) -> Any:
    """Declare a config field: its default and everything derived from it (see ``FieldSpec``).

    ``help`` is the one line ``--help`` shows (the default is appended); ``aliases`` are short flags
    (``"--lr"`` or ``Alias(...)``) besides ``--SECTION.FIELD-NAME``; ``choices`` the allowed values;
    ``cpu_default`` the default when every device is CPU; ``resume=True``: the value may change on
    ``--resume``; ``path=True``: a file or directory (compared resolved); ``hub=True``: a directory or a Hugging
    Face hub id (``shared.models.hub.resolve_model_dir``, resolved when the run starts); ``ge``/``gt``/``le``/``unit``:
    bounds of a number (see ``num``); ``switch``/``nargs``/``repeat``/``positional``: how a command's flag takes
    its value (see ``FieldSpec``); the other keywords are described on ``FieldSpec``. A list default is copied
    for each instance."""
    meta: dict[str, Any] = {"ge": ge, "gt": gt, "le": le, "unit": unit, "help": help,
                            "aliases": tuple(a if isinstance(a, Alias) else Alias(a) for a in aliases),
                            "choices": tuple(choices), "resume": resume, "group": group, "metavar": metavar,
                            "default_text": default_text, "machine_default": machine_default,
                            "follows": follows, "filled_at_start": filled_at_start, "path": path,
                            "hub": hub, "switch": switch, "nargs": nargs, "repeat": repeat, "positional": positional}
    if cpu_default is not dataclasses.MISSING:
        meta["cpu_default"] = cpu_default
    if isinstance(default, list):
        return field(default_factory=functools.partial(list, default), metadata=meta, **kw)
    if default is dataclasses.MISSING:
        return field(metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


def num(default: Any = dataclasses.MISSING, *, ge: float | None = None, gt: float | None = None,
        le: float | None = None, unit: str = "", **kw: Any) -> Any:
    """A numeric dataclass field with its bounds: ``check_numbers`` refuses NaN, infinities and values
    outside ``[ge, le]`` / ``(gt, le]`` (for a ``list`` field, each item). ``unit`` is shown in errors.
    Other keywords are those of ``setting`` (help, aliases, ...)."""
    return setting(default, ge=ge, gt=gt, le=le, unit=unit, **kw)


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


def check_fields(obj: Any) -> None:
    """``check_numbers``, then every field with declared ``choices`` holds one of them (each item of a list
    field; ``None`` is left to the type check), and every field the class names in its ``REQUIRED`` (a
    command's option whose shared declaration has a default, e.g. ``regenerate``'s ``target``) is set (not
    ``None`` or empty). Raises ``ConfigError`` naming the field."""
    check_numbers(obj)
    for f in dataclasses.fields(obj):
        choices = f.metadata.get("choices")
        value = getattr(obj, f.name)
        if choices and value is not None:
            for x in value if isinstance(value, list) else [value]:
                _require(x in choices, f.name, f"must be one of {', '.join(map(str, choices))}, got {x!r}")
    for name in getattr(type(obj), "REQUIRED", ()):
        _require(getattr(obj, name) not in (None, "", []), name, "is required")


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


def type_name(hint: Any) -> str:
    """``int``, ``list[int]``, ``float | None``: how errors and help name an annotation."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " | ".join(type_name(h) for h in typing.get_args(hint))
    if hint is type(None):
        return "None"
    if typing.get_origin(hint) is list:
        return f"list[{type_name(typing.get_args(hint)[0])}]"
    return getattr(hint, "__name__", str(hint))


def _build(cls, values: dict[str, Any], where: str):
    """``cls(**values)`` after checking names and types; ``ConfigError`` names ``where.field`` (its ``key``)."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    bad = sorted(set(values) - known)
    if bad:
        raise ConfigError(f"unknown key(s) {bad} in config section {where!r} (known: {sorted(known)})")
    for k, v in values.items():
        if not _type_ok(v, hints[k]):
            detail = f"expected {type_name(hints[k])}, got {type(v).__name__} {v!r}"[:300]
            raise ConfigError(f"{where}.{k}: {detail}", key=f"{where}.{k}", detail=detail)
    try:
        return cls(**values)
    except ConfigError as e:
        if e.key and "." not in e.key:
            key = f"{where}.{e.key}"
            raise ConfigError(f"{key}: {e.detail}", key=key, detail=e.detail) from None
        raise


def default_devices() -> tuple[list[str], list[str]]:
    """``(producer devices, consumer devices)`` of this machine: 2 producers + 1 consumer, on CPU, or spread
    over the GPUs when there are some (1 GPU: all on cuda:0; 2: producers on cuda:0, the consumer on cuda:1;
    3 or more: producers on cuda:0 and cuda:1, the consumer on cuda:2)."""
    try:
        import torch
        g = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        g = 0
    if g == 0:
        return ["cpu", "cpu"], ["cpu"]
    if g == 1:
        return ["cuda:0", "cuda:0"], ["cuda:0"]
    if g == 2:
        return ["cuda:0", "cuda:0"], ["cuda:1"]
    return ["cuda:0", "cuda:1"], ["cuda:2"]




@dataclass(kw_only=True)
class DataConfig:
    """Where the tokenized data lives and how it is cut into batches (see ``shared.data.dataset.BatchPlan``)."""
    GROUP: ClassVar[str] = "data"
    data: str = setting("", aliases=("--data",), path=True, resume=True, filled_at_start=True,
                        default_text="the demo corpus, prepared on first use",
                        help="Arrow file written by `launch.py prepare`; a resumed run checks that its content "
                             "is what the run trained on")
    heldout: str = setting("", aliases=("--heldout",), path=True, resume=True, filled_at_start=True,
                           default_text="the demo held-out split with the demo corpus, else none",
                           help="held-out Arrow file whose prompts measure tau (acceptance length) during training")
    max_tokens: int = num(8192, ge=1, le=MAX_INT32, aliases=("--max-tokens",), cpu_default=2048,
                          help="padded tokens per batch")
    max_batch_size: int = num(64, ge=1, le=2**20, aliases=("--max-batch-size",), help="sequences per batch")
    bucket_edges: list[int] | None = num(None, ge=0, le=MAX_INT32,
                                         help="increasing sequence lengths that bound the length buckets of the "
                                              "batch plan; none: num_buckets buckets at the length quantiles")
    num_buckets: int = num(8, ge=1, le=2**16, help="length buckets when bucket_edges is none")
    seed: int = num(0, ge=0, le=MAX_SEED, follows="trainer.seed",
                    help="seed of the batch plan's shuffle (the batch order)")

    def __post_init__(self):
        check_fields(self)
        if self.bucket_edges is not None:
            e = list(self.bucket_edges)
            _require(all(a < b for a, b in zip(e, e[1:])), "bucket_edges", f"must be increasing, got {e}")


@dataclass(kw_only=True)
class RingConfig:
    """One ring per producer: ``num_slots`` slots of ``slot_bytes`` (0 = sized from the batch plan)."""
    GROUP: ClassVar[str] = "rings"
    num_slots: int = num(4, ge=2, le=4096, aliases=("--num-slots",),
                         help="slots per producer ring (at least 2: one being written, one being read)")
    slot_bytes: int = num(0, ge=0, le=MAX_SLOT_BYTES, unit="bytes", filled_at_start=True,
                          aliases=(Alias("--slot-mb", scale=2**20, unit="MiB"),),
                          help="size of one slot (the hidden states of one batch); 0: sized from the batch plan")
    checksum: bool = setting(False, aliases=("--checksum",),
                             help="CRC32 of every slot payload, verified by the consumer")

    def __post_init__(self):
        check_fields(self)


@dataclass(kw_only=True)
class ProducerConfig:
    """The target model a producer runs and the layers whose hidden states it captures."""
    GROUP: ClassVar[str] = "target & capture"
    target: str = setting(str(DEFAULT_TARGET), aliases=("--target",), path=True, hub=True, metavar="DIR|ORG/NAME",
                          default_text="the embedded fixture, assets/tiny-code-lm",
                          help="target checkpoint: a directory (Hugging Face format) or a hub id such as "
                               "Qwen/Qwen3-8B[@revision], resolved once at start from the local Hugging Face "
                               "cache (downloaded into it unless HF_HUB_OFFLINE=1); the run records the directory")
    trust_remote_code: bool = setting(False, aliases=("--trust-remote-code",),
                                      help="let transformers run the modelling and tokenizer code that the "
                                           "target's directory ships (model families outside transformers), in "
                                           "every process that loads the target or its tokenizer")
    devices: list[str] = setting(["cpu", "cpu"], aliases=("--producers",), group="topology",
                                 machine_default=lambda: default_devices()[0],
                                 default_text="cpu,cpu; with GPUs cuda:0,cuda:0 (1 or 2 GPUs), cuda:0,cuda:1 (3+)",
                                 help="one producer (a target that sends hidden states) per device, "
                                      "e.g. cuda:0,cuda:1 or cpu,cpu; a producer over several devices joins "
                                      "them with +: cuda:0+cuda:1,cuda:2+cuda:3 (the target's layers split over "
                                      "each group)")
    dtype: str = setting("auto", aliases=("--dtype",), choices=("auto", "bfloat16", "float16", "float32"),
                         help="target dtype; auto: bfloat16 on CUDA, float32 on CPU")
    target_layer_ids: list[int] | None = num(None, ge=0, le=2**16, aliases=("--target-layers",),
                                             filled_at_start=True,
                                             help="target layers whose hidden states are captured, DFlash ids "
                                                  "(id i = output of decoder layer i), e.g. 1,9,17,25,33; none: "
                                                  "num_target_layers ids spread over the target (eagle3: three, "
                                                  "low/middle/high, default 1,L/2-1,L-4)")
    num_target_layers: int | None = num(None, ge=1, le=2**16, aliases=("--num-target-layers",),
                                        help="captured layers when target_layer_ids is none; none: 5 spread "
                                             "over 1..L-3, fewer on a target of under 8 layers")
    random_weights: bool = setting(False, aliases=("--random-target-weights",),
                                   help="benchmarks: build the target from its config.json with random weights "
                                        "(the checkpoint's own tensors, e.g. embedding and LM head, are still "
                                        "loaded)")

    def __post_init__(self):
        check_fields(self)
        _require(len(self.devices) >= 1, "devices", "at least one producer device is needed")
        if self.target_layer_ids is not None:
            ids = list(self.target_layer_ids)
            _require(len(ids) >= 1, "target_layer_ids", "must name at least one layer")
            dup = sorted({i for i in ids if ids.count(i) > 1})
            _require(not dup, "target_layer_ids", f"duplicate layer ids {dup}")


@dataclass(kw_only=True)
class TrainerConfig:
    """The drafter (a family of ``shared/drafters/``: DFlash, DFlash2, EAGLE-3) and its optimisation (see
    ``shared/drafters/contract.py`` and ``consumer/trainer.py``)."""
    GROUP: ClassVar[str] = "drafter & training"
    devices: list[str] = setting(["cpu"], aliases=("--consumers",), group="topology",
                                 machine_default=lambda: default_devices()[1],
                                 default_text="cpu; with GPUs cuda:0 (1 GPU), cuda:1 (2), cuda:2 (3+)",
                                 help="one consumer (a drafter trainer, one data-parallel rank) per device")
    drafter: str = setting(DEFAULT_FAMILY, aliases=("--drafter",), choices=DRAFTERS,
                           help="drafter family: dflash (block drafter, shared/models/dflash.py), dflash2 (DFlash "
                                "with grouped dynamic causal convolutions and a candidate selector, "
                                "shared/models/dflash2.py) or eagle3 (one layer over three fused target layers, "
                                "trained by training-time test, shared/models/eagle3.py)")
    draft_vocab: int = num(32000, ge=1, le=2**24, aliases=("--draft-vocab",),
                           help="eagle3: draft vocabulary size, the most frequent loss-carrying target tokens of "
                                "the training data (capped at the target's vocabulary); built once per run into "
                                "RUN_DIR/draft_vocab.safetensors")
    ttt_steps: int = num(7, ge=1, le=64, aliases=("--ttt-steps",),
                         help="eagle3: training-time test steps, the drafter unrolled on its own states (loss "
                              "weight 0.8**k at step k)")
    block_size: int = num(16, ge=2, le=1024, aliases=("--block-size",),
                          help="DFlash block size B: tokens the drafter proposes at once, the anchor's included")
    loss: str = setting("ce", choices=LOSSES,
                        help="DFlash families' block loss: ce (cross-entropy, decay exp(-(k-1)/gamma) over the "
                             "block) or dpace (D-PACE: each slot weighted by the expected accepted length it "
                             "starts, from the drafter's own probabilities, detached)")
    dpace_alpha: float = num(0.5, ge=0, le=1, help="D-PACE: q' = (1 - alpha) * exp(-CE) + alpha")
    sliding_window: int | None = num(None, ge=1, le=2**31 - 1,
                                     help="DFlash families: draft attention sees only context within this many "
                                          "positions (sliding_attention layers, as z-lab's current drafters "
                                          "declare; their configs use 2048); none: the whole context")
    conv_kernel_size: int = num(2, ge=1, le=64, help="dflash2: taps of the grouped dynamic causal convolution")
    conv_group_size: int = num(16, ge=1, le=2**16,
                               help="dflash2: channels per group sharing one dynamic tap (divides the hidden size)")
    selector_top_k: int = num(16, ge=1, le=4096, help="dflash2: candidates per slot the selector ranks")
    selector_rank: int = num(256, ge=1, le=2**16, help="dflash2: rank of the selector's codebooks")
    selector_loss_alpha: float = num(1.0, ge=0, le=1e6,
                                     help="dflash2: weight of the selector's K-way cross-entropy in the loss")
    num_anchors: int = num(512, ge=1, le=2**20, aliases=("--num-anchors",), cpu_default=32,
                           help="anchors (block starts) sampled per sequence, at most")
    gamma: float | None = num(None, gt=0, le=1e6,
                              help="decay of the loss over a block's positions; none: 7 for B=16, 5 for B=10, "
                                   "4 for B=8, else B/2.3")
    num_draft_layers: int | None = num(None, ge=1, le=1024, aliases=("--num-draft-layers",), cpu_default=2,
                                       help="drafter layers; none: the number of captured target layers")
    mask_token_id: int | None = num(None, ge=0, le=MAX_INT32,
                                    help="token id of the drafter's mask token; none: the tokenizer's mask "
                                         "token, else its pad token")
    label_source: str = setting("target", aliases=("--label-source",), choices=LABEL_SOURCES,
                                help="what the drafter learns: target (the target's own greedy next tokens, "
                                     "computed by the producers) or data (the corpus's next tokens)")
    distill_topk: int | None = num(None, ge=0, le=1024, aliases=("--distill-topk",), filled_at_start=True,
                                   default_text=f"none: 0 (off) for dflash, {DEFAULT_EAGLE3_TOPK} for eagle3",
                                   help="with label source target: the producers also send the target's top-K "
                                        "log-probabilities; DFlash adds the KL divergence to them to its loss, "
                                        "EAGLE-3 learns that distribution restricted to the draft vocabulary; "
                                        "0: off (EAGLE-3 then learns the target's greedy tokens)")
    distill_weight: float = num(1.0, ge=0, le=1e6, help="weight of that KL divergence in the loss")
    fused_ce: str = setting("auto", choices=FUSED_CE,
                            help="DFlash families' cross-entropy over the LM head: liger (Liger Kernel's fused linear "
                                 "+ cross-entropy, CUDA), off (chunked float32 logits), torch (the fused path's "
                                 "reference, tests); auto: liger on CUDA when installed, the vocabulary has at least "
                                 f"{LIGER_AUTO_MIN_VOCAB:,} tokens and the loss allows (ce, no distillation, no "
                                 "selector), else off")
    compile: bool | None = setting(None, help="torch.compile the draft layers; none: on CUDA")
    warm_up: str = setting("auto", choices=("auto", "background", "blocking"),
                           help="where the compile of the flex form and the compiled layers runs: background (a "
                                "thread, on shadow copies of the weights, while the first steps train with eager "
                                "dense attention; the compiled form takes over after it), blocking (before the "
                                "consumer is ready); auto: background on CUDA")
    attention: str = setting("auto", choices=("auto", "flex", "dense", "structured"),
                             help="attention form of the drafter's training step; auto: flex on CUDA, "
                                  "structured on CPU")
    lr: float = num(6e-4, gt=0, le=1e3, aliases=("--lr",), help="peak learning rate")
    min_lr_ratio: float = num(0.1, ge=0, le=1, help="learning rate at the end of the cosine decay, over the peak")
    warmup_steps: int = num(20, ge=0, le=10**9, aliases=("--warmup-steps",),
                            help="optimizer steps of linear learning-rate warm-up")
    weight_decay: float = num(0.01, ge=0, le=1e3, help="AdamW weight decay")
    feature_noise: float = num(0.0, ge=0, le=1e3, aliases=("--feature-noise",),
                               help="regulariser: uniform noise on the target's captured hidden states in training, "
                                    "U(-a, a) times each token's per-layer RMS (a = this value; EAGLE adds uniform "
                                    "noise to its features); 0: off")
    grad_clip: float = num(1.0, gt=0, le=1e9, help="gradients are clipped to this global norm")
    grad_accum: int = num(1, ge=1, le=2**16, aliases=("--grad-accum",), help="micro-batches per optimizer step")
    max_steps: int = num(300, ge=1, le=10**9, aliases=("--max-steps",), cpu_default=200, resume=True,
                         help="optimizer steps of the run (ignored with epochs)")
    epochs: int | None = num(None, ge=1, le=10**6, aliases=("--epochs",), resume=True,
                             help="train this many epochs of the data (max_steps is then ignored); none: "
                                  "max_steps")
    checkpoint_every: int = num(100, ge=1, le=10**9, aliases=("--checkpoint-every",), resume=True,
                                help="optimizer steps between checkpoints")
    eval_every: int = num(0, ge=0, le=10**9, aliases=("--eval-every",), resume=True,
                          help="optimizer steps between tau evaluations during training; 0: at every checkpoint")
    eval_prompts: int = num(8, ge=0, le=10**6, aliases=("--eval-prompts",), resume=True,
                            help="held-out prompts per tau evaluation during training; 0: no tau during training")
    eval_max_new_tokens: int = num(32, ge=1, le=2**20, aliases=("--eval-max-new-tokens",), resume=True,
                                   help="tokens generated per prompt in those evaluations")
    eval_prompt_len: int = num(64, ge=1, le=MAX_INT32, aliases=("--eval-prompt-len",), resume=True,
                               help="tokens of each held-out prompt (held-out samples must be longer)")
    max_nonfinite_in_row: int = num(5, ge=1, le=10**9,
                                    help="after this many optimizer steps in a row skipped for a non-finite "
                                         "loss or gradient the consumer stops with an error")
    seed: int = num(0, ge=0, le=MAX_SEED, aliases=("--seed",),
                    help="seed of the drafter's initialisation and the anchor sampling (also of the batch "
                         "plan unless data.seed is set)")

    def __post_init__(self):
        check_fields(self)
        _require(len(self.devices) >= 1, "devices", "at least one consumer device is needed")
        _require(self.drafter not in FAMILIES or not FAMILIES[self.drafter].requires_target_labels
                 or self.label_source == "target", "label_source",
                 f"drafter {self.drafter} learns the target's distribution, which the producers compute only with "
                 "label_source=target")
        _require(not self.distill_topk or self.label_source == "target", "distill_topk",
                 "needs label_source=target (the producer computes the target's distribution only then)")
        _require(self.fused_ce != "liger" or all(str(d).startswith("cuda") for d in self.devices), "fused_ce",
                 f"liger runs on CUDA only; the consumer devices are {self.devices} (use auto or off)")

    def resolved_distill_topk(self) -> int:
        """``distill_topk``, its none resolved: 0 (off) for DFlash, ``DEFAULT_EAGLE3_TOPK`` for EAGLE-3 (the
        run plan fills the field with it, so the saved configuration holds the number)."""
        if self.distill_topk is not None:
            return int(self.distill_topk)
        return FAMILIES[self.drafter].default_distill_topk

    def resolved_gamma(self) -> float:
        """The loss-decay γ for this block size (DFlash paper defaults: 7 / 5 / 4 for B = 16 / 10 / 8)."""
        if self.gamma is not None:
            return float(self.gamma)
        return {16: 7.0, 10: 5.0, 8: 4.0}.get(self.block_size, max(1.0, self.block_size / 2.3))


@dataclass(kw_only=True)
class MonitorConfig:
    """Health monitor: heartbeats, hang detection and the restart policy (durations in seconds, at most
    ``MAX_SECONDS``). Every field may change on ``--resume``."""
    GROUP: ClassVar[str] = "health monitor"
    heartbeat_interval_s: float = num(1.0, gt=0, le=MAX_SECONDS, aliases=("--heartbeat-interval-s",),
                                      resume=True, help="seconds between a child's heartbeats")
    hang_timeout_s: float = num(60.0, gt=0, le=MAX_SECONDS, aliases=("--hang-timeout-s",), resume=True,
                                help="a child with no heartbeat and no progress this long is hung: killed (a "
                                     "producer is restarted); more than twice the heartbeat interval")
    startup_timeout_s: float = num(300.0, ge=0, le=MAX_SECONDS, resume=True,
                                   help="a child must say Hello within this long of its start")
    max_restarts: int = num(10, ge=0, le=10**6, aliases=("--max-restarts",), resume=True,
                            help="restarts of one producer allowed per restart window; one more ends the run")
    restart_window_s: float = num(600.0, ge=0, le=MAX_SECONDS, resume=True,
                                  help="the window over which max_restarts counts")
    backoff_base_s: float = num(0.5, ge=0, le=MAX_SECONDS, resume=True,
                                help="first wait before restarting a producer, doubled per restart in the window")
    backoff_max_s: float = num(15.0, ge=0, le=MAX_SECONDS, resume=True, help="longest wait before a restart")
    shutdown_timeout_s: float = num(120.0, ge=0, le=MAX_SECONDS, resume=True,
                                    help="a consumer silent this long after Shutdown is terminated (a checkpoint "
                                         "write is silent)")
    batch_timeout_s: float = num(1800.0, gt=0, le=MAX_SECONDS, aliases=("--batch-timeout-s",), resume=True,
                                 help="a child whose main thread is on one batch (forward, training step, "
                                      "checkpoint) this long while its heartbeat goes on is hung (a deadlock); "
                                      "at least hang_timeout_s")

    def __post_init__(self):
        check_fields(self)
        _require(self.hang_timeout_s > 2 * self.heartbeat_interval_s, "hang_timeout_s",
                 f"must exceed twice heartbeat_interval_s ({self.heartbeat_interval_s})")
        _require(self.batch_timeout_s >= self.hang_timeout_s, "batch_timeout_s",
                 f"must be >= hang_timeout_s ({self.hang_timeout_s}), got {self.batch_timeout_s}")


def node_env() -> dict[str, Any]:
    """The node contract of the environment, as torchrun and SLURM launchers set it: ``NNODES``, ``NODE_RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT`` (the shorthand ``launch.py train --nnodes ...`` uses the same names), or
    torchrun's own (one process per node, ``--nproc-per-node 1``: ``GROUP_WORLD_SIZE``/``WORLD_SIZE`` nodes,
    ``GROUP_RANK``/``RANK`` this node). Empty when neither ``NNODES`` nor torchrun's ``TORCHELASTIC_RUN_ID`` is
    set (``MASTER_ADDR`` alone is no multi-node run: specring sets it for its own consumers)."""
    out: dict[str, Any] = {}
    if envs.is_set("NNODES"):
        out["nnodes"] = envs.get("NNODES")
        out["node_rank"] = envs.get("NODE_RANK", "0")
    elif envs.is_set("TORCHELASTIC_RUN_ID"):
        out["nnodes"] = envs.get("GROUP_WORLD_SIZE") or envs.get("WORLD_SIZE", "1")
        out["node_rank"] = envs.get("GROUP_RANK") or envs.get("RANK", "0")
    else:
        return out
    if envs.is_set("MASTER_ADDR"):
        out["master_addr"] = envs.get("MASTER_ADDR")
    if envs.is_set("MASTER_PORT"):
        out["master_port"] = envs.get("MASTER_PORT")
    try:
        for k in ("nnodes", "node_rank", "master_port"):
            if k in out:
                out[k] = int(out[k])
    except ValueError:
        raise ConfigError(f"environment: {k} {out[k]!r} is not a whole number (NNODES, NODE_RANK, MASTER_PORT or "
                          f"torchrun's GROUP_WORLD_SIZE/GROUP_RANK)", key=f"nodes.{k}") from None
    return out


@dataclass(kw_only=True)
class NodesConfig:
    """Several nodes (``docs/DESIGN.md``, "Several nodes"): each runs ``launch.py train`` with the same flags and
    its own ``node_rank``; they meet at ``master_addr:master_port`` (torch.distributed's TCPStore, hosted by node
    0's supervisor, or torchrun's agent store) and node 0 owns the batch ledger. Defaults come from the
    environment (``NNODES``/``NODE_RANK``/``MASTER_ADDR``/``MASTER_PORT``, or torchrun's)."""
    GROUP: ClassVar[str] = "nodes"
    nnodes: int = num(1, ge=1, le=4096, aliases=("--nnodes",), machine_default=lambda: node_env().get("nnodes", 1),
                      default_text="1, or the environment's NNODES (torchrun: its node count)",
                      help="nodes of the run; every node runs its own producers and consumers, and the consumers "
                           "of all nodes form one data-parallel group")
    node_rank: int = num(0, ge=0, le=4095, aliases=("--node-rank",),
                         machine_default=lambda: node_env().get("node_rank", 0),
                         default_text="0, or the environment's NODE_RANK (torchrun: GROUP_RANK)",
                         help="this node's rank; node 0 owns the batch ledger, the checkpoints and summary.json")
    master_addr: str = setting("127.0.0.1", aliases=("--master-addr",), resume=True, metavar="HOST",
                               machine_default=lambda: node_env().get("master_addr", "127.0.0.1"),
                               default_text="127.0.0.1, or the environment's MASTER_ADDR",
                               help="host of node 0, where the nodes meet (its rendezvous store and control "
                                    "socket)")
    master_port: int = num(29500, ge=1, le=65535, aliases=("--master-port",), resume=True,
                           machine_default=lambda: node_env().get("master_port", 29500),
                           default_text="29500, or the environment's MASTER_PORT",
                           help="port of the rendezvous store on node 0 (torch.distributed TCPStore)")
    rendezvous_timeout_s: float = num(300.0, gt=0, le=MAX_SECONDS, resume=True,
                                      help="how long a node waits for the others at the start")
    node_timeout_s: float = num(30.0, gt=0, le=MAX_SECONDS, resume=True,
                                help="a node (or node 0, seen from the others) silent this long is dead: the run "
                                     "stops with its last checkpoint (--resume continues)")

    def __post_init__(self):
        check_fields(self)
        _require(self.node_rank < self.nnodes, "node_rank",
                 f"must be below nnodes ({self.nnodes}), got {self.node_rank}")


@dataclass(kw_only=True)
class RunConfig:
    """Everything a run needs; child processes receive it as ``to_dict()``.

    Besides the fields, the command line fills (not serialised): ``sources`` ("section.field" -> the
    flag as typed, or "--config FILE: section.field") for error messages, ``cpu_defaults``
    ("section.field" -> value) for the values that came from a field's CPU default, and
    ``resume_changes`` (one "--flag OLD -> NEW" per value changed on ``--resume``).
    """
    GROUP: ClassVar[str] = "run directory"
    run_dir: str = setting("runs/default", metavar="DIR",
                           default_text="a new runs/<UTC time>, linked as runs/latest (with --resume: runs/latest)",
                           help="run directory: metrics, checkpoints, logs, the socket")
    run_id: str = setting("", metavar="ID", default_text="random",
                          help="alphanumeric id that names the run's shared-memory segments and processes")
    resume: bool = setting(False, help="continue the run in --run-dir from its latest checkpoint, with its saved "
                                       "configuration; only flags whose help says 'may change on --resume' may "
                                       "differ from the saved run")
    report_to: list[str] = setting([], resume=True, metavar="BACKEND,...",
                                   default_text="none",
                                   help="experiment trackers that receive the run's figures (loss, per-slot "
                                        "accuracy, tau, tokens/s, ring occupancy, producer restarts), a comma "
                                        f"list of none, {', '.join(REPORT_BACKENDS)}; a tracker that is not "
                                        "installed is an error at start; wandb runs offline unless WANDB_API_KEY "
                                        "or WANDB_MODE say otherwise")
    tcp: str = setting("", group="topology", metavar="ADDRESS", default_text="an ipc socket in the run directory",
                       help="TCP address for the control messages, e.g. tcp://127.0.0.1:5555")
    data: DataConfig = field(default_factory=DataConfig)
    ring: RingConfig = field(default_factory=RingConfig)
    producer: ProducerConfig = field(default_factory=ProducerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    nodes: NodesConfig = field(default_factory=NodesConfig)

    def __post_init__(self):
        if self.run_id:
            _require(str(self.run_id).isalnum(), "run_id", f"must be alphanumeric, got {self.run_id!r}")
        names = [str(x).strip().lower() for x in self.report_to]
        bad = [x for x in names if x not in ("none", "") + REPORT_BACKENDS]
        _require(not bad, "report_to", f"unknown tracker(s) {bad}; known: none, {', '.join(REPORT_BACKENDS)}")
        self.report_to = list(dict.fromkeys(x for x in names if x not in ("none", "")))
        self.sources: dict[str, str] = {}
        self.cpu_defaults: dict[str, Any] = {}
        self.resume_changes: list[str] = []

    def origin(self, key: str) -> str:
        """How to name the configuration key ``key`` ("producer.num_target_layers") in an error: the flag
        or config file it came from (``sources``), else the field's flag (its first alias, e.g.
        ``--num-target-layers``), else the key itself."""
        if key in self.sources:
            return self.sources[key]
        spec = field_specs().get(key)
        return spec.preferred_flag if spec else key

    def to_dict(self) -> dict[str, Any]:
        """The nested plain-data form (JSON/TOML-able) that ``from_dict`` reads back."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunConfig":
        """Build from a (possibly partial) nested mapping; unknown keys raise ``ConfigError`` naming them."""
        sections = section_classes()
        kwargs: dict[str, Any] = {}
        top = {f.name for f in dataclasses.fields(cls)}
        for key, value in d.items():
            if key not in top:
                raise ConfigError(f"unknown config key {key!r} (known: {sorted(top)})")
            if key in sections:
                if not isinstance(value, dict):
                    raise ConfigError(f"config section {key!r} must be a mapping, got {type(value).__name__}",
                                      key=key, detail=f"must be a mapping, got {type(value).__name__}")
                kwargs[key] = _build(sections[key], value, key)
            else:
                kwargs[key] = value
        top_hints = {k: v for k, v in typing.get_type_hints(cls).items() if k not in sections}
        for k, v in kwargs.items():
            if k in top_hints and not _type_ok(v, top_hints[k]):
                detail = f"expected {type_name(top_hints[k])}, got {type(v).__name__} {v!r}"[:300]
                raise ConfigError(f"{k}: {detail}", key=k, detail=detail)
        return cls(**kwargs)


@functools.cache
def section_classes() -> dict[str, type]:
    """``{"data": DataConfig, "ring": RingConfig, ...}``: the sections of ``RunConfig``, in order."""
    hints = typing.get_type_hints(RunConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(RunConfig) if dataclasses.is_dataclass(hints[f.name])}


@dataclass(frozen=True)
class FieldSpec:
    """One declared config field and what is derived from it. Metadata keys (set by ``setting``/``num``):

    ``help``; ``ge``/``gt``/``le``/``unit`` (bounds); ``aliases`` (``Alias`` flags besides ``flag``);
    ``choices``; ``cpu_default`` (the default when every device is CPU, present only when declared);
    ``resume`` (may change on ``--resume``); ``group`` (``--help`` group, else the class's ``GROUP``);
    ``metavar``; ``path`` (a file or directory: shown as PATH, compared resolved); ``hub`` (a directory or a
    Hugging Face hub id, resolved to the directory when the run starts); ``default_text`` (how
    ``--help`` shows the default when the value alone does not say it);
    ``machine_default`` (a callable giving the command line's default on this machine); ``follows`` (the
    key of a field whose value this one takes when only that one is set); ``filled_at_start`` (the
    default, 0/none/empty, is resolved when the run starts: on ``--resume`` it stands for the saved value).

    How a command's option (``option_specs``) takes its value: ``switch`` (a yes/no flag that takes no value:
    off unless given, on when given; no ``--no-`` form), ``nargs`` (``"+"``: one or more values after the flag,
    each parsed on its own; ``"*"`` for a positional), ``repeat`` (the flag may be given several times, each
    adding one value to the list), ``positional`` (an argument without a flag, named by the field).
    ``required``: the option must be given (a field without a default, or named in its class's ``REQUIRED``).
    """
    section: str        # "" for RunConfig's own fields and for every field of a command's options
    name: str
    hint: Any
    default: Any
    meta: Mapping[str, Any]
    group: str
    required: bool = False

    @property
    def key(self) -> str:
        """``"trainer.lr"``, or ``"run_dir"`` for a field of ``RunConfig`` itself."""
        return f"{self.section}.{self.name}" if self.section else self.name

    @property
    def flag(self) -> str:
        """``--trainer.lr``, ``--monitor.backoff-max-s``, ``--run-dir``, ``--max-new-tokens`` (a command's
        option); a positional argument's name (``inputs``)."""
        if self.meta.get("positional"):
            return self.name
        return "--" + self.key.replace("_", "-")

    @property
    def aliases(self) -> tuple[Alias, ...]:
        return self.meta.get("aliases", ())

    @property
    def preferred_flag(self) -> str:
        """The flag errors name when the value was not given: the first alias, else ``flag``."""
        return self.aliases[0].flag if self.aliases else self.flag

    @property
    def help(self) -> str:
        return self.meta.get("help", "")

    @property
    def has_cpu_default(self) -> bool:
        return "cpu_default" in self.meta

    @property
    def may_change_on_resume(self) -> bool:
        return bool(self.meta.get("resume"))

    @property
    def base_type(self) -> Any:
        """The annotation without ``| None``: ``int``, ``float``, ``str``, ``bool``, ``list[int]``..."""
        args = [h for h in typing.get_args(self.hint) if h is not type(None)]
        return args[0] if typing.get_origin(self.hint) in (typing.Union, types.UnionType) else self.hint

    @property
    def optional(self) -> bool:
        """Whether ``None`` is a value of the field (``X | None``)."""
        union = typing.get_origin(self.hint) in (typing.Union, types.UnionType)
        return union and type(None) in typing.get_args(self.hint)


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


@functools.cache
def _specs() -> tuple[FieldSpec, ...]:
    out = []
    sections = section_classes()
    for cls, section in [(RunConfig, "")] + [(c, s) for s, c in sections.items()]:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not section and f.name in sections:
                continue
            out.append(FieldSpec(section, f.name, hints[f.name], _default_of(f), f.metadata,
                                 f.metadata.get("group") or cls.GROUP))
    return tuple(out)


def field_specs(cls: type | None = None) -> dict[str, FieldSpec]:
    """Every declared field of ``RunConfig`` by key (``"run_dir"``, ``"trainer.lr"``), in declaration
    order: ``RunConfig``'s own fields, then each section's. With ``cls``, a command's options instead
    (``option_specs``)."""
    if cls is not None and cls is not RunConfig:
        return option_specs(cls)
    return {s.key: s for s in _specs()}


@functools.cache
def _option_specs(cls: type) -> tuple[FieldSpec, ...]:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    groups = getattr(cls, "HELP_GROUPS", None) or {getattr(cls, "GROUP", "options"): tuple(fields)}
    placed = [(title, name) for title, names in groups.items() for name in names]
    names = [name for _, name in placed]
    nested = [n for n in fields if dataclasses.is_dataclass(hints[n])]
    if sorted(names) != sorted(fields) or len(set(names)) != len(names) or nested:
        raise TypeError(f"{cls.__name__}.HELP_GROUPS must place every field once, and no field may be a section: "
                        f"fields {sorted(fields)}, placed {names}, sections {nested}")
    required = set(getattr(cls, "REQUIRED", ()))
    out = []
    for title, name in placed:
        f = fields[name]
        default = _default_of(f)
        out.append(FieldSpec("", name, hints[name], default, f.metadata, title,
                             required=name in required or default is dataclasses.MISSING))
    return tuple(out)


def option_specs(cls: type) -> dict[str, FieldSpec]:
    """The options of a command (``launch.py eval``, ...) by field name, in ``--help`` order: ``cls`` is a flat
    keyword-only dataclass declared like the run's configuration (``setting``/``num`` per field, option groups
    shared by several commands composed as its dataclass bases), with ``HELP_GROUPS`` (``--help`` group title ->
    its field names, in order; every field placed once) and ``REQUIRED`` (fields with a shared default that this
    command requires). Each field is the flag ``--FIELD-NAME`` (or a positional argument). Raises ``TypeError``
    when ``HELP_GROUPS`` misses, repeats or invents a field, or a field is itself a dataclass."""
    return {s.key: s for s in _option_specs(cls)}
