"""Child processes for tests/system/test_ring_processes.py.

Run as ``python ring_worker.py <role> [options]`` (subprocess) or import a role function as the target of
a ``multiprocessing`` 'spawn' process. Every role attaches to (or creates) a real ring in /dev/shm and
talks to its peer over a real ZeroMQ DEALER socket (``ipc://``) with ``shared.transport.messages`` frames.

Roles:

* ``echo``: receive ``SlotReady`` for a slot, verify it (header and CRC), read the named tensors, write
  them into another slot, publish with a checksum, answer ``SlotReleased`` + ``SlotReady``.
* ``hang-writer``: publish slot 0, then begin writing slot 1, say ``Hello`` and keep writing it slowly
  until killed (the test SIGKILLs it mid-write).
* ``attach``: attach, write a marker byte into a slot, close, exit (optionally wait to be killed).
* ``creator``: create a ring of its own, say ``Hello``, wait to be killed.
* ``producer`` / ``consumer``: the stress test pair (see ``run_producer`` / ``run_consumer``).

Exit status 0 means every check passed; failures print one ``FAIL ...`` line to stderr and exit 1.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import zmq  # noqa: E402

from specring.shared.errors import SlotError  # noqa: E402
from specring.shared.transport import layout, messages  # noqa: E402
from specring.shared.transport.ring import Ring, payload_crc32, segment_name  # noqa: E402

RECV_TIMEOUT_S = 20.0


class CheckFailed(Exception):
    """A check in a worker failed; the message says which and with which values."""


def connect(address: str, bind: bool = False) -> zmq.Socket:
    """A DEALER socket connected (or bound) to ``address``; linger 2 s so a last message is still delivered."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 2000)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


def send(sock: zmq.Socket, msg) -> None:
    sock.send(messages.encode(msg))


def recv(sock: zmq.Socket, timeout_s: float = RECV_TIMEOUT_S, what: str = "a message"):
    """Next decoded message; raises ``CheckFailed`` naming ``what`` after ``timeout_s``."""
    if not sock.poll(int(timeout_s * 1000)):
        raise CheckFailed(f"no {what} within {timeout_s:.0f} s")
    return messages.decode(sock.recv())


def hello(sock: zmq.Socket, role: str, index: int = 0) -> None:
    send(sock, messages.Hello(role=role, index=index, generation=0, pid=os.getpid()))


def check(cond: bool, text: str) -> None:
    if not cond:
        raise CheckFailed(text)


# ---------------------------------------------------------------------------- payloads
SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 0, 4), (2, 3, 4, 5), (1, 2, 1, 3, 1, 2), (64, 129)]


def sample_tensor(dtype: torch.dtype, shape: tuple, seed: int) -> torch.Tensor:
    """A seeded tensor of ``dtype``/``shape`` with non-trivial values."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 100).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(2**62)), min(info.max, 2**62)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


def sample_tensors(seed: int) -> dict[str, torch.Tensor]:
    """Every dtype ``shared.transport.layout`` supports (bfloat16 included) in every shape of ``SHAPES``."""
    return {f"{name}{list(shape)}": sample_tensor(dtype, shape, seed * 7919 + 100 * i + j)
            for j, (name, dtype) in enumerate(layout.DTYPES.items())
            for i, shape in enumerate(SHAPES)}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality of dtype, shape and bytes (NaN-safe; works for every dtype)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return a.numel() == 0 or torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                                         b.contiguous().reshape(-1).view(torch.uint8))


# ---------------------------------------------------------------------------- simple roles
def run_echo(ring_name: str, address: str, seed: int) -> None:
    """Check the slot named by the next ``SlotReady`` (header, CRC, every tensor against
    ``sample_tensors(seed)``), copy its tensors into ``slot + 1``, publish that with a checksum, and answer
    ``SlotReleased`` + ``SlotReady``."""
    ring = Ring.attach(ring_name)
    sock = connect(address)
    try:
        hello(sock, "echo")
        msg = recv(sock, what="SlotReady")
        check(isinstance(msg, messages.SlotReady), f"expected SlotReady, got {msg!r}")
        h = ring.verify(msg.slot, msg.batch_id, msg.generation)  # header + CRC
        check(h.checksum == msg.checksum and h.seq == msg.seq and h.payload_len == msg.payload_bytes,
              f"header {h} disagrees with message {msg}")
        crc = payload_crc32(ring.payload(msg.slot)[:msg.payload_bytes])
        check(crc == msg.checksum, f"recomputed crc {crc:#x} != message {msg.checksum:#x}")
        tensors = layout.read_tensors(ring.payload(msg.slot), msg.descriptor)
        want = sample_tensors(seed)
        check(list(tensors) == list(want), f"names {list(tensors)} != {list(want)}")
        for name, t in want.items():
            check(same_bits(tensors[name], t), f"tensor {name} differs after crossing to this process")
        out_slot = msg.slot + 1
        buf = ring.begin_write(out_slot, batch_id=msg.batch_id + 1, generation=msg.generation, seq=msg.seq + 1)
        desc, n = layout.write_tensors(buf, tensors)
        crc = ring.publish(out_slot, batch_id=msg.batch_id + 1, generation=msg.generation, seq=msg.seq + 1,
                           payload_len=n, checksum=True)
        del tensors
        send(sock, messages.SlotReleased(producer=msg.producer, generation=msg.generation, slot=msg.slot,
                                         batch_id=msg.batch_id))
        send(sock, messages.SlotReady(producer=msg.producer, generation=msg.generation, slot=out_slot,
                                      batch_id=msg.batch_id + 1, seq=msg.seq + 1, descriptor=desc, payload_bytes=n,
                                      num_tokens=msg.num_tokens, checksum=crc))
        msg = recv(sock, what="Shutdown")
        check(isinstance(msg, messages.Shutdown), f"expected Shutdown, got {msg!r}")
    finally:
        sock.close()
        ring.close()


def run_hang_writer(ring_name: str, address: str) -> None:
    """Publish slot 0 (batch 10), then write slot 1 (batch 11) slowly, forever; say Hello once mid-write."""
    ring = Ring.attach(ring_name)
    sock = connect(address)
    gen = torch.Generator().manual_seed(1)
    buf = ring.begin_write(0, batch_id=10, generation=1, seq=0)
    buf.copy_(torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8, generator=gen))
    ring.publish(0, batch_id=10, generation=1, seq=0, payload_len=buf.numel(), checksum=True)
    buf = ring.begin_write(1, batch_id=11, generation=1, seq=1)
    chunk = 4096
    buf[:buf.numel() // 2].fill_(0x5A)
    hello(sock, "hang-writer")
    pos = buf.numel() // 2
    while True:  # "writing slowly" until SIGKILL
        buf[pos:pos + chunk].fill_(0x5A)
        pos = (pos + chunk) % buf.numel()
        time.sleep(0.001)


def run_attach(ring_name: str, address: str, slot: int, marker: int, wait: bool = False) -> None:
    """Attach, write ``marker`` into byte 0 of ``slot``, say Hello; close and exit (or wait to be killed)."""
    ring = Ring.attach(ring_name)
    ring.payload(slot)[0] = marker
    sock = connect(address)
    hello(sock, "attach", index=slot)
    if wait:
        while True:
            time.sleep(1)
    sock.close()
    ring.close()


def run_creator(run_id: str, tag: str, address: str) -> None:
    """Create ring ``segment_name(run_id, tag)`` (it holds the owner lock), say Hello, then wait to be killed."""
    ring = Ring.create(segment_name(run_id, tag), num_slots=1, slot_bytes=4096)
    sock = connect(address)
    hello(sock, "creator")
    try:
        while True:
            time.sleep(1)
    finally:  # only reached on a clean stop; the test kills with SIGKILL on purpose
        ring.close()
        ring.unlink()


# ---------------------------------------------------------------------------- stress pair
def stress_payload(seed: int, seq: int, max_bytes: int) -> dict[str, torch.Tensor]:
    """The payload of publication ``seq``: a random-length uint8 blob plus the seq itself (both seeded)."""
    rng = random.Random(seed * 1_000_003 + seq)
    n = rng.randint(1, max_bytes)
    g = torch.Generator().manual_seed(seed * 1_000_003 + seq)
    return {"seq": torch.tensor([seq], dtype=torch.int64),
            "data": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)}


PHASE_ITEMS = 100  # the slower side alternates every PHASE_ITEMS payloads


def _sleep(rng: random.Random, max_sleep_s: float, seq: int, slow_phase: int) -> None:
    """Sleep uniform(0, max) (x4 in this side's slow phases) seconds.

    Alternating which side is slower makes the ring run both nearly empty (the consumer waits for
    SlotReady) and full (the producer waits for SlotReleased and reuses a slot the moment it is released,
    which is when an early release would show up as a corrupted copy).
    """
    if max_sleep_s > 0:
        scale = 4.0 if (seq // PHASE_ITEMS) % 2 == slow_phase else 1.0
        time.sleep(rng.uniform(0, max_sleep_s * scale))


def run_producer(ring_name: str, address: str, count: int, seed: int, max_sleep_s: float) -> dict:
    """Publish ``count`` payloads through the ring, one free slot at a time (credit = released slots)."""
    ring = Ring.attach(ring_name)
    sock = connect(address, bind=True)
    rng = random.Random(seed)
    max_bytes = ring.slot_bytes - 2 * layout.ALIGN
    free = collections.deque(range(ring.num_slots))
    in_slot: dict[int, int] = {}
    reuses = full_waits = 0

    def take_release(timeout_s: float) -> None:
        msg = recv(sock, timeout_s, what="SlotReleased from the consumer")
        check(isinstance(msg, messages.SlotReleased), f"producer expected SlotReleased, got {msg!r}")
        check(in_slot.get(msg.slot) == msg.batch_id,
              f"release of slot {msg.slot} batch {msg.batch_id}, but the slot holds batch {in_slot.get(msg.slot)}")
        del in_slot[msg.slot]
        free.append(msg.slot)

    try:
        for seq in range(count):
            while sock.poll(0):
                take_release(0)
            if not free:  # ring full: wait for credit
                full_waits += 1
                take_release(RECV_TIMEOUT_S)
            slot = free.popleft()
            reuses += seq >= ring.num_slots
            tensors = stress_payload(seed, seq, max_bytes)
            _sleep(rng, max_sleep_s, seq, slow_phase=0)
            buf = ring.begin_write(slot, batch_id=seq, generation=1, seq=seq)
            desc, n = layout.write_tensors(buf, tensors)
            _sleep(rng, max_sleep_s / 4, seq, slow_phase=0)  # a slow writer: the consumer must not see this slot yet
            crc = ring.publish(slot, batch_id=seq, generation=1, seq=seq, payload_len=n, checksum=True)
            in_slot[slot] = seq
            send(sock, messages.SlotReady(producer=0, generation=1, slot=slot, batch_id=seq, seq=seq,
                                          descriptor=desc, payload_bytes=n, num_tokens=int(tensors["data"].numel()),
                                          checksum=crc))
        while in_slot:
            take_release(RECV_TIMEOUT_S)
        send(sock, messages.Shutdown(reason="done"))
        return {"role": "producer", "published": count, "slot_reuses": reuses, "full_waits": full_waits}
    finally:
        sock.close()
        ring.close()


def run_consumer(ring_name: str, address: str, count: int, seed: int, max_sleep_s: float) -> dict:
    """Receive payloads in order, check header, CRC, seq and content, copy out, release."""
    ring = Ring.attach(ring_name)
    sock = connect(address)
    rng = random.Random(seed + 1)
    max_bytes = ring.slot_bytes - 2 * layout.ALIGN
    expected_seq = 0
    total_bytes = 0
    try:
        while True:
            msg = recv(sock, what=f"SlotReady seq {expected_seq} from the producer")
            if isinstance(msg, messages.Shutdown):
                break
            check(isinstance(msg, messages.SlotReady), f"consumer expected SlotReady, got {msg!r}")
            check(msg.seq == expected_seq, f"seq {msg.seq} arrived, expected {expected_seq}")
            try:
                h = ring.verify(msg.slot, msg.batch_id, msg.generation)  # PUBLISHED, batch, gen, CRC
            except SlotError as e:
                raise CheckFailed(f"seq {msg.seq}: {e}") from None
            check(h.seq == msg.seq and h.checksum == msg.checksum and h.payload_len == msg.payload_bytes,
                  f"seq {msg.seq}: header {h} disagrees with message {msg}")
            views = layout.read_tensors(ring.payload(msg.slot), msg.descriptor)
            copied = {k: v.clone() for k, v in views.items()}  # what a trainer does before releasing
            del views
            _sleep(rng, max_sleep_s, msg.seq, slow_phase=1)
            h2 = ring.header(msg.slot)
            check(h2 == h, f"seq {msg.seq}: slot {msg.slot} changed while being read: {h} -> {h2}")
            want = stress_payload(seed, msg.seq, max_bytes)
            check(int(copied["seq"][0]) == msg.seq, f"seq {msg.seq}: payload carries seq {int(copied['seq'][0])}")
            check(torch.equal(copied["data"], want["data"]),
                  f"seq {msg.seq}: payload of {copied['data'].numel()} bytes differs from what was written "
                  f"({want['data'].numel()} bytes)")
            total_bytes += msg.payload_bytes
            send(sock, messages.SlotReleased(producer=msg.producer, generation=msg.generation, slot=msg.slot,
                                             batch_id=msg.batch_id))
            expected_seq += 1
        check(expected_seq == count, f"received {expected_seq} payloads, expected {count}")
        return {"role": "consumer", "received": expected_seq, "payload_bytes": total_bytes}
    finally:
        sock.close()
        ring.close()


# ---------------------------------------------------------------------------- entry point
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("role", choices=["echo", "hang-writer", "attach", "creator", "producer", "consumer"])
    p.add_argument("--ring", default="")
    p.add_argument("--address", required=True)
    p.add_argument("--slot", type=int, default=0)
    p.add_argument("--marker", type=int, default=1)
    p.add_argument("--wait", action="store_true")
    p.add_argument("--run-id", default="")
    p.add_argument("--tag", default="c")
    p.add_argument("--count", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-sleep-s", type=float, default=300e-6)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    try:
        if a.role == "echo":
            run_echo(a.ring, a.address, a.seed)
        elif a.role == "hang-writer":
            run_hang_writer(a.ring, a.address)
        elif a.role == "attach":
            run_attach(a.ring, a.address, a.slot, a.marker, a.wait)
        elif a.role == "creator":
            run_creator(a.run_id, a.tag, a.address)
        else:
            fn = run_producer if a.role == "producer" else run_consumer
            print(json.dumps(fn(a.ring, a.address, a.count, a.seed, a.max_sleep_s)), flush=True)
    except (CheckFailed, SlotError, messages.MessageError) as e:
        print(f"FAIL {a.role}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
