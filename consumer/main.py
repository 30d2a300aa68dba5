"""The consumer process: ``python -m consumer.main --run-dir R --index I --generation G``.

Receives ``SlotReady`` (routed by the coordinator), copies the slot's tensors to its device, releases the
slot, and trains the drafter (``consumer.trainer.Trainer``: DFlash, or EAGLE-3 with the run's draft vocabulary
from ``RUN_DIR/draft_vocab.safetensors``). Consumer ``I`` is rank ``I`` of a
``torch.distributed`` group (gloo on CPU, NCCL on GPU) of all consumers.

Slot safety (DESIGN.md, "The slot protocol"): the slot header is checked against the message (batch id,
generation, CRC when enabled) before anything is read; the host-to-device copy runs on a copy stream and
``SlotReleased`` is sent only after the event recorded after it has completed; on CPU the tensors are
cloned. The training step only ever sees tensors that own their memory: nothing handed to the trainer
aliases a slot.

A slot that fails verification is answered with ``BadBatch`` (the coordinator re-produces the batch once);
``Shutdown`` makes rank 0 write a final checkpoint (all ranks have finished the same steps by then).

τ at checkpoints runs off the training path (``consumer.tau_worker``): rank 0 starts a τ evaluator process after
its first training step, hands it each checkpoint's path (a snapshot of the trainable weights between checkpoints,
``--eval-every``) and trains on; the evaluator appends to ``eval.jsonl`` as the inline evaluation did. At a
``done`` shutdown rank 0 waits for the evaluations still owed (``eval step N prompt k/n``); the evaluator is
killed and reaped on every exit of the body.

Threads on CPU: ``shared.machine.threads`` (producers one thread each; a lone consumer chooses between all the cores and
one by timing its steps, ``ThreadTuner``, logged ``threads_tuned``). Start-up is logged as
``startup_s imports=... [cuda=... pin=...] trainer=... build=... warm_up=... ready=...`` (seconds since the process
started; ``cuda`` the CUDA context, ``pin`` the rings registered with CUDA, ``trainer`` the drafter built on its device)
and the first step
as ``first_step_s=...`` with its wait for the first batch.

Heartbeats come from a thread of their own (``shared.process.procs.ChildContext``) with a
``shared.transport.stats.ConsumerStats``: ``tokens_per_s``, ``step``, ``tokens`` (target tokens this rank trained),
``gpu_mem_bytes``, ``tau_eval`` (what the τ evaluator is doing) and what the main thread is doing (``work``: ``batch
N``, ``checkpoint step N``, ``eval step N prompt k/n`` while a finished run waits for its last evaluation) for how
long, so a slow step or checkpoint write is not a hang and a stuck one is; and the balance figures
``busy_s``/``window_s``/``idle_tail_s`` (``shared.process.balance``: idle = waiting for a delivered slot, i.e. starved).
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from specring.shared import envs
from specring.shared.errors import BadBatch as BadBatchError
from specring.shared.errors import MessageError, SlotError
from specring.shared.process.procs import ChildContext, child_main
from specring.shared.run.run_dir import RunDir
from specring.shared.transport import messages as m
from specring.shared.transport.layout import read_tensors
from specring.shared.transport.ring import Ring
from specring.shared.transport.slot_batch import SlotBatch
from specring.shared.transport.stats import ConsumerStats

log = logging.getLogger("consumer")

IDLE_POLL_S = 0.2  # the loop turns at least this often while idle


class SlotReader:
    """Copies a published slot into tensors of its own on ``device`` (see module docstring)."""

    def __init__(self, rings: list[Ring], device: torch.device):
        self.rings = rings
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy_in(self, msg: m.SlotReady, check=None) -> SlotBatch:
        """Verified copy of the slot ``msg`` names; raises ``SlotError``/``MessageError`` naming the problem (a
        payload that is not a ``shared.transport.slot_batch.SlotBatch``: ``SlotBatch.from_tensors``).

        ``check(views)``, when given, validates the payload (a ``SlotBatch`` of host views) before anything is
        copied (it raises to refuse the batch). Returns a ``SlotBatch`` of tensors on the device, except
        ``cu_seqlens``, which stays a small host tensor (the trainer reads it on the host); when it returns, the
        slot may be released.
        """
        if not 0 <= msg.producer < len(self.rings):
            raise SlotError(f"SlotReady names producer {msg.producer}; there are {len(self.rings)} rings")
        ring = self.rings[msg.producer]
        h = ring.verify(msg.slot, msg.batch_id, msg.generation, check_crc=True)
        if h.payload_len != msg.payload_bytes:
            raise SlotError(f"slot {msg.slot} of producer {msg.producer}: header payload {h.payload_len} B, "
                            f"message {msg.payload_bytes} B")
        views = SlotBatch.from_tensors(read_tensors(ring.payload(msg.slot), msg.descriptor))
        if check is not None:
            check(views)
        if self.stream is None:
            return views.to(self.device, copy=True)  # clones: nothing aliases the slot
        with torch.cuda.stream(self.stream):
            out = views.to(self.device, non_blocking=True, copy=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        done.synchronize()  # the copy has landed: the slot may be released, the views dropped
        main = torch.cuda.current_stream(self.device)
        for t in out.to_tensors().values():
            if t.is_cuda:
                t.record_stream(main)
        return out


STORE_ENV, PREFIX_ENV, CHECKPOINTS_ENV = envs.DIST_STORE, envs.DIST_PREFIX, envs.CHECKPOINTS_DIR  # shared/envs.py


def _init_distributed(ctx: ChildContext, device: torch.device):
    """Join the consumers' data-parallel group: ``(rank, world_size, group)``.

    One node: rank ``ctx.index`` of ``len(trainer.devices)``, env:// rendezvous at the supervisor's
    ``MASTER_ADDR``/``MASTER_PORT``. Several nodes: ``RANK``/``WORLD_SIZE`` are global (the supervisor sets them)
    and the group meets in the nodes' rendezvous store (``SPECRING_DIST_STORE`` host:port, under this run's
    ``SPECRING_DIST_PREFIX``; see ``supervisor.nodes``)."""
    rank = int(envs.get("RANK", str(ctx.index)))
    world = int(envs.get("WORLD_SIZE", str(len(ctx.config.trainer.devices))))
    if world == 1:
        return 0, 1, None
    backend = "nccl" if device.type == "cuda" else "gloo"
    # a rank waits in a collective while another trains a slow batch: that is allowed batch_timeout_s
    timeout = timedelta(seconds=max(60.0, ctx.config.monitor.batch_timeout_s))
    store = None
    if envs.get(STORE_ENV):
        host, _, port = envs.get(STORE_ENV).rpartition(":")
        store = dist.PrefixStore(envs.get(PREFIX_ENV, ""),
                                 dist.TCPStore(host, int(port), is_master=False, timeout=timeout))
    dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timeout, store=store)
    log.info("distributed backend=%s rank=%d world_size=%d store=%s", backend, rank, world,
             envs.get(STORE_ENV, "env://"))
    return rank, world, dist.group.WORLD


def _since_start() -> float:
    """Seconds since this process was created (its start-up figures are measured from there)."""
    import psutil
    try:
        return time.time() - psutil.Process().create_time()
    except psutil.Error:
        return float("nan")


def body(ctx: ChildContext) -> None:
    """Attach the rings, join the group, build the trainer (resume, warm-up), say Hello, then train until told to
    stop; rank 0 also feeds the τ evaluator (``consumer.tau_worker``), which ends with the body whatever ends it."""
    from specring.consumer.trainer import CPU_MAX_MASK_ELEMS, Trainer, drafter_config_from_run
    from specring.shared.drafters import get_family
    from specring.shared.drafters.checkpoint import latest_checkpoint
    from specring.shared.machine import threads

    marks = {"imports": _since_start()}
    cfg = ctx.config
    device = torch.device(cfg.trainer.devices[ctx.index])
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.init()
        marks["cuda"] = _since_start()
    plan = threads.apply(threads.plan_threads("consumer", device.type, cfg.producer.devices, cfg.trainer.devices),
                         role="consumer")
    # on CPU the thread count is chosen by measurement (shared.machine.threads.ThreadTuner): 1 or all of the plan's
    tuner = threads.ThreadTuner([plan.intra, 1] if device.type == "cpu" else [plan.intra])
    if tuner.active:
        torch.set_num_threads(tuner.current)  # one thread until two are measured faster
    rings = [Ring.attach(name) for name in ctx.topology.rings]
    worker = None
    try:
        if device.type == "cuda":
            for r in rings:
                r.pin()
            marks["pin"] = _since_start()
        rank, world, group = _init_distributed(ctx, device)
        dcfg = drafter_config_from_run(cfg)
        extra = {}
        if get_family(cfg.trainer.drafter).needs_draft_vocab:  # the run's draft vocabulary, written by the supervisor
            from specring.shared.drafters.draft_vocab import read_draft_vocab
            extra["draft_vocab"] = read_draft_vocab(ctx.run_dir, dcfg.draft_vocab_size, dcfg.vocab_size)
        elif device.type != "cuda":  # CPU: small groups (per sequence) so no work is spent on other sequences' context
            extra["max_mask_elems"] = CPU_MAX_MASK_ELEMS
        trainer = Trainer(cfg.trainer, dcfg, cfg.producer.target, device, ctx.run_dir, rank=rank,
                          world_size=world, process_group=group, **extra)
        marks["trainer"] = _since_start()
        if cfg.resume:  # another node than 0 reads node 0's checkpoints (a shared filesystem)
            path = latest_checkpoint(envs.get(CHECKPOINTS_ENV) or RunDir(ctx.run_dir).checkpoints_dir)
            if path is not None:
                trainer.load_checkpoint(path)
                log.info("resume checkpoint=%s step=%d", path, trainer.step_count)
        marks["build"] = _since_start()
        if rank == 0 and cfg.trainer.eval_prompts > 0 and cfg.data.heldout:
            from specring.consumer.tau_worker import TauWorker  # started after the first step (tau_worker)
            worker = TauWorker(ctx.run_dir, str(device), index=ctx.index, generation=ctx.generation,
                               batch_timeout_s=cfg.monitor.batch_timeout_s,
                               startup_timeout_s=cfg.monitor.startup_timeout_s)
        if not trainer.start_background_warm_up():  # else the compile goes on beside the first, eager steps
            compile_s = trainer.warm_up()  # before Hello: a cold compile is start-up (startup_timeout_s), not a hang
            if compile_s:
                log.info("warm_up attention=%s compiled=%s seconds=%.1f", trainer.attention, trainer.compiled,
                         compile_s)
        marks["warm_up"] = _since_start()
        ctx.ready()
        marks["ready"] = _since_start()
        log.info("startup_s %s", " ".join(f"{k}={v:.1f}" for k, v in marks.items()))
        _loop(ctx, trainer, SlotReader(rings, device), rank, worker, world, tuner)
    finally:
        if worker is not None:
            worker.close(ctx.stop_reason or "consumer exiting")
        for r in rings:
            r.close()
        if dist.is_available() and dist.is_initialized():  # joined a group (more than one consumer)
            dist.destroy_process_group()


def _loop(ctx: ChildContext, trainer, reader: SlotReader, rank: int, worker=None, world: int = 1,
          tuner=None) -> None:
    from specring.consumer.step_profile import ProfileWindow, StepPhases
    from specring.consumer.trainer import check_batch

    cfg = ctx.config
    phases = StepPhases(every=min(500, cfg.trainer.checkpoint_every))
    profile = ProfileWindow(ctx.run_dir, ctx.index, reader.device)
    tokens, t0 = 0, time.monotonic()
    last_ckpt = (trainer.step_count, None)  # (step, path) of the last checkpoint written here
    first_batch_at: float | None = None
    stepped = False

    last_loss: float | None = None

    def stats() -> ConsumerStats:  # called from the heartbeat thread
        now = time.monotonic()
        return ConsumerStats(
            tokens_per_s=tokens / max(1e-9, now - t0), step=trainer.step_count, tokens=tokens,
            gpu_mem_bytes=torch.cuda.memory_allocated(reader.device) if reader.device.type == "cuda" else None,
            tau_eval=worker.doing() if worker is not None else None)

    ctx.stats = stats

    def evaluate() -> None:
        """Hand step ``trainer.step_count``'s weights to the τ evaluator (never waits for it)."""
        if worker is None:
            return
        step = trainer.step_count
        try:
            if last_ckpt[0] == step and last_ckpt[1] is not None:
                worker.submit(step, last_loss, last_ckpt[1])
            else:  # between checkpoints (--eval-every): a snapshot of the trainable weights
                worker.submit(step, last_loss, worker.snapshot(trainer.model, step), owned=True)
        except Exception as e:  # noqa: BLE001 - an evaluation problem must not stop training; eval.jsonl records it
            from specring.consumer.tau import record_failure
            log.error("tau_eval_failed step=%d error=%s: %s", step, type(e).__name__, e)
            record_failure(worker.eval_path, step, e)

    def wait_for_tau() -> None:
        """A finished run: wait for the evaluations still owed, each prompt a piece of work of its own."""
        if worker is None or worker.idle:
            return
        with ctx.working(worker.doing() or "eval"):  # a long evaluation is neither a hang nor a stuck shutdown
            def on_progress(doing: str) -> None:
                ctx.progress(doing)
                ctx.heartbeat(block=False)
            if not worker.wait(on_progress=on_progress, should_stop=lambda: ctx.stopping):
                log.warning("tau_eval_wait stopped reason=%s", ctx.stop_reason or "-")

    def checkpoint(with_eval: bool = True) -> None:
        nonlocal last_ckpt
        with ctx.working(f"checkpoint step {trainer.step_count}"):  # heartbeats go on during the write
            path = trainer.save_checkpoint()
        last_ckpt = (trainer.step_count, path)
        if rank == 0:
            ctx.send(m.Checkpointed(step=trainer.step_count, path=str(path)))
        if with_eval and cfg.trainer.eval_every == 0:
            evaluate()

    def _after_step(result) -> None:
        nonlocal last_loss, stepped
        if result["optimizer_step"]:
            if rank == 0:  # rank 0 speaks for the whole group: result["batch_ids"] holds every rank's ids
                ctx.send(m.Trained(consumer=ctx.index, step=trainer.step_count, batch_ids=list(result["batch_ids"]),
                                   loss=float(result["loss"]), num_tokens=int(result["num_tokens"]),
                                   skipped=bool(result["skipped"])))
            last_loss = float(result["loss"])
            if not stepped:  # the first step of this process
                stepped = True
                log.info("first_step_s=%.1f first_batch_s=%.1f", _since_start(), first_batch_at)
                if worker is not None:  # the evaluator starts now: it never delays the first step
                    worker.start(trainer.step_count)
            if trainer.step_count % cfg.trainer.checkpoint_every == 0:
                checkpoint()
            if cfg.trainer.eval_every and trainer.step_count % cfg.trainer.eval_every == 0:
                evaluate()
            line = phases.optimizer_step(trainer.step_count)
            if line is not None:
                log.info("%s", line)
            profile.after_step(trainer.step_count)

    while not ctx.stopping:
        ctx.tick()
        if worker is not None:
            worker.poll()
        phases.mark_wait_start()
        msg = ctx.recv(timeout_s=IDLE_POLL_S)
        phases.end_wait()
        if msg is None:
            continue
        if isinstance(msg, MessageError):
            log.warning("reject frame error=%s", msg)
            continue
        if isinstance(msg, m.Shutdown):
            log.info("shutdown reason=%s", msg.reason)
            if trainer.step_count > last_ckpt[0] and (msg.reason == "done" or world == 1):
                checkpoint(with_eval=msg.reason == "done")  # an interrupted run stops without evaluating
            if msg.reason == "done":
                wait_for_tau()
            return
        if not isinstance(msg, m.SlotReady):
            log.warning("reject kind=%s reason=unexpected_for_consumer", msg.KIND)
            continue
        if first_batch_at is None:
            first_batch_at = _since_start()
        with ctx.working(f"batch {msg.batch_id}"):
            try:
                with phases.phase("copy"):
                    batch = reader.copy_in(msg, check=lambda views: check_batch(views, trainer.dcfg,
                                                                               cfg.trainer.label_source))
            except (SlotError, MessageError, BadBatchError) as e:
                log.error("bad_slot producer=%d slot=%d batch=%d error=%s", msg.producer, msg.slot, msg.batch_id, e)
                ctx.send(m.BadBatch(producer=msg.producer, generation=msg.generation, slot=msg.slot,
                                    batch_id=msg.batch_id, reason=str(e)[:500]))
                continue
            ctx.send(m.SlotReleased(producer=msg.producer, generation=msg.generation, slot=msg.slot,
                                    batch_id=msg.batch_id))
            t_step = time.perf_counter()
            with phases.phase("train"):
                result = trainer.step(batch, [msg.batch_id], checked=True)
            del batch
            if tuner is not None and tuner.active and world == 1:  # ranks of a group keep one thread count
                n = tuner.record(time.perf_counter() - t_step, max(1, int(msg.num_tokens)))
                if n is not None:
                    torch.set_num_threads(n)
        tokens += int(msg.num_tokens)
        with phases.phase("after"):
            _after_step(result)


def main(argv: list[str] | None = None) -> int:
    return child_main("consumer", __doc__, body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
