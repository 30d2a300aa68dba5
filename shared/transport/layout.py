"""Named tensors inside a slot payload.

A payload is a sequence of tensors laid out back to back in a ``uint8`` buffer, each starting at a
multiple of ``ALIGN`` bytes (64, so every dtype is naturally aligned and SIMD-friendly). The
*descriptor* that travels in the ``SlotReady`` message lists, per tensor, its name, dtype name, shape and
byte offset: ``[[name, dtype, [d0, d1, ...], offset], ...]`` (plain lists and strings, msgpack-safe).

``write_tensors`` copies tensors into the buffer (the one copy a payload costs); ``read_tensors`` returns
views on the buffer (no copy), so a reader that keeps them must copy before the slot is released.

Supported dtypes: every dtype in ``shared.machine.devices.DTYPES`` (bool, the integer types, float16/32/64, bfloat16,
complex64/128). Shapes of any rank, zero-sized dimensions included.

Which tensors a producer's slot holds (names, dtypes, shapes, write order) is declared once, by
``shared.transport.slot_batch.SlotBatch``; this module lays out any named tensors.
"""

from __future__ import annotations

from typing import Mapping

import torch

from specring.shared.errors import MessageError, PayloadTooLarge
from specring.shared.machine.devices import DTYPE_NAMES, DTYPES

ALIGN = 64

Descriptor = list  # [[name, dtype_name, shape_list, offset], ...]


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _nbytes(dtype: torch.dtype, shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty((), dtype=dtype).element_size()


def payload_bytes(specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> int:
    """Bytes a payload of these ``{name: (dtype, shape)}`` tensors needs, alignment included."""
    end = 0
    for dtype, shape in specs.values():
        end = _align(end) + _nbytes(dtype, shape)
    return end


def plan_layout(tensors: Mapping[str, torch.Tensor]) -> tuple[Descriptor, int]:
    """Descriptor and total payload bytes for ``tensors`` (order preserved), without writing anything.

    Raises ``ValueError`` for a dtype that cannot travel.
    """
    desc: Descriptor = []
    end = 0
    for name, t in tensors.items():
        if t.dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} cannot be stored in a slot")
        off = _align(end)
        desc.append([str(name), DTYPE_NAMES[t.dtype], [int(d) for d in t.shape], off])
        end = off + t.numel() * t.element_size()
    return desc, end


def write_tensors(buf: torch.Tensor, tensors: Mapping[str, torch.Tensor],
                  non_blocking: bool = False) -> tuple[Descriptor, int]:
    """Copy ``tensors`` into the 1-D ``uint8`` tensor ``buf`` and return ``(descriptor, payload_bytes)``.

    Tensors may live on any device; a CUDA source with ``non_blocking=True`` issues an asynchronous
    device-to-host copy, and the caller must synchronise (record and wait an event) before publishing.

    Raises ``PayloadTooLarge`` (naming both sizes) before writing anything if the payload does not fit.
    """
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise ValueError(f"slot buffer must be a 1-D uint8 tensor, got {buf.dtype} {tuple(buf.shape)}")
    desc, total = plan_layout(tensors)
    if total > buf.numel():
        raise PayloadTooLarge(f"payload of {total} bytes does not fit in a slot of {buf.numel()} bytes "
                              f"(tensors: {', '.join(f'{d[0]}{tuple(d[2])}:{d[1]}' for d in desc)})")
    for (name, dtype_name, shape, off), t in zip(desc, tensors.values()):
        n = t.numel() * t.element_size()
        if n == 0:
            continue
        dst = buf[off:off + n].view(t.dtype).view(t.shape)
        dst.copy_(t, non_blocking=non_blocking)
    return desc, total


def read_tensors(buf: torch.Tensor, desc: Descriptor) -> dict[str, torch.Tensor]:
    """Views (no copy) of the tensors that ``desc`` places in the 1-D ``uint8`` tensor ``buf``.

    Raises ``MessageError`` if the descriptor is malformed, names an unknown dtype, or points outside
    the buffer (a descriptor comes from a message, so it is untrusted input).
    """
    out: dict[str, torch.Tensor] = {}
    if not isinstance(desc, (list, tuple)):
        raise MessageError(f"layout descriptor must be a list, got {type(desc).__name__}")
    for i, entry in enumerate(desc):
        try:
            name, dtype_name, shape, off = entry
            shape = [int(d) for d in shape]
            off = int(off)
        except (TypeError, ValueError) as e:
            raise MessageError(f"layout descriptor entry {i} is malformed: {entry!r} ({e})") from None
        if dtype_name not in DTYPES:
            raise MessageError(f"layout descriptor entry {i} ({name!r}): unknown dtype {dtype_name!r}")
        if off < 0 or off % ALIGN or any(d < 0 for d in shape):
            raise MessageError(f"layout descriptor entry {i} ({name!r}): bad offset {off} or shape {shape}")
        dtype = DTYPES[dtype_name]
        n = _nbytes(dtype, shape)
        if off + n > buf.numel():
            raise MessageError(f"layout descriptor entry {i} ({name!r}) ends at byte {off + n}, "
                               f"past the slot's {buf.numel()} bytes")
        if n == 0:
            out[name] = torch.empty(shape, dtype=dtype)
        else:
            out[name] = buf[off:off + n].view(dtype).view(shape)
    return out
