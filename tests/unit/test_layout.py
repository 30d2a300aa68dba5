"""Unit tests of shared/transport/layout.py: named tensors written into, and read back (as views) from, a slot buffer.

No processes, no shared memory: the "slot" is an ordinary 1-D uint8 tensor here (tests/system does the
same through a real ring across a spawned process).
"""

from __future__ import annotations

import msgpack
import pytest
import torch

from specring.shared.errors import MessageError, PayloadTooLarge
from specring.shared.transport import layout, messages
from tests.system.ring_worker import (
    sample_tensor as make_tensor,  # the cross-process round trip uses it too
)

SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 0, 4), (2, 3, 4, 5), (1, 2, 1, 3, 1, 2)]



def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN-safe, works for unsigned dtypes that lack comparison kernels)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def test_every_dtype_and_shape_round_trips_bit_exact():
    tensors = {f"{name}_{i}": make_tensor(dtype, shape, seed=100 * i + j)
               for j, (name, dtype) in enumerate(layout.DTYPES.items())
               for i, shape in enumerate(SHAPES)}
    buf = torch.zeros(1 << 20, dtype=torch.uint8)
    desc, total = layout.write_tensors(buf, tensors)
    assert total <= buf.numel()
    out = layout.read_tensors(buf, desc)
    assert list(out) == list(tensors)  # order preserved
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype, name
        assert tuple(out[name].shape) == tuple(t.shape), name
        assert same_bits(out[name], t), name


def test_bfloat16_values_survive():
    t = torch.tensor([1.0, -2.5, 3.140625, float("inf"), -0.0], dtype=torch.bfloat16)
    buf = torch.zeros(4096, dtype=torch.uint8)
    desc, _ = layout.write_tensors(buf, {"h": t})
    assert desc[0][1] == "bfloat16"
    back = layout.read_tensors(buf, desc)["h"]
    assert back.dtype == torch.bfloat16 and same_bits(back, t)


def test_read_returns_views_on_the_slot_not_copies():
    buf = torch.zeros(8192, dtype=torch.uint8)
    a = torch.arange(10, dtype=torch.int32)
    b = torch.ones(3, 4, dtype=torch.float32)
    desc, _ = layout.write_tensors(buf, {"a": a, "b": b})
    out = layout.read_tensors(buf, desc)
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    for name, view in out.items():
        assert lo <= view.data_ptr() < hi, f"{name} is not inside the slot buffer"
        assert view.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr(), name
    # A write into the slot shows through the view, and a write through the view lands in the slot.
    off_a = desc[0][3]
    buf[off_a:off_a + 4].view(torch.int32).fill_(-7)
    assert out["a"][0].item() == -7
    out["b"][2, 3] = 42.0
    off_b = desc[1][3]
    assert buf[off_b:off_b + 48].view(torch.float32)[11].item() == 42.0


def test_offsets_are_aligned_and_do_not_overlap():
    tensors = {"x": torch.zeros(3, dtype=torch.uint8), "y": torch.zeros(5, dtype=torch.float64),
               "z": torch.zeros(1, dtype=torch.bfloat16), "w": torch.zeros(2, 2, dtype=torch.complex128)}
    desc, total = layout.plan_layout(tensors)
    end = 0
    for (name, _dtype, _shape, off), t in zip(desc, tensors.values()):
        assert off % layout.ALIGN == 0, name
        assert off >= end, f"{name} overlaps the previous tensor"
        end = off + t.numel() * t.element_size()
    assert total == end
    specs = {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()}
    assert layout.payload_bytes(specs) == total


def test_non_contiguous_and_sliced_sources_are_written_correctly():
    base = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    tensors = {"t": base.transpose(0, 2), "s": base[:, ::2, 1:4], "e": base.expand(2, 3, 4, 5)}
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    desc, _ = layout.write_tensors(buf, tensors)
    out = layout.read_tensors(buf, desc)
    for name, t in tensors.items():
        assert out[name].is_contiguous()
        assert torch.equal(out[name], t), name


def test_descriptor_is_msgpack_safe_and_travels_in_slot_ready():
    tensors = {"hidden": torch.zeros(4, 6, dtype=torch.bfloat16), "ids": torch.zeros(4, dtype=torch.int64)}
    buf = torch.zeros(4096, dtype=torch.uint8)
    desc, total = layout.write_tensors(buf, tensors)
    assert msgpack.unpackb(msgpack.packb(desc), raw=False) == desc
    msg = messages.SlotReady(producer=0, generation=1, slot=2, batch_id=3, seq=4, descriptor=desc,
                             payload_bytes=total, num_tokens=4)
    back = messages.decode(messages.encode(msg))
    assert back.descriptor == desc
    out = layout.read_tensors(buf, back.descriptor)
    assert out["hidden"].shape == (4, 6) and out["ids"].dtype == torch.int64


def test_payload_too_large_names_both_sizes_and_writes_nothing():
    buf = torch.full((4096,), 0xAB, dtype=torch.uint8)
    big = {"small": torch.zeros(16, dtype=torch.uint8), "big": torch.zeros(1024, dtype=torch.float32)}
    with pytest.raises(PayloadTooLarge) as ei:
        layout.write_tensors(buf, big)
    text = str(ei.value)
    _, need = layout.plan_layout(big)
    assert str(need) in text and "4096" in text
    assert bool((buf == 0xAB).all()), "a refused payload must not touch the slot"


def test_payload_that_exactly_fills_the_slot_fits():
    buf = torch.zeros(4096, dtype=torch.uint8)
    desc, total = layout.write_tensors(buf, {"x": torch.ones(1024, dtype=torch.float32)})
    assert total == 4096
    assert layout.read_tensors(buf, desc)["x"].sum().item() == 1024


def test_bad_slot_buffer_is_rejected():
    with pytest.raises(ValueError, match="uint8"):
        layout.write_tensors(torch.zeros(16, dtype=torch.float32), {"x": torch.zeros(1)})
    with pytest.raises(ValueError, match="1-D"):
        layout.write_tensors(torch.zeros(4, 4, dtype=torch.uint8), {"x": torch.zeros(1)})


@pytest.mark.parametrize("desc, needle", [
    ("not a list", "must be a list"),
    ([["x", "float32", [2]]], "entry 0 is malformed"),
    ([["x", "float32", "ab", 0]], "entry 0 is malformed"),
    ([["x", "float99", [2], 0]], "unknown dtype 'float99'"),
    ([["x", "float32", [2], 3]], "bad offset 3"),
    ([["x", "float32", [2], -64]], "bad offset -64"),
    ([["x", "float32", [-1, 2], 0]], "bad offset 0 or shape"),
    ([["x", "float32", [2000], 0]], "past the slot's 4096 bytes"),
    ([["ok", "uint8", [1], 0], ["x", "int64", [1], 4096]], "entry 1 ('x')"),
])
def test_malformed_descriptor_raises_message_error_naming_the_entry(desc, needle):
    buf = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(MessageError) as ei:
        layout.read_tensors(buf, desc)
    assert needle in str(ei.value)


def test_zero_sized_tensors_take_no_bytes():
    buf = torch.zeros(4096, dtype=torch.uint8)
    desc, total = layout.write_tensors(buf, {"e": torch.zeros(0, 7), "x": torch.ones(2, dtype=torch.int16)})
    assert total == 4
    out = layout.read_tensors(buf, desc)
    assert out["e"].shape == (0, 7) and out["x"].tolist() == [1, 1]
