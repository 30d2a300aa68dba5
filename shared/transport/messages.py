"""Control messages: one typed definition per message, one msgpack codec for all of them.

Every message is a frozen dataclass with a ``KIND`` tag. On the wire a message is a msgpack map
``{"kind": KIND, "v": SCHEMA_VERSION, <field>: <value>, ...}`` encoded with ``use_bin_type=True`` and
decoded with ``raw=False``; frames larger than ``MAX_MESSAGE_BYTES`` are refused. Messages carry metadata
only (slot indices, batch ids, layout descriptors), never tensors. Nothing is ever pickled.

``decode`` raises ``MessageError`` naming the problem for: garbage bytes, an oversized frame, a frame that
is not a map, an unknown kind, a schema version other than ``SCHEMA_VERSION``, a missing field, an unknown
field, or a field of the wrong type. numpy and torch scalars (and 0-d tensors) are encoded as Python
numbers; numpy arrays and 1-D tensors as lists.

Message flow (see DESIGN.md, "The slot protocol"): coordinator → producer ``Lease``; producer →
coordinator ``SlotReady`` (or ``BadBatch``); coordinator → consumer ``SlotReady``; consumer →
coordinator ``SlotReleased`` then ``Trained``; every child → coordinator ``Hello``, ``Heartbeat``,
``Error``; coordinator → child ``Shutdown``; ``launch.py`` → coordinator ``Command``.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from specring.shared.errors import MessageError

SCHEMA_VERSION = 1
MAX_MESSAGE_BYTES = 1 << 20  # 1 MiB: a lease of thousands of sample ids still fits


@dataclass(frozen=True)
class Hello:
    """A child announces itself (first message of every incarnation)."""
    KIND: ClassVar[str] = "hello"
    role: str            # "producer" | "consumer"
    index: int
    generation: int
    pid: int


@dataclass(frozen=True)
class Lease:
    """Coordinator → producer: write batch ``batch_id`` into slot ``slot`` of your ring.

    ``sample_ids`` are dataset row indices; ``pad_to`` is the bucket length the batch is padded to.
    ``generation`` is the producer incarnation the lease is for.
    """
    KIND: ClassVar[str] = "lease"
    ITEM_TYPES: ClassVar[dict] = {"sample_ids": int}
    batch_id: int
    slot: int
    generation: int
    epoch: int
    sample_ids: list
    pad_to: int


@dataclass(frozen=True)
class SlotReady:
    """Producer → coordinator → consumer: slot ``slot`` of producer ``producer``'s ring holds ``batch_id``.

    ``descriptor`` is a ``shared.transport.layout`` descriptor; ``checksum`` is the payload's CRC32 (0 when
    checksums are off); ``seq`` is the producer's per-ring publication counter.
    """
    KIND: ClassVar[str] = "slot_ready"
    producer: int
    generation: int
    slot: int
    batch_id: int
    seq: int
    descriptor: list
    payload_bytes: int
    num_tokens: int
    checksum: int = 0


@dataclass(frozen=True)
class SlotReleased:
    """Consumer → coordinator: the copy out of the slot has completed; the slot may be reused."""
    KIND: ClassVar[str] = "slot_released"
    producer: int
    generation: int
    slot: int
    batch_id: int


@dataclass(frozen=True)
class BadBatch:
    """Producer → coordinator: ``batch_id`` could not be produced (e.g. non-finite hidden states).

    The slot is free again; the batch is counted as bad and never trained on.
    """
    KIND: ClassVar[str] = "bad_batch"
    producer: int
    generation: int
    slot: int
    batch_id: int
    reason: str


@dataclass(frozen=True)
class Trained:
    """Consumer → coordinator: an optimizer step including ``batch_ids`` has been taken."""
    KIND: ClassVar[str] = "trained"
    ITEM_TYPES: ClassVar[dict] = {"batch_ids": int}
    consumer: int
    step: int
    batch_ids: list
    loss: float
    num_tokens: int
    skipped: bool = False


@dataclass(frozen=True)
class Checkpointed:
    """Consumer (rank 0) → coordinator: a checkpoint holding every batch trained up to ``step`` exists."""
    KIND: ClassVar[str] = "checkpointed"
    step: int
    path: str


@dataclass(frozen=True)
class Heartbeat:
    """Any child → coordinator, every ``heartbeat_interval_s``; ``stats`` is a flat map of numbers/strings.

    Its keys are declared in ``shared.transport.stats`` (``ChildStats.to_wire`` writes it, ``parse_stats`` reads
    it): every child sends ``work``/``work_s`` (``shared.process.procs``) and the balance figures ``busy_s``,
    ``window_s``, ``idle_tail_s`` (``shared.process.balance``); the role adds its own (``ProducerStats``,
    ``ConsumerStats``: ``tokens_per_s``, ``tokens``, ...). New keys need no new schema version: a reader ignores
    keys it does not know and treats a missing key as "not reported"."""
    KIND: ClassVar[str] = "heartbeat"
    role: str
    index: int
    generation: int
    pid: int
    stats: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Shutdown:
    """Coordinator → child: finish the current item and exit cleanly."""
    KIND: ClassVar[str] = "shutdown"
    reason: str


@dataclass(frozen=True)
class Error:
    """Any child → coordinator: an error; ``fatal`` means the child is about to exit."""
    KIND: ClassVar[str] = "error"
    role: str
    index: int
    generation: int
    message: str
    fatal: bool = False


@dataclass(frozen=True)
class Command:
    """``launch.py`` → coordinator: an operator request, answered with a ``Reply``.

    ``action``: ``"status"``, ``"restart"`` (``role``/``index`` name the process) or ``"stop"``.
    """
    KIND: ClassVar[str] = "command"
    action: str
    role: str = ""
    index: int = -1


@dataclass(frozen=True)
class Reply:
    """Coordinator → ``launch.py``: the answer to a ``Command``."""
    KIND: ClassVar[str] = "reply"
    ok: bool
    text: str
    data: dict = field(default_factory=dict)


@dataclass(frozen=True)
class NodeMsg:
    """Between node supervisors of a multi-node run, over their authenticated TCP link (``supervisor.nodes``).

    ``event``: ``"hello"`` (node ``node`` has joined; ``body`` empty), ``"child"`` (``body`` is an encoded child
    message, indices global: up, from ``role`` ``index`` of node ``node``; down, to it), ``"producer_died"``
    (global producer ``index`` has exited and been reaped), ``"send_failed"`` (``body`` could not be handed to
    ``role`` ``index``: roll it back), ``"stop"`` (``reason``: the run stops), ``"heartbeat"``, ``"bye"`` (the node
    has stopped its children), ``"restart"`` (node 0 to the node that owns global producer ``index``: an
    operator's ``launch.py restart producer``).
    """
    KIND: ClassVar[str] = "node"
    node: int
    event: str
    role: str = ""
    index: int = -1
    reason: str = ""
    body: bytes = b""


MESSAGE_TYPES: dict[str, type] = {
    cls.KIND: cls
    for cls in (Hello, Lease, SlotReady, SlotReleased, BadBatch, Trained, Checkpointed, Heartbeat,
                Shutdown, Error, Command, Reply, NodeMsg)
}

_PY_TYPES = {int: (int,), float: (float, int), str: (str,), bool: (bool,), list: (list,), dict: (dict,),
             bytes: (bytes,)}


def _field_types(cls) -> dict[str, tuple]:
    cached = cls.__dict__.get("_specring_field_types")
    if cached is None:
        hints = typing.get_type_hints(cls)
        cached = {f.name: _PY_TYPES[hints[f.name]] for f in dataclasses.fields(cls)}
        setattr(cls, "_specring_field_types", cached)
    return cached


def _plain(value: Any) -> Any:
    """Turn numpy/torch scalars and arrays into Python numbers and lists (msgpack default hook)."""
    if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
        return value.item()
    if callable(getattr(value, "tolist", None)):
        return value.tolist()
    raise TypeError(f"cannot encode {type(value).__name__} in a control message")


def encode(msg: Any) -> bytes:
    """Encode a message instance to msgpack bytes.

    Raises ``MessageError`` if ``msg`` is not a known message type or the frame exceeds the size cap.
    """
    cls = type(msg)
    if MESSAGE_TYPES.get(getattr(cls, "KIND", None)) is not cls:
        raise MessageError(f"cannot encode {cls.__name__}: not a control message type")
    body = {"kind": cls.KIND, "v": SCHEMA_VERSION}
    for f in dataclasses.fields(cls):
        body[f.name] = getattr(msg, f.name)
    try:
        data = msgpack.packb(body, use_bin_type=True, default=_plain)
    except (TypeError, ValueError) as e:
        raise MessageError(f"cannot encode {cls.KIND} message: {e}") from None
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(f"{cls.KIND} message of {len(data)} bytes exceeds the cap of {MAX_MESSAGE_BYTES} bytes")
    return data


def decode(data: bytes) -> Any:
    """Decode msgpack bytes into a message instance; raises ``MessageError`` naming what is wrong."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(f"frame of {len(data)} bytes exceeds the cap of {MAX_MESSAGE_BYTES} bytes")
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise MessageError(f"undecodable frame of {len(data)} bytes: {type(e).__name__}: {e}") from None
    if not isinstance(body, dict):
        raise MessageError(f"frame is a {type(body).__name__}, not a message map")
    kind = body.pop("kind", None)
    version = body.pop("v", None)
    if kind is None:
        raise MessageError("message has no 'kind' field")
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise MessageError(f"unknown message kind {kind!r}")
    if type(version) is not int or version != SCHEMA_VERSION:  # True == 1.0 == 1 must not pass
        raise MessageError(f"{kind} message has schema version {version!r}; this build speaks {SCHEMA_VERSION}")
    types = _field_types(cls)
    unknown = set(body) - set(types)
    if unknown:
        raise MessageError(f"{kind} message has unknown field(s) {sorted(unknown)}")
    for f in dataclasses.fields(cls):
        if f.name not in body:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise MessageError(f"{kind} message is missing field {f.name!r}")
            continue
        value = body[f.name]
        ok = types[f.name]
        if not isinstance(value, ok) or (isinstance(value, bool) and bool not in ok):
            raise MessageError(f"{kind} message field {f.name!r} should be {ok[0].__name__}, "
                               f"got {type(value).__name__}")
        item = getattr(cls, "ITEM_TYPES", {}).get(f.name)
        if item is not None:
            bad = next((x for x in value if not isinstance(x, item) or isinstance(x, bool)), None)
            if bad is not None:
                raise MessageError(f"{kind} message field {f.name!r} should hold only {item.__name__}s, "
                                   f"got {type(bad).__name__} {bad!r}"[:300])
    return cls(**body)
