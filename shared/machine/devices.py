"""Device and dtype names as the configuration and the command line spell them, and what they stand for.

* ``resolve_device("cuda:1")``: the one parser of a device string (``cpu``, ``cuda``, ``cuda:N``), checked
  against this machine.
* ``resolve_device_group("cuda:0+cuda:1")``: a producer's device group, devices joined by ``+`` (one target
  split over several devices); ``shared.machine.device_groups.group_members`` splits it without looking at the machine.
* ``DTYPES``: the one map from a dtype name (``"bfloat16"``) to a torch dtype; every dtype a slot payload may
  carry (``shared.transport.layout``). ``MODEL_DTYPES``: those a target or an exported drafter may be held
  in. ``resolve_dtype`` adds ``"auto"``: bfloat16 on CUDA, float32 on CPU.

Every error is a ``ConfigError`` naming the device or dtype.
"""

from __future__ import annotations

import re

import torch

from specring.shared.errors import ConfigError
from specring.shared.machine.device_groups import group_members

DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
}
for _name in ("uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        DTYPES[_name] = getattr(torch, _name)
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
MODEL_DTYPES: dict[str, torch.dtype] = {name: DTYPES[name] for name in ("bfloat16", "float16", "float32")}

_DEVICE_RE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")


def resolve_device(spec: str | torch.device) -> torch.device:
    """Validate a device string (``"cpu"``, ``"cuda"``, ``"cuda:N"``) against this machine.

    Raises ``ConfigError`` naming the device for an unknown kind, CUDA requested where there is none, or an
    index past ``torch.cuda.device_count()``. ``"cuda"`` resolves to ``cuda:0``.
    """
    text = str(spec).strip()
    m = _DEVICE_RE.match(text)
    if not m:
        raise ConfigError(f"device {text!r} is not understood: use cpu, cuda or cuda:N")
    kind, index = m.group(1), m.group(2)
    if kind == "cpu":
        if index not in (None, "0"):
            raise ConfigError(f"device {text!r}: cpu takes no index")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"device {text!r} does not exist: CUDA is not available on this machine")
    count = torch.cuda.device_count()
    idx = int(index) if index is not None else 0
    if idx >= count:
        raise ConfigError(f"device {text!r} does not exist: this machine has {count} CUDA device(s) "
                          f"(cuda:0..cuda:{count - 1})")
    return torch.device("cuda", idx)


def resolve_device_group(spec: str | torch.device) -> list[torch.device]:
    """Validate a producer's device group (``"cpu"``, ``"cuda:2"``, ``"cuda:0+cuda:1"``, ``"cpu+cpu"``) against
    this machine; returns its devices in order (the first gets the embedding and the inputs, the last the final
    norm; ``shared.models.target.layer_device_map``).

    Every member goes through ``resolve_device``. Raises ``ConfigError`` naming the group for a member that is not
    a device of this machine, a group that mixes CPU and CUDA (one dtype serves the whole target), or a CUDA
    device named twice. ``cpu+cpu`` is allowed (a split target on one host device: tests of the placement).
    """
    if isinstance(spec, torch.device):
        return [resolve_device(spec)]
    devices = [resolve_device(p) for p in group_members(spec)]
    kinds = {d.type for d in devices}
    if len(kinds) > 1:
        raise ConfigError(f"device group {spec!r} mixes CPU and CUDA devices: a target is split over devices of "
                          f"one kind")
    cuda = [d for d in devices if d.type == "cuda"]
    if len(set(cuda)) != len(cuda):
        raise ConfigError(f"device group {spec!r} names a CUDA device twice")
    return devices


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``"auto"`` is bfloat16 on CUDA and float32 on CPU; otherwise the named dtype of ``MODEL_DTYPES``
    (``ConfigError`` if unknown)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in MODEL_DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one of auto, {', '.join(MODEL_DTYPES)}")
    return MODEL_DTYPES[dtype]
