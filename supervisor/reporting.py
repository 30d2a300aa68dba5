"""Experiment trackers (``--report-to none|tensorboard|wandb|mlflow``, a comma list): one reporter, in the
supervisor, for the whole run.

The supervisor is the one process that sees everything: it follows the consumer's ``metrics.jsonl`` (loss,
per-slot or per-TTT-step accuracy, acceptance proxy, learning rate, gradient norm, tokens/s) and ``eval.jsonl``
(τ), and adds its own figures (end-to-end tokens/s, ring occupancy per producer, producer restarts). Every
``refresh`` the new lines are sent to each backend, keyed by the optimizer step:

* ``tensorboard``: ``torch.utils.tensorboard.SummaryWriter`` event files in ``RUN_DIR/tensorboard``;
* ``wandb``: a run named after the run id in ``RUN_DIR/wandb``, offline unless ``WANDB_MODE`` says otherwise or
  an API key is configured (``WANDB_API_KEY``), so a machine without network works;
* ``mlflow``: a run in ``$MLFLOW_TRACKING_URI`` (default: a file store ``RUN_DIR/mlruns``), parameters = the
  run's configuration.

A backend asked for but not installed is an error at start (``check_backends``), naming how to install it; a
backend that fails mid-run is logged and dropped, never stopping training.

No tracker is ever on the supervisor's loop: the backends start, send and close in a worker process of their own
(``_tracker_worker``, ``python -m specring.supervisor.reporting --worker``; a session of its own, so a terminal's Ctrl-C
or hang-up does not reach it; killed with its parent), so a tracker server that answers 503 for minutes or never
answers, or a wandb start-up waiting 90 s, delays no step, no ``launch.py status`` and no signal. The supervisor reads
the records (local files) and puts them on a bounded queue (``QUEUE_RECORDS``, emptied by a writer thread into the
worker's stdin: what waits is bounded by the queue and the pipe); a record that finds it full is dropped and counted
(``Reporter.stats``: ``queued``, ``dropped``, ``sent``, ``failed``, ``not_sent``, in ``summary.json`` under
``report_to``). ``close`` waits at most ``CLOSE_WAIT_S`` seconds for the worker to send what is queued and close its
backends, then kills it (what it had not sent is counted as ``not_sent``, with one log line).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import queue as queue_mod
import signal
import time
from pathlib import Path
from typing import Any

from specring.shared import envs
from specring.shared.config.run_config import REPORT_BACKENDS
from specring.shared.errors import ConfigError
from specring.shared.run.run_dir import RunDir
from specring.shared.run.run_records import EvalRecord, MetricsRecord

log = logging.getLogger(__name__)

BACKENDS = REPORT_BACKENDS
QUEUE_RECORDS = 10_000   # records waiting for the tracker worker; one more is dropped (and counted)
CLOSE_WAIT_S = 8.0       # at the end, how long the worker may take to send what is queued and close its backends
DROP_LOG_EVERY_S = 30.0  # at most one line about dropped records per this many seconds
MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
INSTALL = {"tensorboard": "pip install tensorboard", "wandb": "pip install wandb",
           "mlflow": "pip install mlflow-skinny (or mlflow)"}


def parse_report_to(text: str | list[str] | None) -> list[str]:
    """``"none"``/``""``/None -> ``[]``; ``"tensorboard,wandb"`` -> the list. Raises ``ConfigError`` naming
    ``--report-to`` for an unknown backend."""
    items = text if isinstance(text, list) else [x.strip() for x in (text or "").split(",")]
    names = [x.lower() for x in items if x and x.lower() != "none"]
    bad = [x for x in names if x not in BACKENDS]
    if bad:
        raise ConfigError(f"--report-to: unknown backend(s) {bad} (known: none, {', '.join(BACKENDS)})")
    return list(dict.fromkeys(names))


def check_backends(names: list[str]) -> None:
    """Import each backend of ``names`` now, before any process starts; raise ``ConfigError`` naming
    ``--report-to`` and the install command for each one that is not installed (``ImportError``) or fails to
    import (any other error, named)."""
    problems = []
    for n in names:
        try:
            if importlib.util.find_spec(MODULES[n]) is None:
                raise ModuleNotFoundError(MODULES[n])
            importlib.import_module(MODULES[n])
            if n == "tensorboard":
                importlib.import_module("torch.utils.tensorboard")  # what _TensorBoard writes with
        except ImportError:
            problems.append(f"{n} is not installed ({INSTALL[n]})")
        except Exception as e:  # noqa: BLE001 - a broken installation: name it
            problems.append(f"{n} fails to import ({type(e).__name__}: {str(e)[:200]}; reinstall: {INSTALL[n]})")
    if problems:
        raise ConfigError("--report-to: " + "; ".join(problems))


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class _TensorBoard:
    def __init__(self, run_dir: Path, run_id: str, config: dict):
        from torch.utils.tensorboard import SummaryWriter
        self.w = SummaryWriter(str(RunDir(run_dir).tracker_dir("tensorboard")))
        self.w.add_text("config", json.dumps(config, indent=1))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.w.add_scalar(k, v, step)
        self.w.flush()

    def close(self) -> None:
        self.w.close()


class _Wandb:
    def __init__(self, run_dir: Path, run_id: str, config: dict):
        import wandb
        mode = envs.get("WANDB_MODE") or ("online" if envs.get("WANDB_API_KEY") else "offline")
        self.run = wandb.init(project=envs.get("WANDB_PROJECT", "specring"), name=run_id, id=run_id,
                              dir=str(run_dir), config=config, mode=mode, resume="allow", reinit=True)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class _Mlflow:
    def __init__(self, run_dir: Path, run_id: str, config: dict):
        import mlflow
        self.mlflow = mlflow
        uri = envs.get("MLFLOW_TRACKING_URI")
        if not uri:  # the default: a file store in the run directory (newer MLflow asks for an explicit opt-in)
            uri = RunDir(run_dir).tracker_dir("mlruns").resolve().as_uri()
            envs.set_default("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(envs.get("MLFLOW_EXPERIMENT_NAME", "specring"))
        self.run = mlflow.start_run(run_name=run_id)
        params = {k: str(v)[:500] for k, v in _flat(config).items()}
        for i in range(0, len(params), 90):  # the file store takes a bounded batch per call
            mlflow.log_params(dict(list(params.items())[i:i + 90]))

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(metrics, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


_CLASSES = {"tensorboard": _TensorBoard, "wandb": _Wandb, "mlflow": _Mlflow}


class JsonlTail:
    """New complete lines of a JSON-lines file since the last call (a line still being written waits).

    A file replaced (another inode) or shortened since the last call is read again from its start.
    ``wait_for_replace=True``: nothing is read while the file is the one that existed at construction (a
    resumed consumer rewrites ``metrics.jsonl`` without the steps after its checkpoint; until then its lines
    are the old run's)."""

    def __init__(self, path: Path, wait_for_replace: bool = False):
        self.path, self.offset = Path(path), 0
        self.inode = self._inode()
        self.stale_inode = self.inode if wait_for_replace else None

    def _inode(self) -> int | None:
        try:
            return os.stat(self.path).st_ino
        except OSError:
            return None

    def read(self) -> list[dict]:
        if not self.path.is_file():
            return []
        with open(self.path, "rb") as f:
            st = os.fstat(f.fileno())
            if self.stale_inode is not None and st.st_ino == self.stale_inode:
                return []
            if st.st_ino != self.inode or st.st_size < self.offset:
                self.inode, self.offset = st.st_ino, 0
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out


def train_metrics(m: MetricsRecord) -> dict[str, float]:
    """The tracked figures of one ``metrics.jsonl`` record (``train/...``), finite numbers only."""
    figures = {"loss": m.loss, "accept_proxy": m.family.get("accept_proxy"), "lr": m.lr, "grad_norm": m.grad_norm,
               "tokens_per_s": m.tokens_per_s}
    out = {f"train/{k}": v for k, v in figures.items() if isinstance(v, (int, float))}
    for key, name in (("per_slot_acc", "slot"), ("per_step_acc", "step")):
        for i, a in enumerate(m.family.get(key) or []):
            if isinstance(a, (int, float)):
                out[f"train/acc_{name}{i + (1 if name == 'slot' else 0)}"] = a
    return {k: float(v) for k, v in out.items() if math.isfinite(float(v))}


def _tracker_worker(inbox, outbox) -> None:
    """The tracker process (module docstring; ``python -m specring.supervisor.reporting --worker FD``): the first
    line of ``inbox`` (JSON lines) names the backends, run directory, run id and configuration; each backend
    starts, then every ``["log", metrics, step]`` line goes to each, until ``["close"]`` (or the end of
    ``inbox``); the backends close. What happened goes to ``outbox`` as JSON lines: ``["backend", name, state,
    level, log line]`` and, last, ``["stats", sent, failed]``. A backend that raises is dropped."""
    from specring.shared.process.procs import set_parent_death_signal, set_process_title
    set_parent_death_signal(signal.SIGKILL)
    set_process_title("sr-trackers")

    def say(*item) -> None:
        outbox.write(json.dumps(item) + "\n")
        outbox.flush()

    first = inbox.readline()
    if not first:
        return
    names, run_dir, run_id, config = json.loads(first)
    backends: dict[str, Any] = {}
    for n in names:
        try:
            backends[n] = _CLASSES[n](Path(run_dir), run_id, config)
            say("backend", n, "started", logging.INFO, f"report_to started backend={n}")
        except Exception as e:  # noqa: BLE001 - a tracker must never stop a run
            say("backend", n, "disabled", logging.ERROR,
                f"report_to backend={n} disabled error={type(e).__name__}: {e}")
    sent = failed = 0
    for line in inbox:
        item = json.loads(line)
        if item[0] == "close":
            break
        _, metrics, step = item
        if not backends:
            failed += 1
            say("stats", sent, failed)
            continue
        for n, b in list(backends.items()):
            try:
                b.log(metrics, int(step))
            except Exception as e:  # noqa: BLE001
                say("backend", n, "dropped", logging.ERROR,
                    f"report_to backend={n} dropped error={type(e).__name__}: {e}")
                backends.pop(n, None)
        sent += 1
        say("stats", sent, failed)
    for n, b in backends.items():
        try:
            b.close()
        except Exception as e:  # noqa: BLE001
            say("backend", n, "close_failed", logging.ERROR,
                f"report_to backend={n} close failed error={type(e).__name__}: {e}")
    say("stats", sent, failed)


class Reporter:
    """The run's trackers (module docstring). ``names`` from ``parse_report_to``; ``config``: the run's
    configuration (``RunConfig.to_dict()``), recorded once. With no names it does nothing and starts nothing.

    ``start_step`` (a resumed run: the step of the checkpoint it resumed from): records of earlier steps
    were reported by the run's previous start and are not sent again; ``metrics.jsonl`` is read only once
    the resumed consumer has rewritten it (``JsonlTail``).

    ``refresh`` and ``close`` never wait on a tracker: the backends live in a worker process
    (``_tracker_worker``, its output in ``RUN_DIR/logs/trackers.log``) fed by a writer thread from a queue of at most
    ``queue_records`` records; ``close`` waits at most ``close_wait_s`` seconds for it. ``pid`` is the worker's
    (None without trackers)."""

    def __init__(self, names: list[str], run_dir: str | Path, run_id: str, config: dict, start_step: int = 0,
                 queue_records: int = QUEUE_RECORDS, close_wait_s: float = CLOSE_WAIT_S):
        self.run_dir = Path(run_dir)
        run = RunDir(run_dir)
        self.names = list(names)
        self.close_wait_s = float(close_wait_s)
        self.start_step = int(start_step)
        self.metrics = JsonlTail(run.metrics_file, wait_for_replace=self.start_step > 0)
        self.evals = JsonlTail(run.eval_file)
        self.step = self.start_step
        self.queued = self.dropped = self.sent = self.failed = self.not_sent = 0
        self.backends: dict[str, str] = {}   # name -> "started" / "disabled" / "dropped", as the worker says
        self.proc = None
        self._last_drop_log = 0.0
        self._closed = False
        if not self.names:
            return
        self._start(run_id, config, queue_records)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def _start(self, run_id: str, config: dict, queue_records: int) -> None:
        import subprocess
        import sys
        import threading

        from specring.shared.paths import IMPORT_ROOT

        env = dict(os.environ, **{envs.known("PYTHONUNBUFFERED"): "1"})
        env["PYTHONPATH"] = str(IMPORT_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env.pop(envs.RUN_ID, None)
        read_fd, write_fd = os.pipe()
        run = RunDir(self.run_dir)
        run.logs_dir.mkdir(parents=True, exist_ok=True)
        with open(run.log_file("trackers"), "ab") as logf:
            # a session of its own: a terminal's Ctrl-C or hang-up reaches the launcher only, which decides
            self.proc = subprocess.Popen([sys.executable, "-m", "specring.supervisor.reporting", "--worker",
                                          str(write_fd)], stdin=subprocess.PIPE, stdout=logf, stderr=subprocess.STDOUT,
                                         pass_fds=(write_fd,), start_new_session=True, env=env)
        os.close(write_fd)
        self._events = os.fdopen(read_fd, "r", encoding="utf-8", errors="replace")
        self._outq: queue_mod.Queue = queue_mod.Queue(maxsize=max(1, int(queue_records)))
        self._inq: queue_mod.Queue = queue_mod.Queue()
        self._outq.put_nowait(json.dumps([self.names, str(self.run_dir), run_id, config], default=str))
        self._writer = threading.Thread(target=self._write_loop, name="report-writer", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="report-reader", daemon=True)
        self._writer.start()
        self._reader.start()
        log.info("report_to worker pid=%d backends=%s", self.proc.pid, ",".join(self.names))

    def _write_loop(self) -> None:
        """The writer thread: the queued lines to the worker's stdin (the only place that may block on it)."""
        try:
            while True:
                line = self._outq.get()
                if line is None:
                    break
                self.proc.stdin.write((line + "\n").encode())
                self.proc.stdin.flush()
            self.proc.stdin.close()
        except (OSError, ValueError):  # the worker is gone
            pass

    def _read_loop(self) -> None:
        """The reader thread: what the worker says, for ``_drain``."""
        try:
            for line in self._events:
                try:
                    self._inq.put(json.loads(line))
                except ValueError:
                    continue
        except (OSError, ValueError):
            pass

    def _send(self, metrics: dict[str, float], step: int) -> None:
        if self.proc is None or self._closed:
            return
        try:
            self._outq.put_nowait(json.dumps(["log", metrics, int(step)]))
            self.queued += 1
        except queue_mod.Full:   # the worker is stuck on a tracker that does not answer: drop, count, go on
            self.dropped += 1
            now = time.monotonic()
            if now - self._last_drop_log >= DROP_LOG_EVERY_S:
                self._last_drop_log = now
                log.warning("report_to dropped=%d records: the tracker worker is behind (a tracker that does not "
                            "answer?); training goes on", self.dropped)

    def _drain(self) -> None:
        """Take what the worker said: its log lines and, at the end, its counts."""
        if self.proc is None:
            return
        while True:
            try:
                item = self._inq.get_nowait()
            except queue_mod.Empty:
                return
            if item[0] == "backend" and len(item) == 5:
                _, name, state, level, text = item
                self.backends[str(name)] = str(state)
                log.log(int(level), "%s", text)
            elif item[0] == "stats" and len(item) == 3:
                self.sent, self.failed = int(item[1]), int(item[2])

    def refresh(self, pipeline: dict[str, float] | None = None) -> None:
        """Queue what is new in ``metrics.jsonl``/``eval.jsonl`` and the supervisor's ``pipeline`` figures
        (``pipeline/tokens_per_s``, ``pipeline/ring{i}_ready``, ``pipeline/restarts``, ...) for the worker; never
        blocks."""
        if self.proc is None:
            return
        self._drain()
        for m in [MetricsRecord.from_json(d) for d in self.metrics.read() if isinstance(d, dict)]:
            step = int(m.step or 0)
            if step < self.start_step:
                continue
            self.step = max(self.step, step)
            figures = train_metrics(m)
            if figures:
                self._send(figures, step)
        for e in [EvalRecord.from_json(d) for d in self.evals.read() if isinstance(d, dict)]:
            if self.start_step and int(e.step or 0) <= self.start_step:
                continue
            if isinstance(e.tau_mean, (int, float)):
                self._send({"eval/tau": float(e.tau_mean)}, int(e.step or 0))
        if pipeline:
            self._send({k: float(v) for k, v in pipeline.items() if v is not None}, self.step)

    def close(self, pipeline: dict[str, float] | None = None) -> None:
        """A last ``refresh``, then the worker sends what is queued and closes its backends, within
        ``close_wait_s`` seconds; past that it is killed (with what it started: its process group) and the records
        it had not sent are counted (``not_sent``) and logged."""
        if self.proc is None or self._closed:
            return
        self.refresh(pipeline)
        self._closed = True
        deadline = time.monotonic() + self.close_wait_s
        ends = [json.dumps(["close"]), None]
        while time.monotonic() < deadline and self.proc.poll() is None:
            while ends:   # the end of the queue, once there is room for it
                try:
                    self._outq.put_nowait(ends[0])
                    ends.pop(0)
                except queue_mod.Full:
                    break
            time.sleep(0.02)
        if self.proc.poll() is None:
            self._drain()
            self.not_sent = max(0, self.queued - self.sent - self.failed)
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
            self.proc.wait(timeout=5)
            log.error("report_to worker did not finish within %.0f s (a tracker that does not answer?): killed; "
                      "records not sent: %d, dropped before: %d", self.close_wait_s, self.not_sent, self.dropped)
        else:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # what a backend left running in its group (a service)
            except (ProcessLookupError, PermissionError):
                pass
        self._reader.join(timeout=1)
        self._drain()
        if self.dropped or self.not_sent or self.failed:
            log.warning("report_to sent=%d dropped=%d failed=%d not_sent=%d", self.sent, self.dropped, self.failed,
                        self.not_sent)

    def stats(self) -> dict[str, Any]:
        """What the trackers got: backends (``started``, ``disabled``, ``dropped`` as the worker said), records
        queued, dropped at a full queue, sent, failed (no backend left), not sent (the worker killed at close)."""
        return {"backends": dict(self.backends), "queued": self.queued, "dropped": self.dropped, "sent": self.sent,
                "failed": self.failed, "not_sent": self.not_sent}


def _worker_main(argv: list[str]) -> int:
    """``python -m specring.supervisor.reporting --worker FD``: ``_tracker_worker`` on stdin and file ``FD``."""
    import sys
    if len(argv) != 2 or argv[0] != "--worker":
        print("usage: python -m specring.supervisor.reporting --worker FD", file=sys.stderr)
        return 2
    with os.fdopen(int(argv[1]), "w", encoding="utf-8") as outbox:
        _tracker_worker(sys.stdin, outbox)
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(_worker_main(sys.argv[1:]))
