"""Unit tests of shared/transport/slot_batch.py: the one definition of a slot's payload, its byte layout, the
checks of a slot that was read (errors naming the field), and the round trip through a real ring slot."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from specring.shared.errors import MessageError
from specring.shared.transport import layout, messages, ring
from specring.shared.transport.ring import Ring
from specring.shared.transport.slot_batch import SlotBatch

# the descriptor of this shape as the producer wrote it before SlotBatch (slot_payload_specs): the bytes must not move
LAYOUT_10_3_2_8_BF16_TOP4 = [
    ["hidden", "bfloat16", [10, 16], 0], ["input_ids", "int32", [10], 320], ["loss_mask", "uint8", [10], 384],
    ["cu_seqlens", "int32", [4], 448], ["batch_id", "int64", [1], 512], ["layer_ids", "int32", [2], 576],
    ["target_ids", "int32", [10], 640], ["target_topk_ids", "int32", [10, 4], 704],
    ["target_topk_logprobs", "float32", [10, 4], 896]]


def make(t: int = 10, seqs: int = 3, layers: tuple[int, ...] = (3, 5), h: int = 8, topk: int = 4,
         hidden_dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> SlotBatch:
    """A well-formed slot batch (``topk=-1``: ``label_source=data``, no target labels)."""
    g = torch.Generator().manual_seed(seed)
    cu = torch.linspace(0, t, seqs + 1).round().to(torch.int32)
    target = topk >= 0
    return SlotBatch(
        hidden=torch.randn(t, len(layers) * h, generator=g).to(hidden_dtype),
        input_ids=torch.randint(0, 100, (t,), generator=g, dtype=torch.int32),
        loss_mask=(torch.rand(t, generator=g) > 0.3).to(torch.uint8),
        cu_seqlens=cu, batch_id=torch.tensor([42], dtype=torch.int64),
        layer_ids=torch.tensor(layers, dtype=torch.int32),
        target_ids=torch.randint(0, 100, (t,), generator=g, dtype=torch.int32) if target else None,
        target_topk_ids=torch.randint(0, 100, (t, topk), generator=g, dtype=torch.int32) if topk > 0 else None,
        target_topk_logprobs=torch.randn(t, topk, generator=g) if topk > 0 else None)


def assert_equal(a: SlotBatch, b: SlotBatch) -> None:
    ta, tb = a.to_tensors(), b.to_tensors()
    assert list(ta) == list(tb)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype and torch.equal(ta[name], tb[name]), name


# ------------------------------------------------------------------ the declaration
def test_fields_are_the_declaration_in_write_order():
    assert [f.name for f in dataclasses.fields(SlotBatch)] == list(SlotBatch.SPECS)
    assert SlotBatch.PER_TOKEN == ("hidden", "input_ids", "loss_mask", *SlotBatch.TARGET_LABELS)


@pytest.mark.parametrize("label_source,topk,names", [
    ("data", 0, SlotBatch.IN_EVERY_SLOT), ("data", 4, SlotBatch.IN_EVERY_SLOT),
    ("target", 0, SlotBatch.IN_EVERY_SLOT + ("target_ids",)),
    ("target", 4, SlotBatch.IN_EVERY_SLOT + SlotBatch.TARGET_LABELS)])
def test_specs_name_the_fields_of_each_label_source(label_source, topk, names):
    specs = SlotBatch.specs(10, 3, 2, 8, torch.float16, label_source, topk)
    assert tuple(specs) == names
    assert specs["hidden"] == (torch.float16, (10, 16)) and specs["cu_seqlens"] == (torch.int32, (4,))
    assert specs["batch_id"] == (torch.int64, (1,)) and specs["layer_ids"] == (torch.int32, (2,))
    if topk and label_source == "target":
        assert specs["target_topk_logprobs"] == (torch.float32, (10, 4))


def test_the_byte_layout_is_the_one_producers_wrote_before():
    batch = make()
    specs = SlotBatch.specs(10, 3, 2, 8, torch.bfloat16, "target", 4)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in batch.to_tensors().items()} == specs
    desc, total = layout.write_tensors(torch.zeros(4096, dtype=torch.uint8), batch.to_tensors())
    assert desc == LAYOUT_10_3_2_8_BF16_TOP4
    assert total == layout.payload_bytes(specs) == 1056
    assert layout.payload_bytes(SlotBatch.specs(10, 3, 2, 8, torch.bfloat16, "data", 4)) == 584


# ------------------------------------------------------------------ a real ring slot
@pytest.fixture
def slot_ring():
    rid = ring.new_run_id()
    r = Ring.create(ring.segment_name(rid, "sb"), num_slots=2, slot_bytes=1 << 16)
    try:
        yield r
    finally:
        r.close()
        r.unlink()
        gc.collect()
        assert not [n for n in ring.list_segments() if n.startswith(f"{ring.NAME_PREFIX}{rid}-")]


def publish(r: Ring, batch: SlotBatch | dict, slot: int = 1, batch_id: int = 42) -> messages.SlotReady:
    tensors = batch.to_tensors() if isinstance(batch, SlotBatch) else batch
    buf = r.begin_write(slot, batch_id, generation=1, seq=0)
    desc, n = layout.write_tensors(buf, tensors)
    crc = r.publish(slot, batch_id, 1, 0, n, checksum=True)
    return messages.SlotReady(producer=0, generation=1, slot=slot, batch_id=batch_id, seq=0, descriptor=desc,
                              payload_bytes=n, num_tokens=int(tensors["input_ids"].shape[0]), checksum=crc)


@pytest.mark.parametrize("topk", [-1, 0, 3])
def test_round_trip_through_a_ring_slot(slot_ring, topk):
    batch = make(topk=topk, hidden_dtype=torch.float32)
    msg = publish(slot_ring, batch)
    msg = messages.decode(messages.encode(msg))  # the descriptor as the consumer receives it
    slot_ring.verify(msg.slot, msg.batch_id, msg.generation)
    back = SlotBatch.from_tensors(layout.read_tensors(slot_ring.payload(msg.slot), msg.descriptor))
    assert_equal(back, batch)
    assert back.num_tokens == 10 and (back.target_ids is None) == (topk < 0)
    assert (back.target_topk_ids is None) == (topk <= 0)
    payload = slot_ring.payload(msg.slot)
    lo, hi = payload.data_ptr(), payload.data_ptr() + payload.numel()
    assert lo <= back.hidden.data_ptr() < hi  # views into the slot, no copy
    owned = back.to("cpu", copy=True)
    assert_equal(owned, batch)
    for x in owned.to_tensors().values():
        assert not lo <= x.data_ptr() < hi, "a copy still aliases the slot"


def test_the_consumers_copy_in_gives_a_slot_batch_of_its_own(slot_ring):
    from specring.consumer.main import SlotReader

    batch = make(topk=2, hidden_dtype=torch.float32)
    reader = SlotReader([slot_ring], torch.device("cpu"))
    seen = []
    got = reader.copy_in(publish(slot_ring, batch), check=seen.append)
    assert isinstance(got, SlotBatch) and isinstance(seen[0], SlotBatch)
    assert_equal(got, batch)
    slot_ring.payload(1).zero_()  # the slot is reused: the copy keeps its values
    assert_equal(got, batch)
    bad = dict(batch.to_tensors(), loss_mask=batch.loss_mask.to(torch.int64))
    with pytest.raises(MessageError, match="'loss_mask' has dtype int64, expected uint8"):
        reader.copy_in(publish(slot_ring, bad))


# ------------------------------------------------------------------ checks of a slot that was read
def tensors(**changes) -> dict:
    t = make().to_tensors()
    for k, v in changes.items():
        if v is None:
            t.pop(k)
        else:
            t[k] = v
    return t


@pytest.mark.parametrize("changes,needles", [
    ({"hiden": torch.zeros(10, 16)}, ["unknown field", "'hiden'"]),
    ({"loss_mask": None}, ["'loss_mask' missing"]),
    ({"batch_id": None}, ["'batch_id' missing"]),
    ({"layer_ids": None}, ["'layer_ids' missing"]),
    ({"input_ids": torch.zeros(10, dtype=torch.int64)}, ["'input_ids'", "int64", "expected int32"]),
    ({"hidden": torch.zeros(10, 16, dtype=torch.int32)}, ["'hidden'", "floating-point"]),
    ({"target_topk_logprobs": torch.zeros(10, 4, dtype=torch.float16)}, ["'target_topk_logprobs'", "float16"]),
    ({"loss_mask": torch.zeros(9, dtype=torch.uint8)}, ["'loss_mask'", "[9]", "T=10", "'hidden'"]),
    ({"cu_seqlens": torch.zeros(2, 2, dtype=torch.int32)}, ["'cu_seqlens'", "[S+1]"]),
    ({"batch_id": torch.zeros(2, dtype=torch.int64)}, ["'batch_id'", "[2]", "expected [1]"]),
    ({"hidden": torch.zeros(10, 15, dtype=torch.bfloat16)}, ["'hidden'", "15 columns", "2 layers"]),
    ({"target_topk_logprobs": torch.zeros(10, 3)}, ["'target_topk_logprobs'", "K=4", "'target_topk_ids'"]),
    ({"target_topk_logprobs": None}, ["'target_topk_logprobs' missing"]),
    ({"target_topk_ids": None}, ["'target_topk_ids' missing"]),
    ({"target_ids": None}, ["'target_ids' missing", "top-K"]),
    ({"target_ids": torch.zeros(11, dtype=torch.int32)}, ["'target_ids'", "T=10"]),
])
def test_a_bad_slot_is_refused_naming_the_field(changes, needles):
    with pytest.raises(MessageError) as ei:
        SlotBatch.from_tensors(tensors(**changes))
    for needle in needles:
        assert needle in str(ei.value), (needle, str(ei.value))


def test_a_field_that_is_not_a_tensor_or_a_payload_that_is_not_a_mapping_is_refused():
    with pytest.raises(MessageError, match="'batch_id' is a list, not a tensor"):
        SlotBatch.from_tensors(tensors(batch_id=[42]))
    with pytest.raises(MessageError, match="mapping"):
        SlotBatch.from_tensors([("hidden", torch.zeros(1))])


def test_empty_batches_and_a_data_slot_pass():
    SlotBatch.from_tensors(make(t=0, seqs=1, topk=2).to_tensors())
    assert SlotBatch.from_tensors(make(topk=-1).to_tensors()).target_ids is None


# ------------------------------------------------------------------ in-process batches
def test_of_takes_a_mapping_of_the_names_and_checks_names_only():
    batch = make(topk=-1)
    assert SlotBatch.of(batch) is batch
    loose = {"hidden": torch.zeros(4, 3, dtype=torch.float64), "input_ids": torch.zeros(4, dtype=torch.int64),
             "loss_mask": torch.ones(4, dtype=torch.uint8), "cu_seqlens": torch.tensor([0, 4])}
    got = SlotBatch.of(loose)
    assert got.hidden is loose["hidden"] and got.batch_id is None and got.layer_ids is None
    with pytest.raises(MessageError, match="'loss_mask' missing"):
        SlotBatch.of({k: v for k, v in loose.items() if k != "loss_mask"})
    with pytest.raises(MessageError, match="unknown field.*'lengths'"):
        SlotBatch.of(dict(loose, lengths=torch.tensor([4])))
    with pytest.raises(TypeError):
        SlotBatch.of([1, 2])
    with pytest.raises(MessageError, match="'batch_id' missing"):
        dataclasses.replace(batch, batch_id=None).check()  # every slot has one


def test_map_tokens_and_to_leave_the_sequence_boundaries_alone():
    batch = make(topk=2)
    doubled = batch.map_tokens(lambda x: x.to(torch.float64))
    for name in SlotBatch.PER_TOKEN:
        assert getattr(doubled, name).dtype == torch.float64, name
    assert doubled.cu_seqlens is batch.cu_seqlens and doubled.batch_id is batch.batch_id
    moved = batch.to("cpu")
    assert moved.hidden is batch.hidden and moved.cu_seqlens is batch.cu_seqlens  # nothing to move: no copy
    copied = batch.to("cpu", copy=True)
    assert all(copied.to_tensors()[k].data_ptr() != v.data_ptr() for k, v in batch.to_tensors().items() if v.numel())
    assert "hidden=[10, 16]:bfloat16" in repr(batch) and "target_topk_ids=[10, 2]:int32" in repr(batch)

