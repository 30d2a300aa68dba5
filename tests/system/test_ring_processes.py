"""System tests of the shared-memory transport: real processes, real /dev/shm segments, real ZeroMQ sockets.

The children are tests/system/ring_worker.py, started with ``subprocess`` (a fresh interpreter) or with
``multiprocessing`` 'spawn' (which also starts a resource tracker: the case that unlinks segments behind
one's back when ``SharedMemory`` is used to attach). Control messages are ``shared.transport.messages`` frames over
DEALER sockets on ``ipc://`` files in a temporary directory.

Every test has a timeout, kills its children and removes its segments in ``finally``, and fails if a
segment of its run is left in /dev/shm.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import zmq

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import ring_worker  # noqa: E402

from specring.shared.transport import layout, messages, ring  # noqa: E402
from specring.shared.transport.ring import PUBLISHED, WRITING, Ring  # noqa: E402
from tests.support import REPO  # noqa: E402
from tests.system.launcher_util import PID_NAMESPACE, pid_namespace_problem  # noqa: E402

ROOT = str(REPO)

WORKER = os.path.join(HERE, "ring_worker.py")
WAIT_S = 30.0  # the longest any single wait for a child may take (child start-up imports torch)


# ---------------------------------------------------------------------------- helpers
class Harness:
    """Children, sockets and segments of one test, all torn down by ``close()``."""

    def __init__(self):
        self.run_id = ring.new_run_id()
        self.dir = tempfile.mkdtemp(prefix="srt-")  # short: ipc paths are limited to ~100 bytes
        self.procs: list = []
        self.socks: list[zmq.Socket] = []
        self.rings: list[Ring] = []

    def address(self, name: str = "ctl") -> str:
        return f"ipc://{self.dir}/{name}.sock"

    def bind(self, name: str = "ctl") -> tuple[zmq.Socket, str]:
        addr = self.address(name)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(addr)
        self.socks.append(sock)
        return sock, addr

    def ring(self, tag: str, num_slots: int, slot_bytes: int) -> Ring:
        r = Ring.create(ring.segment_name(self.run_id, tag), num_slots=num_slots, slot_bytes=slot_bytes)
        self.rings.append(r)
        return r

    def spawn(self, role: str, *args: str, prefix: list[str] = ()) -> subprocess.Popen:
        """Start ``ring_worker.py role args`` (behind ``prefix``, e.g. ``unshare ...``, when given)."""
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        p = subprocess.Popen([*prefix, sys.executable, WORKER, role, *args], env=env, cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(p)
        return p

    def spawn_mp(self, target, *args) -> multiprocessing.Process:
        p = multiprocessing.get_context("spawn").Process(target=target, args=args, daemon=True)
        p.start()
        self.procs.append(p)
        return p

    def segments(self) -> list[str]:
        return [n for n in ring.list_segments() if n.startswith(f"{ring.NAME_PREFIX}{self.run_id}-")]

    def close(self) -> list[str]:
        """Kill every child still alive, close sockets, unlink rings; return segments that were left."""
        for p in self.procs:
            pid = p.pid
            alive = p.poll() is None if isinstance(p, subprocess.Popen) else p.is_alive()
            if alive and pid:
                os.kill(pid, signal.SIGKILL)
            if isinstance(p, subprocess.Popen):
                p.wait(timeout=10)
                p.stdout.close()
                p.stderr.close()
            else:
                p.join(timeout=10)
        for s in self.socks:
            s.close(0)
        for r in self.rings:
            r.close()
            r.unlink()
        left = self.segments()
        for name in left:
            os.unlink(os.path.join(ring.SHM_DIR, name))
        shutil.rmtree(self.dir, ignore_errors=True)
        return left


@pytest.fixture
def h():
    harness = Harness()
    try:
        yield harness
    finally:
        left = harness.close()
    assert not left, f"segments left in /dev/shm: {left}"


def expect(sock: zmq.Socket, cls, what: str, timeout_s: float = WAIT_S, proc=None):
    """The next message, which must be a ``cls``; on timeout, say what was awaited and the child's stderr."""
    if not sock.poll(int(timeout_s * 1000)):
        detail = ""
        if isinstance(proc, subprocess.Popen) and proc.poll() is not None:
            detail = f"; child exited {proc.returncode}: {proc.stderr.read()[-2000:]}"
        pytest.fail(f"no {what} within {timeout_s:.0f} s{detail}")
    msg = messages.decode(sock.recv())
    assert isinstance(msg, cls), f"expected {cls.__name__} ({what}), got {msg!r}"
    return msg


def finish(proc: subprocess.Popen, timeout_s: float = WAIT_S) -> tuple[str, str]:
    """Wait for a child; assert it exited 0; return (stdout, stderr)."""
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, f"child exited {proc.returncode}:\n{err[-3000:]}"
    return out, err


def finish_all(procs: dict[str, subprocess.Popen], timeout_s: float) -> dict[str, str]:
    """Wait for every child; fail at once (with its stderr) when any exits non-zero. Returns stdouts."""
    deadline = time.monotonic() + timeout_s
    pending = dict(procs)
    while pending:
        for role, p in list(pending.items()):
            if p.poll() is not None:
                if p.returncode != 0:
                    pytest.fail(f"{role} exited {p.returncode}:\n{p.stderr.read()[-3000:]}")
                del pending[role]
        if time.monotonic() > deadline:
            pytest.fail(f"{sorted(pending)} still running after {timeout_s:.0f} s")
        time.sleep(0.05)
    return {role: p.stdout.read() for role, p in procs.items()}


def kill_and_reap(pid: int, proc) -> None:
    os.kill(pid, signal.SIGKILL)
    if isinstance(proc, subprocess.Popen):
        assert proc.wait(timeout=10) == -signal.SIGKILL
    else:
        proc.join(timeout=10)
        assert proc.exitcode == -signal.SIGKILL


# ---------------------------------------------------------------------------- tests
@pytest.mark.timeout(90)
def test_every_dtype_and_shape_round_trips_through_a_spawned_process(h):
    seed = 5
    tensors = ring_worker.sample_tensors(seed)
    _, need = layout.plan_layout(tensors)
    r = h.ring("p0", num_slots=2, slot_bytes=need)
    sock, addr = h.bind()
    child = h.spawn("echo", "--ring", r.name, "--address", addr, "--seed", str(seed))
    expect(sock, messages.Hello, "Hello from the echo child", proc=child)

    buf = r.begin_write(0, batch_id=40, generation=2, seq=7)
    desc, n = layout.write_tensors(buf, tensors)
    crc = r.publish(0, batch_id=40, generation=2, seq=7, payload_len=n, checksum=True)
    sock.send(messages.encode(messages.SlotReady(producer=0, generation=2, slot=0, batch_id=40, seq=7,
                                                 descriptor=desc, payload_bytes=n, num_tokens=0, checksum=crc)))
    released = expect(sock, messages.SlotReleased, "SlotReleased for slot 0", proc=child)
    assert (released.slot, released.batch_id, released.generation) == (0, 40, 2)
    ready = expect(sock, messages.SlotReady, "SlotReady for slot 1", proc=child)
    assert (ready.slot, ready.batch_id, ready.seq, ready.payload_bytes) == (1, 41, 8, n)

    header = r.verify(1, batch_id=41, generation=2)  # PUBLISHED by the child, CRC recomputed here
    assert header.checksum == ready.checksum == crc, "the echoed payload's CRC differs from the original's"
    assert header.flags & ring.FLAG_CHECKSUM
    back = layout.read_tensors(r.payload(1), ready.descriptor)
    assert list(back) == list(tensors)
    assert {t.dtype for t in back.values()} == set(layout.DTYPES.values())
    for name, t in tensors.items():
        assert ring_worker.same_bits(back[name], t), f"{name} changed on its way through the child"
    del back
    sock.send(messages.encode(messages.Shutdown(reason="test done")))
    finish(child)


@pytest.mark.timeout(90)
def test_writer_killed_mid_write_leaves_an_unpublished_slot_and_no_segment(h):
    r = h.ring("p0", num_slots=2, slot_bytes=1 << 20)
    sock, addr = h.bind()
    child = h.spawn("hang-writer", "--ring", r.name, "--address", addr)
    expect(sock, messages.Hello, "Hello from the writer (sent mid-write)", proc=child)
    assert r.header(1).state == WRITING
    kill_and_reap(child.pid, child)

    assert os.path.exists(os.path.join(ring.SHM_DIR, r.name)), "the writer's death removed the segment"
    survivor = Ring.attach(r.name)  # the segment is intact and attachable after the writer's death
    survivor.close()
    hdr = r.header(1)
    assert hdr.state == WRITING and hdr.state != PUBLISHED and (hdr.batch_id, hdr.generation) == (11, 1)
    with pytest.raises(ring.SlotError, match="WRITING, not PUBLISHED"):
        r.verify(1, batch_id=11, generation=1)
    # What the dead writer had published before dying is still complete and verifiable.
    done = r.verify(0, batch_id=10, generation=1)
    assert done.state == PUBLISHED and done.payload_len == r.slot_bytes

    r.close()
    r.unlink()
    assert h.segments() == [], f"segments of the run left after the creator closed: {h.segments()}"


def _check_marker(r: Ring, slot: int, marker: int) -> None:
    assert r.payload(slot)[0].item() == marker, f"the child's write to slot {slot} is not visible"


@pytest.mark.timeout(120)
def test_processes_that_only_attach_and_exit_do_not_unlink(h):
    r = h.ring("p0", num_slots=3, slot_bytes=4096)
    path = os.path.join(ring.SHM_DIR, r.name)
    sock, addr = h.bind()

    child = h.spawn("attach", "--ring", r.name, "--address", addr, "--slot", "0", "--marker", "11")
    expect(sock, messages.Hello, "Hello from the attaching subprocess", proc=child)
    finish(child)
    assert os.path.exists(path), "a subprocess that attached and exited unlinked the segment"
    _check_marker(r, 0, 11)

    # multiprocessing 'spawn' starts a resource tracker: it must not unlink the segment either.
    child = h.spawn_mp(ring_worker.run_attach, r.name, addr, 1, 22)
    expect(sock, messages.Hello, "Hello from the multiprocessing child")
    child.join(timeout=WAIT_S)
    assert child.exitcode == 0
    time.sleep(0.5)  # a resource tracker cleans up right after its last client exits
    assert os.path.exists(path), "a multiprocessing child that attached and exited unlinked the segment"
    _check_marker(r, 1, 22)

    child = h.spawn_mp(ring_worker.run_attach, r.name, addr, 2, 33, True)
    expect(sock, messages.Hello, "Hello from the multiprocessing child that will be killed")
    kill_and_reap(child.pid, child)
    time.sleep(0.5)
    assert os.path.exists(path), "a child killed after attaching unlinked the segment"
    _check_marker(r, 2, 33)
    again = Ring.attach(r.name)
    again.close()


@pytest.mark.timeout(90)
def test_sweep_stale_removes_a_dead_creators_segment_and_keeps_a_live_one(h):
    sock, addr = h.bind()
    dead = h.spawn("creator", "--run-id", h.run_id, "--tag", "dead", "--address", addr)
    live = h.spawn("creator", "--run-id", h.run_id, "--tag", "live", "--address", addr)
    for p in (dead, live):
        expect(sock, messages.Hello, "Hello from a creator", proc=p)
    dead_name = ring.segment_name(h.run_id, "dead")
    live_name = ring.segment_name(h.run_id, "live")
    mine = h.ring("mine", num_slots=1, slot_bytes=4096)
    assert {dead_name, live_name, mine.name} <= set(h.segments())

    kill_and_reap(dead.pid, dead)
    assert dead_name in h.segments(), "SIGKILL cannot run cleanup: the segment must still be there"
    assert ring.sweep_stale(h.run_id) == [dead_name]
    assert set(h.segments()) == {live_name, mine.name}
    assert ring.sweep_stale() is not None and live_name in h.segments() and mine.name in h.segments(), \
        "a sweep of every run touched a live creator's segment"

    kill_and_reap(live.pid, live)
    assert ring.sweep_stale(h.run_id) == [live_name]
    assert h.segments() == [mine.name]


@pytest.mark.timeout(90)
def test_sweeps_in_other_pid_namespaces_keep_live_segments(h):
    """A creator that is pid 1 of its own PID namespace (a container sharing /dev/shm) and this process
    sweep each other's segments only once their owner is dead: the owner's lock decides, not a pid."""
    problem = pid_namespace_problem()
    if problem:
        pytest.skip(problem)
    sock, addr = h.bind()
    creator = h.spawn("creator", "--run-id", h.run_id, "--tag", "ns", "--address", addr, prefix=PID_NAMESPACE)
    expect(sock, messages.Hello, "Hello from the creator in its own PID namespace", proc=creator)
    ns_name = ring.segment_name(h.run_id, "ns")
    mine = h.ring("mine", num_slots=1, slot_bytes=4096)
    assert ring.sweep_stale() is not None and ns_name in h.segments(), \
        "a sweep here removed the live segment of a creator in another PID namespace"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = f"from specring.shared.transport import ring; print(ring.sweep_stale({h.run_id!r}))"
    out = subprocess.run([*PID_NAMESPACE, sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=WAIT_S)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]" and set(h.segments()) == {ns_name, mine.name}, \
        f"a sweep in another PID namespace removed live segments: {out.stdout}"
    kill_and_reap(creator.pid, creator)  # --kill-child: the namespace's pid 1 dies with it
    wait_for_gone = time.monotonic() + 10
    while ring.segment_owned(ns_name) and time.monotonic() < wait_for_gone:
        time.sleep(0.05)
    assert ring.sweep_stale(h.run_id) == [ns_name]
    assert h.segments() == [mine.name]


@pytest.mark.timeout(120)
def test_stress_producer_consumer_through_a_small_ring(h):
    seed = int(os.environ.get("SPECRING_STRESS_SEED", random.randrange(1 << 30)))
    count, num_slots = 2000, 4
    print(f"stress seed={seed} (rerun with SPECRING_STRESS_SEED={seed})")
    r = h.ring("p0", num_slots=num_slots, slot_bytes=64 * 1024)
    addr = h.address("stress")
    common = ["--ring", r.name, "--address", addr, "--count", str(count), "--seed", str(seed),
              "--max-sleep-s", "300e-6"]
    t0 = time.monotonic()
    producer = h.spawn("producer", *common)
    consumer = h.spawn("consumer", *common)
    outs = finish_all({"producer": producer, "consumer": consumer}, timeout_s=90)
    elapsed_s = time.monotonic() - t0
    p_sum, c_sum = (json.loads(outs[role].strip().splitlines()[-1]) for role in ("producer", "consumer"))
    print(f"stress seed={seed} {p_sum} {c_sum} elapsed_s={elapsed_s:.1f}")
    assert p_sum["published"] == count and c_sum["received"] == count, f"seed={seed}"
    assert p_sum["slot_reuses"] == count - num_slots  # every slot reused ~500 times
    assert p_sum["full_waits"] > 100, f"seed={seed}: the ring was rarely full; slot reuse right after release untested"
    assert c_sum["payload_bytes"] > count * 16 * 1024, f"seed={seed}: payloads were not of random, large size"
