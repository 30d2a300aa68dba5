"""System tests of the producer process (producers/main.py): a real child, a real ring, a real ROUTER.

The test plays a minimal coordinator: it binds the ROUTER, writes ``config.json`` and ``topology.json``
into a temporary run directory, creates the ring, starts ``python -m producers.main`` with
``shared.process.procs.spawn_child``, sends leases and reads the slots the child published, in this process.

Every test has a timeout, terminates its child and unlinks its segment in ``finally``, and fails if the
segment is left in /dev/shm.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import torch
import zmq

from specring.shared.config.run_config import (
    DEFAULT_TARGET,
    DataConfig,
    MonitorConfig,
    ProducerConfig,
    RingConfig,
    RunConfig,
)
from specring.shared.data.dataset import TokenDataset
from specring.shared.models.target import load_target
from specring.shared.process import procs
from specring.shared.run.run_dir import RunDir
from specring.shared.transport import channel, layout, messages, ring
from specring.shared.transport.ring import EMPTY, Ring

WAIT_S = 40.0        # a child's start-up imports torch and transformers and loads the target
LAYER_IDS = [1, 4, 7]
H = 256
BAD_BATCH = 2        # the child is told to inject a NaN into this batch


def write_dataset(path: str, lengths: list[int], seed: int = 0) -> None:
    """An Arrow IPC file in shared.data's format: input_ids list<int32>, loss_mask list<uint8>."""
    rng = np.random.default_rng(seed)
    ids = [rng.integers(4, 8192, n, dtype=np.int32) for n in lengths]
    masks = [(rng.random(n) < 0.7).astype(np.uint8) for n in lengths]
    table = pa.table({"input_ids": pa.array(ids, type=pa.list_(pa.int32())),
                      "loss_mask": pa.array(masks, type=pa.list_(pa.uint8()))})
    with ipc.new_file(path, table.schema) as w:
        w.write_table(table)


class FakeCoordinator:
    """A run directory, a ROUTER socket, one ring and one producer child; ``close()`` tears all down."""

    def __init__(self, producer_cfg: ProducerConfig, generation: int, env: dict | None = None,
                 slot_bytes: int = 1 << 20):
        self.dir = tempfile.mkdtemp(prefix="srp-")  # short: ipc paths are limited to ~100 bytes
        self.run_id = ring.new_run_id()
        self.generation = generation
        self.zctx = zmq.Context()
        self.sock = None
        self.ring = None
        self.proc = None
        self.data = os.path.join(self.dir, "train.arrow")
        write_dataset(self.data, [5, 12, 9, 30, 1, 17])
        cfg = RunConfig(run_dir=self.dir, run_id=self.run_id, data=DataConfig(data=self.data),
                        ring=RingConfig(num_slots=2, slot_bytes=slot_bytes, checksum=True),
                        producer=producer_cfg,
                        monitor=MonitorConfig(heartbeat_interval_s=0.25, hang_timeout_s=5.0))
        with open(os.path.join(self.dir, "config.json"), "w") as f:
            json.dump(cfg.to_dict(), f)
        address = RunDir(self.dir).coordinator_address()
        self.sock = channel.bind_router(self.zctx, address)
        self.ring = Ring.create(ring.segment_name(self.run_id, "p0"), num_slots=2, slot_bytes=slot_bytes)
        RunDir(self.dir).write_topology(procs.Topology(
            run_id=self.run_id, address=address, rings=[self.ring.name], slot_bytes=self.ring.slot_bytes,
            num_slots=2, supervisor_pid=os.getpid()))
        self.log = os.path.join(self.dir, "producer-0.log")
        self.proc = procs.spawn_child("specring.producers.main", self.dir, 0, generation, self.log, env=env)
        self.peer = None
        self.seen: list = []

    def recv(self, want, timeout_s: float = WAIT_S):
        """The next message of type ``want`` (others are kept in ``self.seen``); fails after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        exited_at = None
        while time.monotonic() < deadline:
            got = channel.recv_from(self.sock, timeout_s=0.1)
            if got is None:
                if exited_at is None and self.proc.poll() is not None:
                    exited_at = time.monotonic()  # its last frames may still be in flight: drain a while
                if exited_at is not None and time.monotonic() - exited_at > 2.0:
                    pytest.fail(f"producer exited with {self.proc.returncode} while waiting for "
                                f"{want.__name__}; log:\n{self.log_text()}")
                continue
            self.peer, msg = got
            self.seen.append(msg)
            if isinstance(msg, want):
                return msg
        pytest.fail(f"no {want.__name__} within {timeout_s} s; log:\n{self.log_text()}")

    def send(self, msg) -> None:
        channel.send(self.sock, msg, to=self.peer)

    def lease(self, batch_id: int, slot: int, sample_ids: list[int], generation: int | None = None) -> None:
        lengths = TokenDataset(self.data).lengths
        pad_to = int(max(lengths[i] for i in sample_ids if i < len(lengths))) + 3
        self.send(messages.Lease(batch_id=batch_id, slot=slot, generation=generation or self.generation,
                                 epoch=0, sample_ids=sample_ids, pad_to=pad_to))

    def log_text(self) -> str:
        try:
            with open(self.log) as f:
                return f.read()[-4000:]
        except OSError:
            return "(no log)"

    def close(self) -> None:
        try:
            if self.proc is not None:
                procs.terminate(self.proc, timeout_s=5.0)
        finally:
            if self.sock is not None:
                self.sock.close(0)
            self.zctx.term()
            if self.ring is not None:
                self.ring.close()
                self.ring.unlink()
                assert not os.path.exists(os.path.join(ring.SHM_DIR, self.ring.name))
            shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def model():
    m, _ = load_target(DEFAULT_TARGET, "cpu")
    return m


def reference(model, ids: np.ndarray) -> torch.Tensor:
    with torch.inference_mode():
        hs = model.model(input_ids=torch.from_numpy(ids.astype(np.int64))[None], output_hidden_states=True,
                         use_cache=False).hidden_states
    return torch.cat([hs[i + 1][0] for i in LAYER_IDS], dim=1)


@pytest.mark.timeout(120)
def test_producer_serves_leases_through_a_real_ring(model):
    co = FakeCoordinator(ProducerConfig(devices=["cpu"], target_layer_ids=LAYER_IDS), generation=3,
                         env={"SPECRING_INJECT_NONFINITE": str(BAD_BATCH)})
    try:
        hello = co.recv(messages.Hello)
        assert (hello.role, hello.index, hello.generation, hello.pid) == ("producer", 0, 3, co.proc.pid)
        co.sock.send_multipart([co.peer, b"\xc1 not msgpack"])            # logged, never fatal
        co.lease(100, 0, [0, 1], generation=2)                             # stale generation: ignored
        co.lease(1, 0, [0, 3, 2])
        co.lease(BAD_BATCH, 1, [1])
        ready = co.recv(messages.SlotReady)
        bad = co.recv(messages.BadBatch)

        # batch 1: the consumer side (this process) sees exactly what was written, and it is right
        assert (ready.producer, ready.generation, ready.slot, ready.batch_id, ready.seq) == (0, 3, 0, 1, 0)
        h = co.ring.verify(0, 1, 3)                                          # header + CRC32 of the payload
        assert h.checksum == ready.checksum != 0
        t = layout.read_tensors(co.ring.payload(0), ready.descriptor)
        ds = TokenDataset(co.data)
        assert t["cu_seqlens"].tolist() == [0, 5, 35, 44] and ready.num_tokens == 44
        assert t["batch_id"].tolist() == [1] and t["layer_ids"].tolist() == LAYER_IDS
        assert t["hidden"].shape == (44, 3 * H) and t["hidden"].dtype == torch.float32
        cu = t["cu_seqlens"].tolist()
        for row, sample in enumerate([0, 3, 2]):
            ids, mask = ds[sample]
            rows = slice(cu[row], cu[row + 1])
            assert t["input_ids"][rows].tolist() == ids.tolist()
            assert t["loss_mask"][rows].tolist() == mask.tolist()
            torch.testing.assert_close(t["hidden"][rows], reference(model, ids), atol=1e-4, rtol=1e-5)

        # the injected batch: reported, never published
        assert (bad.batch_id, bad.slot, bad.generation) == (BAD_BATCH, 1, 3) and "non-finite" in bad.reason
        assert co.ring.header(1).state == EMPTY

        # a lease that names a sample the dataset does not have is answered, not fatal
        co.send(messages.Lease(batch_id=3, slot=1, generation=3, epoch=0, sample_ids=[4, 99], pad_to=8))
        bad3 = co.recv(messages.BadBatch)
        assert bad3.batch_id == 3 and "99" in bad3.reason
        # and the producer still serves: the slot freed by the bad batch is reused
        co.lease(4, 1, [4, 5])
        ready4 = co.recv(messages.SlotReady)
        assert (ready4.batch_id, ready4.slot, ready4.num_tokens, ready4.seq) == (4, 1, 18, 2)
        co.ring.verify(1, 4, 3)

        hb = co.recv(messages.Heartbeat)
        assert (hb.role, hb.index, hb.generation, hb.pid) == ("producer", 0, 3, co.proc.pid)
        assert set(hb.stats) >= {"tokens_per_s", "batches", "bad_batches", "gpu_mem_bytes", "current_batch"}
        deadline = time.monotonic() + 5
        while not (hb.stats["batches"] == 2 and hb.stats["bad_batches"] == 2):
            assert time.monotonic() < deadline, f"heartbeat stats never caught up: {hb.stats}"
            hb = co.recv(messages.Heartbeat)
        assert hb.stats["current_batch"] == -1 and hb.stats["gpu_mem_bytes"] == 0 and hb.stats["tokens_per_s"] > 0

        assert not any(getattr(m, "batch_id", None) == 100 for m in co.seen), "a stale-generation lease was served"
        co.send(messages.Shutdown(reason="test done"))
        assert co.proc.wait(timeout=15) == 0
        log = co.log_text()
        assert "ignore_lease batch_id=100" in log and "bad_message" in log
        assert os.path.exists(os.path.join(ring.SHM_DIR, co.ring.name)), "the producer must not unlink the ring"
    finally:
        co.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("producer_cfg,needle", [
    (ProducerConfig(devices=["cuda:7"]), "cuda:7"),
    (ProducerConfig(devices=["cpu"], target_layer_ids=[1, 8]), "[8]"),
])
def test_startup_errors_are_reported_and_exit_nonzero(producer_cfg, needle):
    if torch.cuda.is_available() and torch.cuda.device_count() > 7 and "cuda" in needle:
        pytest.skip("this machine has cuda:7")
    co = FakeCoordinator(producer_cfg, generation=1)
    try:
        err = co.recv(messages.Error)
        assert not any(isinstance(m, messages.Hello) for m in co.seen), "Hello is only said once ready to serve"
        assert err.fatal and err.role == "producer" and needle in err.message, err.message
        assert co.proc.wait(timeout=15) == procs.EXIT_ERROR
    finally:
        co.close()


@pytest.mark.timeout(90)
def test_sigkill_while_writing_leaves_the_slot_unpublished():
    """SPECRING_SLOW_WRITE_S holds the slot WRITING; a producer killed then never publishes it."""
    co = FakeCoordinator(ProducerConfig(devices=["cpu"], target_layer_ids=LAYER_IDS), generation=1,
                         env={"SPECRING_SLOW_WRITE_S": "60"})
    try:
        co.recv(messages.Hello)
        co.lease(1, 1, [0, 2])
        deadline = time.monotonic() + WAIT_S
        while co.ring.header(1).state != ring.WRITING:
            assert time.monotonic() < deadline, "the slot never became WRITING"
            assert co.proc.poll() is None, co.log_text()
            time.sleep(0.05)
        procs.kill_group(co.proc)
        assert co.proc.wait(timeout=10) == -9
        h = co.ring.header(1)
        assert (h.state, h.batch_id, h.generation) == (ring.WRITING, 1, 1)
        while (got := channel.recv_from(co.sock, timeout_s=0.3)) is not None:
            assert not isinstance(got[1], messages.SlotReady), "a killed writer must not have published"
    finally:
        co.close()
