"""Unit tests of shared/transport/ring.py in one process: segment layout, slot protocol, errors, sweeping.

Real segments in /dev/shm, but no child processes (tests/system covers attach/kill across processes). Two
mappings of one segment in this process (``create`` + ``attach``) stand in for two processes: they share
pages exactly as two processes do.
"""

from __future__ import annotations

import fcntl
import gc
import os
import struct
import zlib

import pytest
import torch

from specring.shared.errors import ShmSpaceError, SlotError
from specring.shared.transport import layout, ring
from specring.shared.transport.ring import EMPTY, PUBLISHED, WRITING, Ring


@pytest.fixture
def run_id():
    """A fresh run id; on teardown, no segment of that run may remain (leftovers are removed, then fail)."""
    rid = ring.new_run_id()  # 16 characters: the header stores at most 16
    yield rid
    gc.collect()
    left = [n for n in ring.list_segments() if n.startswith(f"{ring.NAME_PREFIX}{rid}-")]
    for name in left:
        os.unlink(os.path.join(ring.SHM_DIR, name))
    assert not left, f"test left segments in /dev/shm: {left}"


@pytest.fixture
def owner(run_id):
    r = Ring.create(ring.segment_name(run_id, "p0"), num_slots=3, slot_bytes=10_000)
    try:
        yield r
    finally:
        r.close()
        r.unlink()


def shm_path(name: str) -> str:
    return os.path.join(ring.SHM_DIR, name)


def mapped_paths() -> set[str]:
    with open("/proc/self/maps") as f:
        return {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}


# ------------------------------------------------------------------ names and layout
def test_segment_name_carries_run_id_and_no_pid():
    name = ring.segment_name("abc123", "p0")
    assert name == "specring-abc123-p0"
    m = ring._NAME_RE.match(name)
    assert m and m["run"] == "abc123" and m["pid"] is None and m["tag"] == "p0"
    assert ring.segment_name("r1", "p.1") == "specring-r1-p.1"
    legacy = ring._NAME_RE.match("specring-r1-42-p.1")  # older builds put the creator's pid in the name
    assert legacy and legacy["run"] == "r1" and legacy["tag"] == "p.1"
    with pytest.raises(ValueError, match="run_id"):
        ring.segment_name("bad-id", "p0")
    with pytest.raises(ValueError, match="tag"):
        ring.segment_name("ok", "a/b")


def test_new_run_ids_are_alphanumeric_distinct_and_carry_no_pid():
    ids = {ring.new_run_id() for _ in range(200)}
    assert all(i.isalnum() and len(i) == 16 for i in ids)
    assert len(ids) == 200  # 32 random bits each: two runs started in one second (pid 1 each) differ


def test_created_segment_layout(owner, run_id):
    path = shm_path(owner.name)
    st = os.stat(path)
    assert st.st_mode & 0o777 == 0o600
    assert owner.slot_bytes == 12_288  # 10_000 rounded up to 4 KiB
    assert st.st_size == ring.segment_bytes(3, 10_000) == owner.payload_offset + 3 * 12_288
    with open(path, "rb") as f:
        head = f.read(64)
    magic, version, num_slots, slot_bytes, payload_off, pid, start, rid = ring.RING_HEADER.unpack(head)
    assert magic == b"SPECRING" and version == ring.LAYOUT_VERSION
    assert (num_slots, slot_bytes, payload_off, pid) == (3, 12_288, owner.payload_offset, os.getpid())
    assert start > 0 and rid.rstrip(b"\0").decode() == run_id
    assert owner.run_id == run_id
    # Payloads start on 4 KiB boundaries of the address space (pinning and DMA want page alignment) and
    # never overlap the 64-byte slot header records, which sit between the ring header and the payloads.
    assert owner.payload_offset % ring.PAGE == 0
    assert owner.payload_offset >= 64 + owner.num_slots * ring.SLOT_HEADER_BYTES
    for i in range(owner.num_slots):
        p = owner.payload(i)
        assert p.dtype == torch.uint8 and p.numel() == owner.slot_bytes
        assert p.data_ptr() % 4096 == 0
    assert ring.SLOT_HEADER_BYTES == 64 and ring.SLOT_HEADER.size <= 64


def test_fresh_slots_are_empty_and_zero(owner):
    for i in range(owner.num_slots):
        h = owner.header(i)
        assert h.state == EMPTY and h.state_name == "EMPTY"
        assert int(owner.payload(i).sum()) == 0


def test_slots_do_not_overlap(owner):
    for i in range(owner.num_slots):
        owner.payload(i).fill_(i + 1)
    for i in range(owner.num_slots):
        assert bool((owner.payload(i) == i + 1).all()), f"slot {i} was overwritten by a neighbour"
        assert owner.header(i).state == EMPTY, f"slot {i} header was overwritten by a payload"


# ------------------------------------------------------------------ the slot protocol
def test_write_publish_verify_between_two_mappings(owner):
    peer = Ring.attach(owner.name)
    try:
        assert (peer.num_slots, peer.slot_bytes, peer.run_id, peer.owner) == (3, owner.slot_bytes, owner.run_id, False)
        buf = peer.begin_write(1, batch_id=77, generation=3, seq=5)
        h = owner.header(1)
        assert (h.state, h.batch_id, h.generation, h.seq) == (WRITING, 77, 3, 5)
        with pytest.raises(SlotError, match="WRITING, not PUBLISHED"):
            owner.verify(1, batch_id=77, generation=3)
        tensors = {"hidden": torch.randn(10, 16).to(torch.bfloat16), "ids": torch.arange(10)}
        desc, n = layout.write_tensors(buf, tensors)
        crc = peer.publish(1, batch_id=77, generation=3, seq=5, payload_len=n, checksum=True)
        assert crc == zlib.crc32(bytes(owner.payload(1)[:n].numpy()))
        h = owner.verify(1, batch_id=77, generation=3)
        assert (h.state, h.payload_len, h.seq, h.checksum, h.flags) == (PUBLISHED, n, 5, crc, ring.FLAG_CHECKSUM)
        out = layout.read_tensors(owner.payload(1), desc)
        assert torch.equal(out["hidden"], tensors["hidden"]) and torch.equal(out["ids"], tensors["ids"])
        assert owner.header(0).state == EMPTY and owner.header(2).state == EMPTY
    finally:
        peer.close()
    assert os.path.exists(shm_path(owner.name)), "closing an attached ring must not unlink it"


def test_verify_names_stale_generation_and_wrong_batch(owner):
    owner.begin_write(0, batch_id=5, generation=2, seq=0)
    owner.publish(0, batch_id=5, generation=2, seq=0, payload_len=0)
    owner.verify(0, batch_id=5, generation=2)
    with pytest.raises(SlotError, match="holds batch 5 generation 2, message says batch 6 generation 2"):
        owner.verify(0, batch_id=6, generation=2)
    with pytest.raises(SlotError, match="holds batch 5 generation 2, message says batch 5 generation 1"):
        owner.verify(0, batch_id=5, generation=1)


def test_verify_detects_a_corrupted_payload(owner):
    buf = owner.begin_write(2, batch_id=1, generation=0, seq=9)
    buf[:5000].copy_(torch.randint(0, 256, (5000,), dtype=torch.uint8))
    owner.publish(2, batch_id=1, generation=0, seq=9, payload_len=5000, checksum=True)
    owner.verify(2, batch_id=1, generation=0)
    buf[4999] ^= 0xFF
    with pytest.raises(SlotError, match="checksum"):
        owner.verify(2, batch_id=1, generation=0)
    owner.verify(2, batch_id=1, generation=0, check_crc=False)
    buf[5000] ^= 0xFF  # past payload_len: not covered
    buf[4999] ^= 0xFF
    owner.verify(2, batch_id=1, generation=0)


def test_publish_without_checksum_records_none(owner):
    owner.begin_write(0, batch_id=1, generation=0, seq=0)
    assert owner.publish(0, batch_id=1, generation=0, seq=0, payload_len=100) == 0
    h = owner.header(0)
    assert h.flags == 0 and h.checksum == 0 and h.payload_len == 100


def test_publish_rejects_payload_longer_than_the_slot(owner):
    owner.begin_write(0, batch_id=1, generation=0, seq=0)
    with pytest.raises(SlotError, match=f"exceeds slot_bytes {owner.slot_bytes}"):
        owner.publish(0, batch_id=1, generation=0, seq=0, payload_len=owner.slot_bytes + 1)
    assert owner.header(0).state == WRITING


def test_mark_empty_and_reuse(owner):
    for seq in range(3):
        owner.begin_write(1, batch_id=seq, generation=seq, seq=seq)
        owner.publish(1, batch_id=seq, generation=seq, seq=seq, payload_len=8, checksum=True)
        assert owner.verify(1, batch_id=seq, generation=seq).seq == seq
        owner.mark_empty(1)
        assert owner.header(1).state == EMPTY and owner.header(1).batch_id == -1


@pytest.mark.parametrize("slot", [-1, 3, 100])
def test_slot_out_of_range(owner, slot):
    for call in (lambda: owner.payload(slot), lambda: owner.header(slot),
                 lambda: owner.begin_write(slot, 0, 0, 0), lambda: owner.mark_empty(slot)):
        with pytest.raises(SlotError, match=f"slot {slot} out of range .* 3 slots"):
            call()


# ------------------------------------------------------------------ life cycle and errors
def test_create_refuses_bad_sizes_and_existing_names(owner, run_id):
    with pytest.raises(ValueError, match="num_slots"):
        Ring.create(ring.segment_name(run_id, "x"), num_slots=0, slot_bytes=4096)
    with pytest.raises(ValueError, match="slot_bytes"):
        Ring.create(ring.segment_name(run_id, "x"), num_slots=1, slot_bytes=0)
    with pytest.raises(FileExistsError):
        Ring.create(owner.name, num_slots=1, slot_bytes=4096)
    assert owner.header(0).state == EMPTY


def test_attach_errors_name_the_segment(run_id, tmp_path):
    name = ring.segment_name(run_id, "missing")
    with pytest.raises(FileNotFoundError, match=name):
        Ring.attach(name)
    bogus = ring.segment_name(run_id, "bogus")
    try:
        with open(shm_path(bogus), "wb") as f:
            f.write(b"NOTARING" + bytes(8192))
        with pytest.raises(SlotError, match="not a specring ring"):
            Ring.attach(bogus)
        with open(shm_path(bogus), "wb") as f:
            f.write(b"x" * 100)
        with pytest.raises(SlotError, match="only 100 bytes"):
            Ring.attach(bogus)
    finally:
        os.unlink(shm_path(bogus))


def test_attach_refuses_another_layout_version(owner):
    with open(shm_path(owner.name), "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", ring.LAYOUT_VERSION + 1))
    with pytest.raises(SlotError, match=f"layout version {ring.LAYOUT_VERSION + 1}"):
        Ring.attach(owner.name)


def test_not_enough_shm_space_says_needed_and_free(run_id, monkeypatch):
    name = ring.segment_name(run_id, "big")
    free = ring.shm_free_bytes()
    slot_bytes = free + (1 << 30)  # a real request that cannot fit
    with pytest.raises(ShmSpaceError) as ei:
        Ring.create(name, num_slots=1, slot_bytes=slot_bytes)
    text = str(ei.value)
    need_mib = ring.segment_bytes(1, slot_bytes) / 2**20
    assert f"{need_mib:.1f} MiB" in text and "free" in text and name in text
    assert not os.path.exists(shm_path(name))

    monkeypatch.setattr(ring, "shm_free_bytes", lambda: 5 * 2**20)
    with pytest.raises(ShmSpaceError, match=r"need 8\.0 MiB .* only 5\.0 MiB free"):
        Ring.create(name, num_slots=2, slot_bytes=4 * 2**20 - ring.PAGE)
    assert not os.path.exists(shm_path(name))
    assert issubclass(ShmSpaceError, OSError)


def test_context_manager_unlinks_for_the_owner_only(run_id):
    name = ring.segment_name(run_id, "cm")
    with Ring.create(name, num_slots=1, slot_bytes=4096) as r:
        with Ring.attach(name) as a:
            a.payload(0)[0] = 1
        assert os.path.exists(shm_path(name)), "an attached ring's exit unlinked the segment"
        assert r.payload(0)[0].item() == 1
    assert not os.path.exists(shm_path(name))
    r.close()  # idempotent


def test_close_keeps_the_mapping_while_views_live(run_id):
    name = ring.segment_name(run_id, "views")
    r = Ring.create(name, num_slots=1, slot_bytes=4096)
    view = r.payload(0)
    view.fill_(3)
    r.close()
    r.unlink()
    assert shm_path(name) in {p.replace(" (deleted)", "") for p in mapped_paths()}, \
        "close() unmapped the segment while a tensor view still points into it"
    assert int(view.sum()) == 3 * 4096  # safe only because the mapping is still there
    del view, r
    gc.collect()
    assert shm_path(name) not in {p.replace(" (deleted)", "") for p in mapped_paths()}, \
        "the mapping outlived its last view"


def test_unlink_keeps_existing_mappings_valid(owner):
    peer = Ring.attach(owner.name)
    try:
        owner.unlink()
        assert not os.path.exists(shm_path(owner.name))
        owner.payload(0)[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        assert peer.payload(0)[:4].tolist() == [1, 2, 3, 4]
    finally:
        peer.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_pin_is_a_no_op_without_cuda(owner):
    assert owner.pin() is False and owner.pinned is False
    owner.unpin()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pin_registers_in_place_and_unregisters_on_close(run_id):
    r = Ring.create(ring.segment_name(run_id, "pin"), num_slots=2, slot_bytes=1 << 20)
    try:
        src = r.payload(1)
        ptr = src.data_ptr()
        assert r.pin() is True and r.pinned and r.payload(1).data_ptr() == ptr  # in place, no copy
        src.copy_(torch.randint(0, 256, (src.numel(),), dtype=torch.uint8))
        dev = torch.empty(src.numel(), dtype=torch.uint8, device="cuda")
        dev.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(dev.cpu(), src)
    finally:
        r.close()
        r.unlink()
    assert not r.pinned


# ------------------------------------------------------------------ sweeping
def test_sweep_removes_unowned_segments_and_keeps_owned_ones(owner, run_id):
    """Ownership is the creator's flock, not a pid: a file nobody locks is swept, one locked through any
    open file description (another process, another PID namespace) is kept."""
    with open("/proc/sys/kernel/pid_max") as f:
        dead_pid = int(f.read()) + 1  # no process can have this pid
    unowned = ring.segment_name(run_id, "dead")
    legacy = f"{ring.NAME_PREFIX}{run_id}-{dead_pid}-p0"  # an older build's name (no lock): its pid is dead
    legacy_live = f"{ring.NAME_PREFIX}{run_id}-{os.getpid()}-p1"  # ... and one whose creator still runs
    held = ring.segment_name(run_id, "held")
    other_run = ring.segment_name(run_id + "x", "dead")
    unparsable = f"{ring.NAME_PREFIX}{run_id}-not a tag"
    closed = Ring.create(ring.segment_name(run_id, "closed"), num_slots=1, slot_bytes=4096)
    closed.close()  # unmapped but not unlinked: its creator (this process) still owns it
    try:
        for name in (unowned, legacy, legacy_live, held, other_run, unparsable):
            with open(shm_path(name), "wb") as f:
                f.write(bytes(64))
        holder = os.open(shm_path(held), os.O_RDONLY)
        fcntl.flock(holder, fcntl.LOCK_SH)
        assert ring.segment_owned(owner.name) and ring.segment_owned(held) and ring.segment_owned(closed.name)
        assert not ring.segment_owned(unowned) and not ring.segment_owned(ring.segment_name(run_id, "missing"))
        assert sorted(ring.sweep_stale(run_id)) == sorted([unowned, legacy])
        for name in (owner.name, held, closed.name, legacy_live):
            assert os.path.exists(shm_path(name)), f"sweep removed {name}, which a live process owns"
        assert os.path.exists(shm_path(other_run)), "sweep with a run id touched another run"
        assert os.path.exists(shm_path(unparsable))
        assert ring.sweep_stale(run_id + "x") == [other_run]
        os.close(holder)  # its owner exits: now it is stale
        closed.unlink()
        assert ring.sweep_stale(run_id) == [held]
        assert ring.sweep_stale(run_id) == []
    finally:
        closed.unlink()
        for name in (unowned, legacy, legacy_live, held, other_run, unparsable):
            if os.path.exists(shm_path(name)):
                os.unlink(shm_path(name))


def test_list_segments_sees_this_ring(owner):
    assert owner.name in ring.list_segments()
