"""The τ evaluator, off the training path: a process of its own that rank 0 of the consumers starts, feeds with
checkpoints and reaps (``TauWorker``), and the process itself (``python -m specring.consumer.tau_worker``).

Before, rank 0 measured τ inline at each checkpoint (``consumer.tau.CheckpointEvaluator``), and training waited:
on an H200 the first evaluation stalled it 20 s, later ones 4-6 s; on 2 CPU cores 8-10 s. Now the consumer only
says "step N's weights are at PATH" and trains on; the evaluator decodes with its own copy of the target on the
consumer's device and appends to ``RUN_DIR/eval.jsonl`` exactly the records the inline evaluation appended (the
same ``CheckpointEvaluator``), so ``metrics.jsonl``, ``summary.json`` (``tau_last``, ``eval_failures``), the
progress line and the run's last line read as before.

Weights: at a checkpoint the evaluator reads the trainable tensors of the checkpoint just written
(``checkpoints/step-N/drafter.safetensors``: nothing more is written on the training path); an evaluation between
checkpoints (``--eval-every``) gets a snapshot of the trainable tensors, ``RUN_DIR/tau/step-N.safetensors``, which
the evaluator deletes once read (the consumer removes leftovers at start and at exit). The drafter is built once in
the evaluator as the trainer builds it (its family's ``build``: frozen embedding and head from the target) and
takes each evaluation's trainable weights by ``load_trainable``.

Protocol: requests are JSON lines on the evaluator's stdin (``{"op": "eval", "step", "loss", "weights",
"owned"}``; EOF or ``{"op": "stop"}`` ends it), events JSON lines on a pipe of their own (``--events-fd``):
``ready`` (target, prompts and drafter loaded; ``load_s``), ``load_failed`` (recorded with stage ``load``; τ is
then off for the run, as before), ``prompt`` (after each prompt: ``step``, ``done``, ``total``), ``done``
(``step``, ``tau_mean``, ``eval_s``) and ``failed`` (``step``, ``error``; the evaluator recorded it). The
evaluator's log lines go to the consumer's log (``logs/consumer-0.log``, prefix ``tau-0/gG``).

Scheduling: one evaluation at a time, in order, at most ``MAX_OWED`` owed at once (the one running and those
waiting); beyond that the newest waiting one gives way to the new request (logged ``tau_eval_skipped``), so
evaluations slower than checkpoints never queue up without bound, and the wait at the end stays bounded. At a
``done`` shutdown the consumer waits for the evaluations still owed (``TauWorker.wait``, heartbeating per prompt as
before); an interrupted run drops them (logged ``tau_eval_cancelled``). The evaluator starts after the consumer's first
training step (never delaying it). On CPU it runs 1 intra-op and 1 inter-op thread (``shared.machine.threads``).

Failures stay visible as before: an evaluation that raises is recorded by the evaluator; an evaluator that exits
or is silent for ``batch_timeout_s`` during an evaluation (``startup_timeout_s`` while it starts) is killed, its
evaluation recorded as failed (stage ``process``), and it is started again for the next one, at most
``MAX_STARTS`` times in all. Nothing is left behind: the evaluator asks for SIGKILL when the consumer dies
(parent-death signal; it exits at once if the consumer is already gone), stays in the consumer's process group
(which the supervisor kills once the consumer has exited) and carries the run id (``SPECRING_RUN_ID``: the
supervisor, a child subreaper, kills it if it is ever orphaned); ``close`` kills and reaps it on every exit of the
consumer's body.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from specring.consumer.tau import record_failure
from specring.shared.paths import IMPORT_ROOT
from specring.shared.run.run_dir import RunDir

log = logging.getLogger(__name__)

MAX_STARTS = 3  # evaluator processes started in one consumer's life (the first and two replacements)
MAX_OWED = 4  # evaluations owed at once (the one running and those waiting): beyond, the newest waiting gives way
CLOSE_GRACE_S = 5.0  # at close: SIGTERM, this long, then SIGKILL
IDLE_EXIT_S = 1.0  # at close: an idle evaluator told to stop (EOF) gets this long before the SIGTERM


def _one_line(text: str, limit: int = 500) -> str:
    return " ".join(str(text).split())[:limit]


# ============================================================================================ the consumer's side
class TauWorker:
    """The consumer's handle on its τ evaluator process (see the module docstring); rank 0 only, main thread only.

    ``run_dir``: the run directory (``eval.jsonl``, checkpoints); ``device``: the consumer's device (``"cpu"``,
    ``"cuda:0"``); ``index``/``generation``: the consumer's, for the evaluator's log prefix; ``batch_timeout_s``:
    the longest an evaluation may go without finishing a prompt; ``startup_timeout_s``: the longest the evaluator
    may take to load. ``submit`` queues an evaluation, ``poll`` (once per turn of the consumer's loop, never
    blocking) reads the evaluator's events and watches it, ``wait`` blocks until every owed evaluation is recorded,
    ``close`` ends the evaluator.
    """

    def __init__(self, run_dir: str | Path, device: str, *, index: int = 0, generation: int = 1,
                 batch_timeout_s: float = 1800.0, startup_timeout_s: float = 300.0, max_starts: int = MAX_STARTS):
        self.run_dir = Path(run_dir)
        run = RunDir(run_dir)
        self.eval_path = run.eval_file
        self.snapshot_dir = run.tau_dir  # RUN_DIR/tau/: weights of evaluations between checkpoints
        self.device = str(device)
        self.index, self.generation = int(index), int(generation)
        self.batch_timeout_s, self.startup_timeout_s = float(batch_timeout_s), float(startup_timeout_s)
        self.max_starts = int(max_starts)
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.ready = False
        self.disabled = ""            # why τ is off for the rest of the run ("" while it is on)
        self.current: dict | None = None   # the request being evaluated
        self.queue: list[dict] = []        # the requests waiting (with the one running, at most MAX_OWED)
        self.progress: tuple[int, int, int] | None = None  # (step, prompts done, prompts) of the current one
        self.completed: list[dict] = []    # events done/failed, in order (tests, and the consumer's log)
        self._events_fd: int | None = None
        self._buf = b""
        self._spawned_at = 0.0
        self._last_event = 0.0
        shutil.rmtree(self.snapshot_dir, ignore_errors=True)  # a killed consumer's snapshots

    # ------------------------------------------------------------------ state
    @property
    def pid(self) -> int | None:
        """The evaluator process's pid (None when none runs)."""
        return self.proc.pid if self.proc is not None else None

    @property
    def idle(self) -> bool:
        """True when no evaluation is running or waiting."""
        return self.current is None and not self.queue

    def doing(self) -> str:
        """What the evaluator is busy with, for the consumer's work line: ``eval step N prompt k/n``,
        ``eval step N (evaluator starting)``, or ``""``. Safe to call from another thread (the heartbeat's)."""
        current, progress, queue = self.current, self.progress, list(self.queue)
        if current is not None:
            if progress is not None and progress[0] == current["step"]:
                _, done, total = progress
                return f"eval step {current['step']} prompt {min(done + 1, total)}/{total}"
            return f"eval step {current['step']}"
        if queue:
            return f"eval step {queue[0]['step']} (evaluator starting)"
        return ""

    # ------------------------------------------------------------------ requests
    def start(self, step: int) -> None:
        """Start the evaluator process now unless one runs, τ is off, or ``MAX_STARTS`` were used (``step``: the
        consumer's optimizer step, recorded with a failure to load)."""
        if self.proc is not None or self.disabled:
            return
        if self.starts >= self.max_starts:
            self._disable(f"the tau evaluator was started {self.starts} times and did not last", step)
            return
        r, w = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = str(IMPORT_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        argv = [sys.executable, "-m", "specring.consumer.tau_worker", "--run-dir", str(self.run_dir),
                "--device", self.device, "--index", str(self.index), "--generation", str(self.generation),
                "--parent-pid", str(os.getpid()), "--events-fd", str(w), "--step", str(int(step))]
        try:
            # in the consumer's process group and session: whatever ends the consumer's group ends it too
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, pass_fds=(w,), env=env)
        finally:
            os.close(w)
        os.set_blocking(r, False)
        self._events_fd, self._buf = r, b""
        self.starts += 1
        self.ready = False
        self._spawned_at = self._last_event = time.monotonic()
        log.info("tau_worker start pid=%d device=%s start=%d/%d", self.proc.pid, self.device, self.starts,
                 self.max_starts)

    def submit(self, step: int, loss: float | None, weights: str | Path, owned: bool = False) -> None:
        """Ask for τ of the drafter at optimizer step ``step`` (``loss``: the step's loss, for the record) with the
        weights at ``weights`` (a checkpoint's step directory, or a safetensors file of trainable tensors);
        ``owned``: the file is a snapshot to delete once read. Never blocks. With τ off nothing is measured
        (as before, when the target did not load)."""
        req = {"op": "eval", "step": int(step), "loss": loss, "weights": str(weights), "owned": bool(owned)}
        if self.disabled:
            self._drop(req)
            return
        if len(self.queue) + (self.current is not None) >= MAX_OWED:  # the newest waiting one gives way to this one
            old = self.queue.pop()
            log.warning("tau_eval_skipped step=%d superseded_by=%d reason=the evaluator is behind (evaluation of "
                        "step %d still to finish)", old["step"], step,
                        (self.current or self.queue[0])["step"] if (self.current or self.queue) else -1)
            self._drop(old)
        self.queue.append(req)
        if self.proc is None:
            self.start(step)
        self.poll()

    def snapshot(self, model, step: int) -> Path:
        """Write the trainable tensors of ``model`` (``trainable_state_dict()``, on the host) to
        ``RUN_DIR/tau/step-N.safetensors`` (written whole, then renamed) for an evaluation between checkpoints;
        returns the path. Raises ``OSError`` when it cannot be written."""
        from safetensors.torch import save_file

        self.snapshot_dir.mkdir(parents=True, exist_ok=True)
        path = self.snapshot_dir / f"step-{int(step):06d}.safetensors"
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.trainable_state_dict().items()}
        save_file(tensors, str(tmp))
        os.replace(tmp, path)
        return path

    # ------------------------------------------------------------------ watching
    def poll(self) -> list[dict]:
        """Read what the evaluator said, watch it (exit, silence) and hand it the waiting request when it is free;
        never blocks. Returns the events read (``ready``, ``prompt``, ``done``, ...)."""
        events = self._read_events()
        for ev in events:
            self._on_event(ev)
        if self.proc is not None:
            code = self.proc.poll()
            if code is not None:
                last_words = self._read_events()  # what it said before it exited (a result, a failure)
                for ev in last_words:
                    self._on_event(ev)
                events += last_words
                self._reap(f"the tau evaluator process exited with code {code}")
            else:
                self._check_silence()
        if self.proc is None and self.queue and not self.disabled:
            self.start(self.queue[0]["step"])
        if self.proc is not None and self.ready and self.current is None and self.queue:
            self._send(self.queue[0])
        return events

    def wait(self, on_progress: Callable[[str], None] | None = None,
             should_stop: Callable[[], bool] = lambda: False) -> bool:
        """Block until every evaluation submitted so far is recorded (or τ is off). ``on_progress(doing)`` is
        called after each prompt and while the evaluator starts (the consumer heartbeats from it);
        ``should_stop()`` true gives up (a signal). Returns True when nothing is left owed."""
        last = None
        while not self.idle and not self.disabled:
            if should_stop():
                return False
            fd = self._events_fd
            if fd is not None:
                select.select([fd], [], [], 0.2)
            else:
                time.sleep(0.05)
            self.poll()
            now = self.doing()
            if on_progress is not None and now and now != last:
                on_progress(now)
            last = now
        return self.idle

    def close(self, reason: str = "") -> None:
        """End the evaluator: evaluations still owed are dropped (logged ``tau_eval_cancelled`` with ``reason``);
        an idle evaluator is told to stop (EOF on its stdin) and SIGTERMed if it has not exited ``IDLE_EXIT_S`` later,
        a busy one SIGTERMed at once; either is SIGKILLed if it has not exited after ``CLOSE_GRACE_S``, and reaped;
        snapshots are removed. Safe to call more than once."""
        busy = self.current is not None or not self.ready
        for req in ([self.current] if self.current else []) + self.queue:
            log.warning("tau_eval_cancelled step=%d reason=%s", req["step"], reason or "consumer exiting")
            self._drop(req)
        self.current, self.queue = None, []
        proc, self.proc = self.proc, None
        if proc is not None:
            try:
                if proc.stdin is not None:
                    proc.stdin.close()  # EOF: an idle evaluator exits by itself
            except OSError:
                pass
            if not busy:
                try:
                    proc.wait(timeout=IDLE_EXIT_S)
                except subprocess.TimeoutExpired:
                    pass
            if proc.poll() is None:
                proc.terminate()  # busy (a prompt, its start-up) or slow to exit: it stops at once
            try:
                proc.wait(timeout=CLOSE_GRACE_S)
            except subprocess.TimeoutExpired:
                log.warning("tau_worker kill pid=%d reason=not exited %.0f s after close", proc.pid, CLOSE_GRACE_S)
                proc.kill()
                proc.wait()
            log.info("tau_worker exit pid=%d code=%s", proc.pid, proc.returncode)
        self._close_fd()
        shutil.rmtree(self.snapshot_dir, ignore_errors=True)

    # ------------------------------------------------------------------ internals
    def _send(self, req: dict) -> None:
        try:
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
        except (OSError, ValueError) as e:  # it died meanwhile: the next poll reaps it, the request waits
            log.warning("tau_worker send failed step=%d error=%s", req["step"], e)
            return
        self.queue.remove(req)
        self.current, self.progress = req, None
        self.current["sent_at"] = self._last_event = time.monotonic()

    def _read_events(self) -> list[dict]:
        if self._events_fd is None:
            return []
        chunks = []
        while True:
            try:
                data = os.read(self._events_fd, 65536)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:
                break
            chunks.append(data)
        if not chunks:
            return []
        self._buf += b"".join(chunks)
        *lines, self._buf = self._buf.split(b"\n")
        out = []
        for line in lines:
            try:
                ev = json.loads(line)
            except ValueError:
                log.warning("tau_worker garbled event %r", line[:200])
                continue
            if isinstance(ev, dict):
                out.append(ev)
        return out

    def _on_event(self, ev: dict) -> None:
        self._last_event = time.monotonic()
        kind = ev.get("event")
        if kind == "ready":
            self.ready = True
            log.info("tau_worker ready pid=%s load_s=%.1f", self.pid, float(ev.get("load_s", 0.0)))
        elif kind == "load_failed":  # the evaluator recorded it (stage load): τ is off, as before
            self._disable(f"{ev.get('error', 'the tau evaluator could not load')}", None, record=False)
            log.error("tau_eval_disabled error=%s", ev.get("error"))
        elif kind == "prompt":
            self.progress = (int(ev.get("step", -1)), int(ev.get("done", 0)), int(ev.get("total", 0)))
        elif kind in ("done", "failed"):
            step = int(ev.get("step", -1))
            if kind == "failed":
                log.error("tau_eval_failed step=%d error=%s", step, ev.get("error"))
            if self.current is not None and self.current["step"] == step:
                self.current = None
                self.progress = None
            self.completed.append(ev)

    def _check_silence(self) -> None:
        now = time.monotonic()
        if not self.ready and now - self._spawned_at > self.startup_timeout_s:
            self._kill(f"the tau evaluator did not load within startup_timeout_s ({self.startup_timeout_s:g} s)")
        elif self.current is not None and now - self._last_event > self.batch_timeout_s:
            self._kill(f"the tau evaluator was silent for {now - self._last_event:.0f} s during the evaluation "
                       f"(batch_timeout_s {self.batch_timeout_s:g})")

    def _kill(self, why: str) -> None:
        log.error("tau_worker kill pid=%s reason=%s", self.pid, why)
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._reap(why)

    def _reap(self, why: str) -> None:
        """The evaluator has exited (and been waited for): its evaluation in flight failed, visibly."""
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.wait()
            try:
                if proc.stdin is not None:
                    proc.stdin.close()
            except OSError:
                pass
        self._close_fd()
        self.ready = False
        if self.current is not None:
            req, self.current = self.current, None
            eval_s = time.monotonic() - req.get("sent_at", time.monotonic())
            record_failure(self.eval_path, req["step"], f"RuntimeError: {why}", stage="process", eval_s=eval_s)
            log.error("tau_eval_failed step=%d error=%s", req["step"], why)
            self.completed.append({"event": "failed", "step": req["step"], "error": why})
            self._drop(req)
        elif not self.disabled:
            log.warning("tau_worker exited pid=%s reason=%s", proc.pid if proc else "-", why)

    def _disable(self, why: str, step: int | None, record: bool = True) -> None:
        self.disabled = why
        for req in ([self.current] if self.current else []) + self.queue:
            if record:
                record_failure(self.eval_path, req["step"], f"RuntimeError: {why}", stage="process")
                log.error("tau_eval_failed step=%d error=%s", req["step"], why)
            self._drop(req)
        self.current, self.queue = None, []
        if record and step is not None:
            log.error("tau_eval_disabled error=%s", why)

    def _drop(self, req: dict) -> None:
        if req.get("owned"):
            Path(req["weights"]).unlink(missing_ok=True)

    def _close_fd(self) -> None:
        if self._events_fd is not None:
            try:
                os.close(self._events_fd)
            except OSError:
                pass
            self._events_fd, self._buf = None, b""


# ============================================================================================ the process
class _Stopped(Exception):
    """A stop signal arrived (the consumer's process group is being stopped)."""


def _read_weights(drafter, weights: str) -> None:
    """Load the trainable tensors of ``weights`` (a checkpoint's step directory or a snapshot file) into
    ``drafter``; raises ``FileNotFoundError``, ``shared.errors.CorruptFile`` or ``ValueError`` naming the file."""
    from specring.shared.drafters.checkpoint import WEIGHTS_FILE, read_safetensors

    path = Path(weights)
    if path.is_dir():
        path = path / WEIGHTS_FILE
    keys = list(drafter.trainable_state_dict())
    drafter.load_trainable(read_safetensors(path, keys=keys), str(path))


def serve(args) -> int:
    """The evaluator process's body (see the module docstring); returns its exit code."""
    import torch

    from specring.consumer.tau import CheckpointEvaluator
    from specring.shared.drafters import get_family
    from specring.shared.machine import threads

    device = torch.device(args.device)
    threads.apply(threads.plan_threads("tau", device.type, [], [args.device]), role="tau")
    fd = args.events_fd

    def emit(**ev) -> None:
        os.write(fd, (json.dumps(ev) + "\n").encode())

    run_dir = Path(args.run_dir)
    run = RunDir(run_dir)
    t0 = time.perf_counter()
    try:
        cfg = run.read_config()
        evaluator = CheckpointEvaluator(cfg, device, run_dir, prompt_len=cfg.trainer.eval_prompt_len)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        try:
            from transformers.utils import logging as hf_logging
            hf_logging.disable_progress_bar()
        except ImportError:
            pass
        family = get_family(cfg.trainer.drafter)
        dcfg = family.config_from_run(cfg)
        extra = {}
        if family.needs_draft_vocab:
            from specring.shared.drafters.draft_vocab import read_draft_vocab
            extra["draft_vocab"] = read_draft_vocab(run_dir, dcfg.draft_vocab_size, dcfg.vocab_size)
        drafter = family.build(dcfg, cfg.producer.target, **extra).to(device).eval()
        evaluator.load()
    except _Stopped:
        raise
    except Exception as e:  # noqa: BLE001 - τ during training is optional: recorded (stage load), off for the run
        rec = record_failure(run.eval_file, args.step, e, stage="load")
        log.error("load_failed error=%s", rec["error"])
        emit(event="load_failed", error=rec["error"])
        return 1
    emit(event="ready", load_s=round(time.perf_counter() - t0, 2))
    log.info("ready device=%s load_s=%.1f prompts=%d", device, time.perf_counter() - t0, len(evaluator.prompts))
    for line in iter(sys.stdin.buffer.readline, b""):
        try:
            req = json.loads(line)
        except ValueError:
            log.warning("garbled request %r", line[:200])
            continue
        if not isinstance(req, dict) or req.get("op") == "stop":
            break
        if req.get("op") != "eval":
            log.warning("unknown request op=%r", req.get("op"))
            continue
        step = int(req["step"])
        try:
            _read_weights(drafter, req["weights"])
        except Exception as e:  # noqa: BLE001 - a checkpoint that does not read is a failed evaluation
            rec = record_failure(run.eval_file, step, e, stage="weights")
            log.error("tau_eval_failed step=%d error=%s", step, rec["error"])
            emit(event="failed", step=step, error=rec["error"])
            continue
        finally:
            if req.get("owned"):
                Path(req["weights"]).unlink(missing_ok=True)
        try:
            rec = evaluator(drafter, step, req.get("loss"),
                            on_prompt=lambda done, total, s=step: emit(event="prompt", step=s, done=done, total=total))
        except _Stopped:
            raise
        except Exception as e:  # noqa: BLE001 - recorded by the evaluator (eval.jsonl), said to the consumer
            emit(event="failed", step=step, error=_one_line(f"{type(e).__name__}: {e}"))
            continue
        emit(event="done", step=step, tau_mean=rec["tau_mean"], eval_s=rec["eval_s"])
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m specring.consumer.tau_worker --run-dir R --device D --parent-pid P --events-fd F [--index I
    --generation G --step N]``: the τ evaluator process, started by ``TauWorker.start``."""
    from specring.shared.process.logs import configure_logging
    from specring.shared.process.procs import STOP_SIGNALS, set_parent_death_signal, set_process_title

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--device", required=True)
    ap.add_argument("--parent-pid", type=int, required=True)
    ap.add_argument("--events-fd", type=int, required=True)
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--generation", type=int, default=1)
    ap.add_argument("--step", type=int, default=0)
    args = ap.parse_args(argv)
    set_parent_death_signal(signal.SIGKILL)  # dies with the consumer, kill -9 included
    configure_logging(f"tau-{args.index}/g{args.generation}")
    if os.getppid() != args.parent_pid:  # the consumer died before the line above took effect
        log.error("exit reason=parent_gone parent_pid=%d", args.parent_pid)
        return 1
    set_process_title(f"sr-tau{args.index}")

    def on_signal(signum, _frame):
        raise _Stopped(signal.Signals(signum).name)

    for s in STOP_SIGNALS:
        signal.signal(s, on_signal)
    try:
        code = serve(args)
        log.info("exit reason=%s", "done" if code == 0 else "load_failed")
        return code
    except _Stopped as e:
        log.info("exit reason=%s", e)
        return 0
    except BaseException as e:  # never silent: the consumer records its evaluation in flight as failed
        log.exception("fatal %s", type(e).__name__)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
