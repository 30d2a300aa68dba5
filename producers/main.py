"""The producer process: ``python -m producers.main --run-dir R --index I --generation G``.

One process per target replica, started by the supervisor (``shared.process.procs.spawn_child``). It attaches to
ring ``topology.rings[I]`` (pinning it where CUDA is used), opens the dataset ``config.data.data``, loads
the target on ``config.producer.devices[I]`` (a device, or a device group ``cuda:0+cuda:1`` the target is split
over), says ``Hello`` (``ctx.ready()``: only now can it take work;
a start-up failure is a fatal ``Error`` naming the problem instead) and then serves the coordinator over
its DEALER socket:

* ``Lease`` for this generation: collate the samples (right padding to ``pad_to`` with the dataset's pad
  id, else the target config's ``pad_token_id``, else 0), run the batch through ``Producer`` and answer
  ``SlotReady`` or ``BadBatch``. A lease that cannot be served (sample id out of range, a sample longer than
  ``pad_to``, a slot out of range) is answered with ``BadBatch`` naming the problem. One batch may stay in
  flight: when the next lease is already waiting, it is submitted before the previous batch's copy is
  awaited, so the device-to-host copy overlaps the next forward. Every ``SlotReady`` still follows its own
  completed copy (see ``producers.producer``).
* ``Lease`` for another generation: logged and ignored (it belongs to a dead incarnation).
* ``Shutdown``: finish the batch in flight, then exit 0. SIGTERM/SIGINT do the same.
* Undecodable frames and unexpected message kinds are logged and skipped.

On CUDA the target first runs the batch plan's extreme shapes once (``Producer.warm_up``: kernel autotuning
and its memory at start-up, a clear start-up error if it does not fit), then says ``Hello``.

A ``Heartbeat`` goes out every ``monitor.heartbeat_interval_s`` from a thread of its own, also during a forward that
takes longer than ``hang_timeout_s`` (``shared.process.procs.ChildContext``), with ``stats`` (a
``shared.transport.stats.ProducerStats``): ``tokens_per_s`` (real tokens published over the last ~10 s),
``batches``, ``bad_batches``, ``tokens``, ``gpu_mem_bytes`` and ``gpu_mem_reserved_bytes`` (0 without CUDA),
``current_batch`` (-1 when idle), and ``work``/``work_s``: ``"batch N"`` or ``"publish batch N"`` and for how long
(the monitor gives one batch ``batch_timeout_s``), and the balance figures ``busy_s``/``window_s``/``idle_tail_s``
(``shared.process.balance``: busy = forward + capture + slot write + publish; idle = waiting for a lease, i.e. for a
free slot).

Fault injection (tests and chaos drills only): the producer's hooks of ``shared.process.faults`` are applied here
(slow writes, non-finite batches, helper processes, slow and stalled forwards).

The ring is closed (unpinned, unmapped) on exit and never unlinked: the supervisor owns it.
"""

from __future__ import annotations

import collections
import logging
import sys
import time

import torch

from specring.producers.producer import Pending, Producer
from specring.shared.data.dataset import TokenDataset, collate
from specring.shared.errors import ConfigError, MessageError, SlotError
from specring.shared.machine import threads
from specring.shared.machine.devices import resolve_device_group
from specring.shared.process import faults
from specring.shared.process.procs import ChildContext, child_main
from specring.shared.transport import messages
from specring.shared.transport.ring import Ring
from specring.shared.transport.stats import ProducerStats

log = logging.getLogger(__name__)

RATE_WINDOW_S = 10.0
IDLE_POLL_S = 0.2  # the loop turns at least this often while idle


def pick_pad_id(ds: TokenDataset, hf_config) -> int:
    """The pad id for collation: dataset sidecar's (the tokenizer's), else the target config's, else 0."""
    for value in (getattr(ds, "pad_id", None), getattr(hf_config, "pad_token_id", None)):
        if isinstance(value, int) and value >= 0:
            return value
    return 0


class ProducerLoop:
    """The DEALER loop around a ``Producer`` (kept apart from ``body`` so each step reads on its own)."""

    def __init__(self, ctx: ChildContext, producer: Producer, ds: TokenDataset, pad_id: int,
                 forward_faults: faults.ForwardFaults | None = None, devices: list | None = None):
        self.ctx = ctx
        self.devices = list(devices or [producer.device])  # the whole group of a split target
        self.forward_faults = forward_faults
        self.producer = producer
        self.ds = ds
        self.pad_id = pad_id
        # (time, tokens) samples of the rate window; the first is taken now, before any batch, because the
        # heartbeat thread's first call comes one interval later, when batches may already be published
        self.rate_samples: collections.deque = collections.deque([(time.monotonic(), producer.stats.tokens)])
        self.pending: Pending | None = None
        self.seq = 0                       # per-ring publication counter of this incarnation

    # ---------------------------------------------------------------------------------------- messages
    def run(self) -> None:
        while not self.ctx.stopping:
            self.ctx.tick()
            msg = self.ctx.recv(timeout_s=0.0 if self.pending is not None else IDLE_POLL_S)
            if msg is None:
                self.finish_pending()
            elif isinstance(msg, messages.Lease):
                with self.ctx.working(f"batch {msg.batch_id}"):
                    self.on_lease(msg)
            elif isinstance(msg, messages.Shutdown):
                self.ctx.stop_reason = f"shutdown ({msg.reason})"
            elif isinstance(msg, MessageError):
                log.warning("bad_message error=%r", str(msg))
            else:
                log.warning("unexpected_message kind=%s", getattr(msg, "KIND", type(msg).__name__))
        self.finish_pending()  # child_main sends the last heartbeat (the final figures)

    def on_lease(self, lease: messages.Lease) -> None:
        if lease.generation != self.ctx.generation:
            log.warning("ignore_lease batch_id=%d lease_generation=%d my_generation=%d",
                        lease.batch_id, lease.generation, self.ctx.generation)
            return
        try:
            ids, am, lm, lengths = collate(self.ds, lease.sample_ids, lease.pad_to, self.pad_id)
            batch = {"input_ids": ids, "attention_mask": am, "loss_mask": lm, "lengths": lengths,
                     "batch_id": lease.batch_id}
            if self.forward_faults is not None:
                self.forward_faults.before_forward()
            new = self.producer.submit(batch, lease.slot, self.seq)
            self.seq += 1
        except (ValueError, IndexError, SlotError) as e:
            self.finish_pending()
            reason = f"lease for batch {lease.batch_id} cannot be served: {type(e).__name__}: {e}"
            log.error("bad_lease batch_id=%d slot=%d reason=%r", lease.batch_id, lease.slot, reason)
            self.producer.stats.bad_batches += 1
            self.ctx.send(messages.BadBatch(producer=self.ctx.index, generation=self.ctx.generation,
                                            slot=lease.slot, batch_id=lease.batch_id, reason=reason[:2000]))
            return
        self.finish_pending()  # the previous batch's copy overlapped this forward
        self.pending = new

    def finish_pending(self) -> None:
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        with self.ctx.working(f"publish batch {pending.batch_id}"):
            msg = self.producer.complete(pending)
        self.ctx.send(msg)
        if isinstance(msg, messages.SlotReady):
            log.debug("published batch_id=%d slot=%d tokens=%d", msg.batch_id, msg.slot, msg.num_tokens)

    # ---------------------------------------------------------------------------------------- heartbeat
    def stats(self) -> ProducerStats:
        """The heartbeat's figures (called from the heartbeat thread; see the module docstring)."""
        now = time.monotonic()
        st = self.producer.stats
        self.rate_samples.append((now, st.tokens))
        while len(self.rate_samples) > 2 and now - self.rate_samples[1][0] >= RATE_WINDOW_S:
            self.rate_samples.popleft()
        t0, n0 = self.rate_samples[0]
        rate = (st.tokens - n0) / (now - t0) if now > t0 else 0.0
        cuda = [d for d in self.devices if d.type == "cuda"]  # summed over a split target's group
        return ProducerStats(tokens_per_s=float(rate), batches=st.batches, bad_batches=st.bad_batches,
                             tokens=st.tokens,
                             gpu_mem_bytes=sum(int(torch.cuda.memory_allocated(d)) for d in cuda),
                             gpu_mem_reserved_bytes=sum(int(torch.cuda.memory_reserved(d)) for d in cuda),
                             current_batch=int(self.producer.current_batch))


def body(ctx: ChildContext) -> None:
    """Attach the ring, open the data, load the target, then serve leases until told to stop."""
    cfg = ctx.config
    if not 0 <= ctx.index < len(ctx.topology.rings):
        raise ConfigError(f"producer index {ctx.index} has no ring: topology lists {len(ctx.topology.rings)}")
    if not 0 <= ctx.index < len(cfg.producer.devices):
        raise ConfigError(f"producer index {ctx.index} has no device: producer.devices is {cfg.producer.devices}")
    slow_write_s = faults.slow_write_s()
    group = resolve_device_group(cfg.producer.devices[ctx.index])
    device = group[0]
    if device.type == "cpu":  # threads by role (shared.machine.threads): one here, the consumer takes the cores
        threads.apply(threads.plan_threads("producer", "cpu", cfg.producer.devices, cfg.trainer.devices),
                      role="producer")
    ring = Ring.attach(ctx.topology.rings[ctx.index])
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
            ring.pin()
        ds = TokenDataset(cfg.data.data)
        try:
            from transformers.utils import logging as hf_logging
            hf_logging.disable_progress_bar()
        except ImportError:
            pass
        producer = Producer.from_config(cfg.producer, ctx.index, ring, ctx.generation,
                                        checksum=cfg.ring.checksum, slow_write_s=slow_write_s,
                                        label_source=cfg.trainer.label_source,
                                        topk=cfg.trainer.resolved_distill_topk())
        pad_id = pick_pad_id(ds, producer.hf_config)
        if device.type == "cuda":  # kernels tune themselves now, not mid-run (Producer.warm_up)
            t0 = time.monotonic()
            shapes = producer.warm_up(cfg.data.max_tokens, cfg.data.max_batch_size, pad_id)
            log.info("warm_up shapes=%s s=%.1f", shapes, time.monotonic() - t0)
        helpers = faults.start_helpers()  # tests only: processes the target code started and never stops
        forward_faults = faults.ForwardFaults(ctx.index, ctx.generation)
        log.info("serving ring=%s slots=%d slot_bytes=%d pinned=%s data=%s samples=%d pad_id=%d",
                 ring.name, ring.num_slots, ring.slot_bytes, ring.pinned, cfg.data.data, len(ds), pad_id)
        loop = ProducerLoop(ctx, producer, ds, pad_id, forward_faults, devices=group)
        ctx.stats = loop.stats
        ctx.ready()
        loop.run()
        del helpers
    finally:
        ring.close()


def main(argv: list[str] | None = None) -> int:
    return child_main("producer", __doc__, body, argv)


if __name__ == "__main__":
    sys.exit(main())
