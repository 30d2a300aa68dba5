"""The slot batch: the one typed definition of what a producer writes into a ring slot and a consumer reads.

``SlotBatch`` has one attribute per tensor of the payload; ``SlotBatch.SPECS`` declares each one's dtype and
shape, in write order, and everything else is derived from it: the payload layout of a shape
(``SlotBatch.specs``: what the producer writes and how large a slot must be, ``supervisor.runplan``), the
check of a slot that was read (``SlotBatch.from_tensors``) and the tensors to write (``SlotBatch.to_tensors``).
The bytes themselves are laid out by ``shared.transport.layout`` (``write_tensors``/``read_tensors``, 64-byte
aligned tensors named in the ``SlotReady`` descriptor); this module only says which tensors a slot holds.

Who uses it: the producer builds a ``SlotBatch`` (``producers.producer``), the consumer turns the views of a
slot into one and copies it to its device (``consumer.main``), and the trainer, the drafter families'
objectives and EAGLE-3's training-time test read its attributes (``consumer.trainer``, ``shared.drafters``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, ClassVar, Mapping

import torch

from specring.shared.errors import MessageError
from specring.shared.machine.devices import DTYPE_NAMES

Tensor = torch.Tensor


@dataclass(frozen=True, eq=False, repr=False)
class SlotBatch:
    """One packed batch as a slot carries it: ``T`` real tokens of ``S`` sequences packed back to back (no padding),
    ``n`` captured target layers of width ``H``, the target's top ``K`` next tokens.

    * ``hidden [T, n*H]``, the target's dtype (bfloat16 on CUDA, float32 on CPU unless ``producer.dtype`` says
      else): layer ``layer_ids[k]``'s output (HF ``hidden_states[layer_ids[k] + 1]``) in columns ``[k*H, (k+1)*H)``;
    * ``input_ids [T]`` int32: the tokens; ``loss_mask [T]`` uint8: 1 where the token is trained on;
    * ``cu_seqlens [S+1]`` int32: sequence ``s`` is rows ``[cu_seqlens[s], cu_seqlens[s+1])``;
    * ``batch_id [1]`` int64 and ``layer_ids [n]`` int32: in every slot; None in a batch built in-process (tests,
      benchmarks, the trainer's warm-up), which nothing reads them from;
    * ``target_ids [T]`` int32, with ``label_source="target"`` (else None): the target's greedy next token after
      each position (argmax of its LM head);
    * ``target_topk_ids [T, K]`` int32 and ``target_topk_logprobs [T, K]`` float32, with ``label_source="target"``
      and ``topk = K > 0`` as well (else None): its ``K`` most likely next tokens and their log-probabilities.

    The constructor checks nothing (an in-process batch may hold other dtypes, e.g. float64 features in a test);
    ``from_tensors`` checks a slot's tensors against ``SPECS`` and ``of`` turns a mapping of these names into a
    batch. Frozen: ``dataclasses.replace`` makes a changed copy. Tensors may be on any device.
    """

    #: ``name -> (dtype, shape)`` in write order. dtype None: the target's (any floating-point dtype). A shape entry
    #: is a fixed size (int) or a dimension's symbol (str), the same size wherever the symbol appears.
    SPECS: ClassVar[dict[str, tuple[torch.dtype | None, tuple[int | str, ...]]]] = {
        "hidden": (None, ("T", "n*H")),
        "input_ids": (torch.int32, ("T",)),
        "loss_mask": (torch.uint8, ("T",)),
        "cu_seqlens": (torch.int32, ("S+1",)),
        "batch_id": (torch.int64, (1,)),
        "layer_ids": (torch.int32, ("n",)),
        "target_ids": (torch.int32, ("T",)),
        "target_topk_ids": (torch.int32, ("T", "K")),
        "target_topk_logprobs": (torch.float32, ("T", "K")),
    }
    #: fields every batch has (the dataclass's required arguments)
    REQUIRED: ClassVar[tuple[str, ...]] = ("hidden", "input_ids", "loss_mask", "cu_seqlens")
    #: fields every slot has (``from_tensors`` requires them)
    IN_EVERY_SLOT: ClassVar[tuple[str, ...]] = REQUIRED + ("batch_id", "layer_ids")
    #: the target's labels (``label_source="target"``)
    TARGET_LABELS: ClassVar[tuple[str, ...]] = ("target_ids", "target_topk_ids", "target_topk_logprobs")
    #: fields with one row per token (first dimension ``T``)
    PER_TOKEN: ClassVar[tuple[str, ...]] = tuple(k for k, (_, shape) in SPECS.items() if shape[:1] == ("T",))
    #: ``(name, dtype, shape, in every slot)`` per field, what ``check`` walks
    _CHECKS: ClassVar[tuple] = ()  # set below the class

    hidden: Tensor
    input_ids: Tensor
    loss_mask: Tensor
    cu_seqlens: Tensor
    batch_id: Tensor | None = None
    layer_ids: Tensor | None = None
    target_ids: Tensor | None = None
    target_topk_ids: Tensor | None = None
    target_topk_logprobs: Tensor | None = None

    # ------------------------------------------------------------------ the declaration
    @classmethod
    def specs(cls, num_tokens: int, num_seqs: int, num_layers: int, hidden_size: int, hidden_dtype: torch.dtype,
              label_source: str = "data", topk: int = 0) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """The payload of one shape, ``{name: (dtype, shape)}`` in write order: what the producer writes and what
        ``shared.transport.layout.payload_bytes`` sizes a slot by. ``T = num_tokens`` tokens of ``S = num_seqs``
        sequences, ``n = num_layers`` layers of width ``H = hidden_size`` in ``hidden_dtype``; ``target_ids`` with
        ``label_source="target"``, the top-``K`` pair with ``topk = K > 0`` as well (see the class docstring)."""
        t, n = int(num_tokens), int(num_layers)
        dims = {"T": t, "n*H": n * int(hidden_size), "S+1": int(num_seqs) + 1, "n": n, "K": int(topk)}
        names = list(cls.IN_EVERY_SLOT)
        if label_source == "target":
            names.append("target_ids")
            if topk:
                names += ["target_topk_ids", "target_topk_logprobs"]
        out = {}
        for name in names:
            dtype, shape = cls.SPECS[name]
            out[name] = (hidden_dtype if dtype is None else dtype,
                         tuple(d if isinstance(d, int) else dims[d] for d in shape))
        return out

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_tensors(cls, tensors: Mapping[str, Tensor]) -> "SlotBatch":
        """The batch a slot holds, from its tensors (``shared.transport.layout.read_tensors``: views, no copy),
        checked against ``SPECS`` (``check``). A slot's descriptor comes from a message, so this is untrusted input:
        raises ``MessageError`` naming the field for an unknown name, a field every slot has that is missing, a
        wrong dtype or a shape that disagrees (see ``check``)."""
        if not isinstance(tensors, Mapping):
            raise MessageError(f"slot batch: expected a mapping of named tensors, got {type(tensors).__name__}")
        cls._check_names(tensors, cls.IN_EVERY_SLOT)
        return cls(**tensors).check()

    @classmethod
    def of(cls, batch: "SlotBatch | Mapping[str, Tensor]") -> "SlotBatch":
        """``batch`` itself if it is a ``SlotBatch``, else one made of the mapping ``{name: tensor}`` (an in-process
        batch: tests, benchmarks): names only are checked, not dtypes or shapes. Raises ``MessageError`` naming an
        unknown field or a missing one of ``REQUIRED``, ``TypeError`` for anything else."""
        if isinstance(batch, SlotBatch):
            return batch
        if not isinstance(batch, Mapping):
            raise TypeError(f"expected a SlotBatch or a mapping of named tensors, got {type(batch).__name__}")
        cls._check_names(batch, cls.REQUIRED)
        return cls(**batch)

    @classmethod
    def _check_names(cls, tensors: Mapping, required: tuple[str, ...]) -> None:
        if not cls.SPECS.keys() >= tensors.keys():
            unknown = sorted(str(k) for k in tensors if k not in cls.SPECS)
            raise MessageError(f"slot batch: unknown field(s) {unknown} (a slot holds {list(cls.SPECS)})")
        for name in required:
            if tensors.get(name) is None:
                raise MessageError(f"slot batch: field {name!r} missing (have {sorted(tensors)})")

    # ------------------------------------------------------------------ checks
    def check(self) -> "SlotBatch":
        """Check every field against ``SPECS``; returns ``self``. Raises ``MessageError`` naming the field when one
        every slot has is None, a field is not a tensor, its dtype differs (``hidden``: not floating-point), its rank
        differs, a dimension disagrees with the same symbol's size in an earlier field (``T`` from ``hidden``, ``K``
        from ``target_topk_ids``), ``hidden``'s width is not a multiple of ``n`` (``layer_ids``), or only one of the
        top-K pair is there, or the pair without ``target_ids``."""
        dims: dict[str, tuple[int, str]] = {}  # symbol -> (size, the field it was read from)
        for name, dtype, shape, in_every_slot in self._CHECKS:
            x = getattr(self, name)
            if x is None:
                if in_every_slot:
                    raise MessageError(f"slot batch: field {name!r} missing")
                continue
            if not isinstance(x, torch.Tensor):
                raise MessageError(f"slot batch: field {name!r} is a {type(x).__name__}, not a tensor")
            if dtype is None:
                if not x.dtype.is_floating_point:
                    raise MessageError(f"slot batch: field {name!r} has dtype {_dtype_name(x.dtype)}, expected a "
                                       f"floating-point dtype (the target's)")
            elif x.dtype != dtype:
                raise MessageError(f"slot batch: field {name!r} has dtype {_dtype_name(x.dtype)}, expected "
                                   f"{_dtype_name(dtype)}")
            got = x.shape
            if len(got) != len(shape):
                raise MessageError(f"slot batch: field {name!r} has shape {list(got)}, expected {_shape_text(shape)}")
            for sym, size in zip(shape, got):
                if sym.__class__ is int:
                    if size != sym:
                        raise MessageError(f"slot batch: field {name!r} has shape {list(got)}, expected "
                                           f"{_shape_text(shape)}")
                elif sym not in dims:
                    dims[sym] = (size, name)
                elif size != dims[sym][0]:
                    raise MessageError(f"slot batch: field {name!r} has shape {list(got)}, expected "
                                       f"{_shape_text(shape)} with {sym}={dims[sym][0]} (from {dims[sym][1]!r})")
        if (self.target_topk_ids is None) != (self.target_topk_logprobs is None):
            name = "target_topk_logprobs" if self.target_topk_logprobs is None else "target_topk_ids"
            raise MessageError(f"slot batch: field {name!r} missing (the top-K ids and log-probabilities come "
                               f"together)")
        if self.target_topk_ids is not None and self.target_ids is None:
            raise MessageError("slot batch: field 'target_ids' missing (the top-K labels come with it)")
        if "n" in dims and "n*H" in dims:
            n, width = dims["n"][0], dims["n*H"][0]
            if (width % n if n else width):
                raise MessageError(f"slot batch: field 'hidden' has {width} columns, not a multiple of the {n} "
                                   f"layers of 'layer_ids'")
        return self

    # ------------------------------------------------------------------ views
    @property
    def num_tokens(self) -> int:
        """``T``, the batch's token count (rows of ``input_ids``)."""
        return int(self.input_ids.shape[0])

    def to_tensors(self) -> dict[str, Tensor]:
        """``{name: tensor}`` of the fields that are not None, in write order (``SPECS``): what
        ``shared.transport.layout.write_tensors`` copies into a slot."""
        out = {}
        for name in self.SPECS:
            x = getattr(self, name)
            if x is not None:
                out[name] = x
        return out

    def map_tokens(self, fn: Callable[[Tensor], Tensor]) -> "SlotBatch":
        """A batch with ``fn`` applied to each per-token tensor present (``PER_TOKEN``: ``hidden``, ``input_ids``,
        ``loss_mask`` and the target's labels), the others (``cu_seqlens``, ``batch_id``, ``layer_ids``) as they are:
        e.g. ``batch.map_tokens(lambda t: t.to(device))`` for a drafter's forward."""
        return dataclasses.replace(self, **{name: fn(x) for name in self.PER_TOKEN
                                            if (x := getattr(self, name)) is not None})

    def to(self, device: torch.device | str, *, non_blocking: bool = False, copy: bool = False) -> "SlotBatch":
        """A batch with every tensor on ``device`` (``torch.Tensor.to``) except ``cu_seqlens``, which stays where it
        is: the trainer and the drafters read the sequence boundaries on the host. ``copy=True``: every tensor is a
        new one, ``cu_seqlens`` and tensors already on ``device`` included (nothing aliases the source: what a
        consumer needs before it releases the slot the views point into)."""
        device = torch.device(device)
        changes = {}
        for name in self.SPECS:
            x = getattr(self, name)
            if x is None:
                continue
            if name == "cu_seqlens" or x.device == device:
                changes[name] = x.clone() if copy else x
            else:
                changes[name] = x.to(device, non_blocking=non_blocking, copy=copy)
        return type(self)(**changes)  # every field that is not None is in changes

    def __repr__(self) -> str:
        parts = [f"{name}={list(x.shape)}:{_dtype_name(x.dtype)}" for name, x in self.to_tensors().items()]
        return f"SlotBatch({', '.join(parts)})"


def _dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype))


def _shape_text(shape: tuple[int | str, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


SlotBatch._CHECKS = tuple((k, dtype, shape, k in SlotBatch.IN_EVERY_SLOT)
                          for k, (dtype, shape) in SlotBatch.SPECS.items())
assert tuple(f.name for f in dataclasses.fields(SlotBatch)) == tuple(SlotBatch.SPECS), \
    "SlotBatch's fields must be SPECS, in write order"
