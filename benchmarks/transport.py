"""Transport benchmark: payload throughput producer → consumer through the ring and its peers.

``python benchmarks/transport.py [--quick]`` measures, in one run, for payloads of 1, 16 and 64 MiB:

* ``ring``: the producer process copies a source tensor into a free slot of a ``shared.transport.ring.Ring``
  (``shared.transport.layout.write_tensors``), publishes it and sends a ``SlotReady`` over ZeroMQ; the consumer (this
  process) verifies the slot header, copies the payload out into its own tensor (what a trainer does before
  releasing) and sends ``SlotReleased``. Credit-based: the producer only writes into released slots.
* ``zmq-ipc``: the producer sends the source buffer with ``copy=False`` over a PUSH/PULL pair on
  ``ipc://``; the consumer receives it with ``copy=False`` and wraps the frame as a tensor (no further
  copy: the frame is already the consumer's own memory). ``zmq-ipc+copy`` copies it into a tensor as the
  ring consumer does.
* ``mp-queue``: the producer allocates a fresh shared-memory tensor per item (directly in shared memory,
  ``UntypedStorage._new_shared``: what ``share_memory_()`` does minus its extra copy), copies the source
  into it and puts it on a ``torch.multiprocessing`` queue; the consumer gets it (the received tensor is
  the consumer's to keep). ``mp-queue+copy`` also copies it into a tensor. Fresh per item because that is
  what a producer must do when nothing tells it that the consumer is done with a tensor; giving it that
  signal (a pool of tensors and a return queue) is the ring's protocol rebuilt on torch's shared memory,
  printed as ``mp-queue-pool (ring protocol, not a peer)`` for reference.

Every transport gets the same pipeline depth (``--depth`` slots / high-water marks / queue size, default 4)
so producer and consumer overlap, the same source tensor, the same number of threads per process, and
the same destination tensor where a copy is made. Throughput is counted at the consumer over windows of
``items`` consecutive payloads after a warm-up: bytes / seconds (GB = 1e9 bytes), median of the windows.

The last lines are ``ring_vs_best_peer=<ratio>`` (64 MiB; the best of zmq-ipc, zmq-ipc+copy, mp-queue,
mp-queue+copy) and, where CUDA is available, ``registered_h2d_vs_pageable=<ratio>``: host→device copies
(``non_blocking`` + synchronize) from a ring slot registered with ``cudaHostRegister`` (``Ring.pin()``)
versus the same bytes in an ordinary pageable tensor, plus ``registered_h2d_gbps=<GB/s>``.

Without pyzmq the ring's control messages travel over a ``multiprocessing`` pipe and the zmq rows are
skipped (both are said in the output).
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

try:
    import zmq
except ImportError:  # the GPU image has no pyzmq unless it is carried
    zmq = None

from specring.shared.transport import layout, messages, ring  # noqa: E402

MiB = 1 << 20
PEERS = ("zmq-ipc", "zmq-ipc+copy", "mp-queue", "mp-queue+copy")
REFERENCE = ("mp-queue-pool",)
LABELS = {
    "ring": "ring (shm slot: copy in, SlotReady, copy out, SlotReleased)",
    "zmq-ipc": "zmq-ipc (PUSH/PULL ipc://, copy=False, frame as tensor)",
    "zmq-ipc+copy": "zmq-ipc+copy (same, + copy into a tensor)",
    "mp-queue": "mp-queue (torch.mp Queue, fresh shm tensor per item)",
    "mp-queue+copy": "mp-queue+copy (same, + copy into a tensor)",
    "mp-queue-pool": "mp-queue-pool (ring protocol on torch shm, not a peer)",
}
TIMEOUT_S = 60.0


# ---------------------------------------------------------------------------- control channel
class Channel:
    """Tiny control messages (``shared.transport.messages`` frames) between the two processes.

    A ZeroMQ DEALER pair on ``ipc://`` when pyzmq is there, else one end of a ``multiprocessing.Pipe``.
    """

    def __init__(self, endpoint, bind: bool):
        self.sock = self.conn = None
        if isinstance(endpoint, str):
            self.sock = zmq.Context.instance().socket(zmq.DEALER)
            self.sock.setsockopt(zmq.LINGER, 1000)
            (self.sock.bind if bind else self.sock.connect)(endpoint)
        else:
            self.conn = endpoint

    def send(self, msg) -> None:
        data = messages.encode(msg)
        self.sock.send(data) if self.sock is not None else self.conn.send_bytes(data)

    def poll(self, timeout_s: float) -> bool:
        return bool(self.sock.poll(int(timeout_s * 1000)) if self.sock is not None else self.conn.poll(timeout_s))

    def recv(self, timeout_s: float = TIMEOUT_S):
        if not self.poll(timeout_s):
            raise TimeoutError(f"no control message within {timeout_s:.0f} s")
        return messages.decode(self.sock.recv() if self.sock is not None else self.conn.recv_bytes())

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()


# ---------------------------------------------------------------------------- producers (child processes)
def _new_shared(nbytes: int) -> torch.Tensor:
    """A ``uint8`` tensor of ``nbytes`` allocated directly in shared memory (no copy into it yet)."""
    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)
    if new_shared is None:  # not in every torch: share_memory_() copies, which only slows this peer down
        return torch.empty(nbytes, dtype=torch.uint8).share_memory_()
    return torch.empty(0, dtype=torch.uint8).set_(new_shared(nbytes))


def _source(nbytes: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))


def produce_ring(ring_name: str, endpoint, nbytes: int, total: int, threads: int) -> None:
    """Write ``total`` payloads of ``nbytes`` into free slots (credit = SlotReleased), announce each."""
    torch.set_num_threads(threads)
    r = ring.Ring.attach(ring_name)
    ch = Channel(endpoint, bind=False)
    src = {"x": _source(nbytes)}
    free = collections.deque(range(r.num_slots))
    try:
        for i in range(total):
            while not free or ch.poll(0):
                free.append(ch.recv().slot)
            slot = free.popleft()
            buf = r.begin_write(slot, batch_id=i, generation=1, seq=i)
            desc, n = layout.write_tensors(buf, src)
            r.publish(slot, batch_id=i, generation=1, seq=i, payload_len=n)
            ch.send(messages.SlotReady(producer=0, generation=1, slot=slot, batch_id=i, seq=i, descriptor=desc,
                                       payload_bytes=n, num_tokens=0))
        while len(free) < r.num_slots:
            free.append(ch.recv().slot)
    finally:
        ch.close()
        r.close()


def produce_zmq(address: str, nbytes: int, total: int, depth: int, threads: int) -> None:
    """Send ``total`` frames of the source buffer with ``copy=False`` (HWM ``depth``)."""
    torch.set_num_threads(threads)
    zctx = zmq.Context()
    sock = zctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, depth)
    sock.setsockopt(zmq.LINGER, 10_000)
    sock.connect(address)
    src = _source(nbytes).numpy()
    try:
        for i in range(total):
            tracker = sock.send(src, copy=False, track=i == total - 1)
        # zmq reads ``src`` from its I/O thread after send() returns: keep it alive until the last frame is
        # out (exiting earlier lets the interpreter free it under zmq: EFAULT, abort).
        tracker.wait(TIMEOUT_S)
    finally:
        sock.close()
        zctx.term()


def produce_mpq(q, done, nbytes: int, total: int, threads: int) -> None:
    """Put ``total`` fresh shared-memory tensors holding the source bytes on ``q``; wait for ``done``.

    (The consumer fetches each tensor's file descriptor from this process's resource sharer, so this
    process must live until the consumer has them all.)
    """
    torch.set_num_threads(threads)
    src = _source(nbytes)
    for _ in range(total):
        t = _new_shared(nbytes)
        t.copy_(src)
        q.put(t)
        del t
    q.put(None)
    done.wait(TIMEOUT_S)


def produce_mpq_pool(q, free_q, nbytes: int, total: int, depth: int, threads: int) -> None:
    """Refill one of ``depth`` shared tensors that the consumer has handed back, put it on ``q``."""
    torch.set_num_threads(threads)
    src = _source(nbytes)
    pool = [_new_shared(nbytes) for _ in range(depth)]
    for i in range(depth):
        free_q.put(i)
    for _ in range(total):
        i = free_q.get(timeout=TIMEOUT_S)
        pool[i].copy_(src)
        q.put((i, pool[i]))
    q.put(None)
    for _ in range(depth):
        free_q.get(timeout=TIMEOUT_S)


# ---------------------------------------------------------------------------- consumers (this process)
def _windows(stamps: list[float], warmup: int, items: int, nbytes: int) -> list[float]:
    """GB/s over consecutive windows of ``items`` payloads after ``warmup`` (stamps: after each payload)."""
    out = []
    start = warmup - 1
    while start + items < len(stamps):
        out.append(items * nbytes / (stamps[start + items] - stamps[start]) / 1e9)
        start += items
    return out


def _join(proc: mp.Process) -> None:
    proc.join(TIMEOUT_S)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise RuntimeError(f"producer {proc.name} did not finish within {TIMEOUT_S:.0f} s")
    if proc.exitcode != 0:
        raise RuntimeError(f"producer {proc.name} exited {proc.exitcode}")


def consume_ring(ctx, nbytes: int, total: int, depth: int, threads: int, tmp: str) -> list[float]:
    name = ring.segment_name(ring.new_run_id(), "bench")
    r = ring.Ring.create(name, num_slots=depth, slot_bytes=layout.payload_bytes({"x": (torch.uint8, (nbytes,))}))
    if zmq is not None:
        endpoint = child_end = f"ipc://{tmp}/ring.sock"
    else:
        endpoint, child_end = ctx.Pipe()
    ch = Channel(endpoint, bind=True)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    proc = ctx.Process(target=produce_ring, args=(name, child_end, nbytes, total, threads), name="ring")
    stamps = []
    try:
        proc.start()
        for _ in range(total):
            msg = ch.recv()
            r.verify(msg.slot, msg.batch_id, msg.generation, check_crc=False)
            dst.copy_(layout.read_tensors(r.payload(msg.slot), msg.descriptor)["x"])
            ch.send(messages.SlotReleased(producer=0, generation=msg.generation, slot=msg.slot,
                                          batch_id=msg.batch_id))
            stamps.append(time.perf_counter())
        _join(proc)
    finally:
        if proc.is_alive():
            proc.kill()
        ch.close()
        r.close()
        r.unlink()
    return stamps


def consume_zmq(ctx, nbytes: int, total: int, depth: int, threads: int, tmp: str, copy: bool) -> list[float]:
    address = f"ipc://{tmp}/zmq.sock"
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, depth)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    proc = ctx.Process(target=produce_zmq, args=(address, nbytes, total, depth, threads), name="zmq")
    stamps = []
    try:
        proc.start()
        for _ in range(total):
            if not sock.poll(int(TIMEOUT_S * 1000)):
                raise TimeoutError(f"no zmq frame within {TIMEOUT_S:.0f} s")
            frame = sock.recv(copy=False)
            t = torch.frombuffer(frame.buffer, dtype=torch.uint8)  # the consumer's own memory, no copy
            assert t.numel() == nbytes
            if copy:
                dst.copy_(t)
            del t, frame
            stamps.append(time.perf_counter())
        _join(proc)
    finally:
        if proc.is_alive():
            proc.kill()
        sock.close()
    return stamps


def consume_mpq(ctx, nbytes: int, total: int, depth: int, threads: int, copy: bool) -> list[float]:
    q, done = ctx.Queue(maxsize=depth), ctx.Event()
    dst = torch.empty(nbytes, dtype=torch.uint8)
    proc = ctx.Process(target=produce_mpq, args=(q, done, nbytes, total, threads), name="mp-queue")
    stamps = []
    try:
        proc.start()
        for _ in range(total):
            t = q.get(timeout=TIMEOUT_S)
            assert t.numel() == nbytes
            if copy:
                dst.copy_(t)
            del t
            stamps.append(time.perf_counter())
        assert q.get(timeout=TIMEOUT_S) is None
        done.set()
        _join(proc)
    finally:
        if proc.is_alive():
            proc.kill()
    return stamps


def consume_mpq_pool(ctx, nbytes: int, total: int, depth: int, threads: int) -> list[float]:
    q, free_q = ctx.Queue(maxsize=depth), ctx.Queue()
    dst = torch.empty(nbytes, dtype=torch.uint8)
    proc = ctx.Process(target=produce_mpq_pool, args=(q, free_q, nbytes, total, depth, threads), name="mp-pool")
    stamps = []
    try:
        proc.start()
        for _ in range(total):
            i, t = q.get(timeout=TIMEOUT_S)
            dst.copy_(t)
            del t
            free_q.put(i)
            stamps.append(time.perf_counter())
        assert q.get(timeout=TIMEOUT_S) is None
        _join(proc)
    finally:
        if proc.is_alive():
            proc.kill()
    return stamps


def measure(transport: str, nbytes: int, args, ctx, tmp: str) -> list[float]:
    """GB/s of each window for ``transport`` at ``nbytes`` per payload."""
    items = max(args.min_items, args.window_mib * MiB // nbytes)
    warmup = max(2, 2 * args.depth)
    total = warmup + items * args.windows
    common = (ctx, nbytes, total, args.depth, args.threads)
    if transport == "ring":
        stamps = consume_ring(*common, tmp)
    elif transport.startswith("zmq-ipc"):
        stamps = consume_zmq(*common, tmp, copy=transport.endswith("+copy"))
    elif transport == "mp-queue-pool":
        stamps = consume_mpq_pool(*common)
    else:
        stamps = consume_mpq(*common, copy=transport.endswith("+copy"))
    return _windows(stamps, warmup, items, nbytes)


# ---------------------------------------------------------------------------- host → device
def _h2d_gbps(src: torch.Tensor, dst: torch.Tensor, iters: int) -> float:
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return src.numel() / statistics.median(times) / 1e9


def bench_h2d(sizes_mib: list[int], iters: int) -> dict[int, tuple[float, float, float]]:
    """Per size: (registered slot, pageable tensor, torch pin_memory tensor) host→device GB/s."""
    out = {}
    biggest = max(sizes_mib) * MiB
    r = ring.Ring.create(ring.segment_name(ring.new_run_id(), "h2d"), num_slots=1, slot_bytes=biggest)
    try:
        pinned = r.pin()
        if not pinned:
            raise RuntimeError("Ring.pin() did not register the slot although CUDA is available")
        slot = r.payload(0)
        slot.copy_(_source(biggest))
        pageable = slot.clone()  # the same bytes in ordinary (pageable) memory
        torch_pinned = slot.pin_memory()
        dst = torch.empty(biggest, dtype=torch.uint8, device="cuda")
        for mib in sizes_mib:
            n = mib * MiB
            out[mib] = (_h2d_gbps(slot[:n], dst[:n], iters), _h2d_gbps(pageable[:n], dst[:n], iters),
                        _h2d_gbps(torch_pinned[:n], dst[:n], iters))
        torch.cuda.synchronize()
        assert torch.equal(dst.cpu(), pageable), "host-to-device copy from the registered slot is wrong"
        del slot, dst
    finally:
        r.close()
        r.unlink()
    return out


# ---------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="ring vs ZeroMQ vs torch.multiprocessing payload throughput")
    p.add_argument("--quick", action="store_true", help="fewer and shorter windows (a smoke run)")
    p.add_argument("--sizes-mib", default="1,16,64", help="payload sizes in MiB (comma separated)")
    p.add_argument("--depth", type=int, default=4, help="pipeline depth: ring slots / HWM / queue size")
    p.add_argument("--threads", type=int, default=1, help="torch threads in each process (copy_ uses them)")
    p.add_argument("--windows", type=int, default=5, help="measurement windows per transport and size")
    p.add_argument("--window-mib", type=int, default=512, help="payload MiB per window")
    p.add_argument("--min-items", type=int, default=8, help="payloads per window at least")
    p.add_argument("--transports", default="ring," + ",".join(PEERS) + "," + ",".join(REFERENCE))
    p.add_argument("--no-cuda", action="store_true", help="skip the host-to-device section")
    args = p.parse_args(argv)
    if args.quick:
        args.windows, args.window_mib, args.min_items = 3, 256, 4
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    transports = [t for t in args.transports.split(",") if t]
    if zmq is None:
        skipped = [t for t in transports if t.startswith("zmq")]
        transports = [t for t in transports if not t.startswith("zmq")]
        print(f"note: pyzmq is not installed: skipping {skipped}; the ring's control messages use a "
              f"multiprocessing pipe")
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    torch.set_num_threads(args.threads)
    ctx = mp.get_context("spawn")
    swept = ring.sweep_stale()
    if swept:
        print(f"note: swept stale segments {swept}")

    print(f"# transport benchmark: python {platform.python_version()}, torch {torch.__version__}, "
          f"pyzmq {zmq.__version__ if zmq else 'absent'}, {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}, threads/process {args.threads}, depth {args.depth}, "
          f"{args.windows} windows of >= {args.window_mib} MiB per cell")
    results: dict[str, dict[int, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="srb-") as tmp:
        for t in transports:
            results[t] = {}
            for mib in sizes:
                results[t][mib] = measure(t, mib * MiB, args, ctx, tmp)
                print(f"  measured {t:<14} {mib:>4} MiB: " + " ".join(f"{g:.2f}" for g in results[t][mib]),
                      flush=True)

    width = max(len(LABELS[t]) for t in transports)
    print(f"\n{'payload throughput, GB/s (median of windows; min-max)':<{width}}  "
          + "".join(f"{f'{mib} MiB':>18}" for mib in sizes))
    for t in transports:
        cells = "".join(f"{f'{statistics.median(g):.2f} ({min(g):.1f}-{max(g):.1f})':>18}"
                        for g in (results[t][mib] for mib in sizes))
        print(f"{LABELS[t]:<{width}}  {cells}")

    ratio_mib = 64 if 64 in sizes else max(sizes)
    peers = [t for t in transports if t in PEERS]
    if "ring" in transports and peers:
        best = max(peers, key=lambda t: statistics.median(results[t][ratio_mib]))
        ring_gbps = statistics.median(results["ring"][ratio_mib])
        best_gbps = statistics.median(results[best][ratio_mib])
        print(f"\nat {ratio_mib} MiB: ring {ring_gbps:.2f} GB/s, best peer {best} {best_gbps:.2f} GB/s")
        print(f"ring_vs_best_peer={ring_gbps / best_gbps:.2f}")

    if torch.cuda.is_available() and not args.no_cuda:
        h2d_sizes = sorted(set(sizes) | {256})
        h2d = bench_h2d(h2d_sizes, iters=10 if args.quick else 30)
        print(f"\nhost -> device on {torch.cuda.get_device_name()}, GB/s (median of copies, non_blocking + sync)")
        print(f"{'size':>8} {'registered slot':>16} {'pageable tensor':>16} {'torch pin_memory':>17}")
        for mib in h2d_sizes:
            reg, page, pin = h2d[mib]
            print(f"{mib:>5} MiB {reg:>16.1f} {page:>16.1f} {pin:>17.1f}")
        reg, page, _ = h2d[ratio_mib]
        print(f"registered_h2d_gbps={reg:.1f} (at {ratio_mib} MiB)")
        print(f"registered_h2d_vs_pageable={reg / page:.2f}")
    elif not args.no_cuda:
        print("\nhost -> device: skipped (CUDA is not available)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
