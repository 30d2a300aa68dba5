"""Process plumbing: spawning children, the one template for every child's main, and shutdown.

Children are started with ``subprocess.Popen([python, -m, module, ...], start_new_session=True)``: a fresh
interpreter (no fork of a process that holds CUDA or ZeroMQ state) in a process group of its own, so the
supervisor can kill a child together with anything it started. On Linux each child asks for SIGKILL when
its parent dies (``PR_SET_PDEATHSIG``) and also watches ``getppid()`` as a fallback, so no child outlives a
supervisor that was killed with SIGKILL.

What a child starts (target code's helpers, compile workers) must not outlive it: the supervisor kills the
child's process group whenever the child has exited, and, being a child subreaper
(``PR_SET_CHILD_SUBREAPER``), gets back every orphaned descendant, also those that left the group with
``setsid``. Every child and everything it starts carries the run id in its environment
(``SPECRING_RUN_ID``): by it ``kill_orphans`` tells the run's orphans (killed and reaped) from other
processes that a supervisor running as a container's pid 1 inherits (only reaped), and the next start or
``launch.py clean`` finds what survived a SIGKILLed supervisor (``sweep_run_processes``).

``child_main`` is the usual template of a long-running child process: process title, signal handlers that only
set a flag, the body inside try/finally, a fatal error reported to the coordinator before exiting.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil
import zmq

from specring.shared import envs
from specring.shared.config.run_config import RunConfig
from specring.shared.paths import IMPORT_ROOT
from specring.shared.process.balance import DutyClock
from specring.shared.process.logs import configure_logging
from specring.shared.run.run_dir import RunDir
from specring.shared.run.run_records import Topology
from specring.shared.transport import channel, messages
from specring.shared.transport.stats import ChildStats, parse_stats, stats_class

log = logging.getLogger(__name__)

PR_SET_NAME = 15
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
RUN_ID_ENV = envs.RUN_ID  # set in every child's environment; inherited by whatever it starts
EXIT_OK, EXIT_ERROR = 0, 1

# The terminating signals a launcher meets in practice and can catch, each a graceful stop (as torchrun's agent
# treats SIGINT, SIGTERM, SIGHUP and SIGQUIT): Ctrl-C, kill / Kubernetes / Slurm's time limit, a closed terminal
# or a dropped ssh session, Ctrl-\, Slurm's `--signal` and LSF's warning signals (SIGUSR1/2), a CPU-time limit,
# a power-failure notice. SIGKILL and SIGSTOP cannot be caught; SIGPIPE and SIGXFSZ Python ignores (a write fails
# instead); SIGALRM, SIGPROF and SIGVTALRM are left to timers and profilers.
STOP_SIGNALS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGXCPU",
                                       "SIGPWR") if hasattr(signal, name))


def install_stop_handlers(handler) -> dict:
    """Install ``handler(signum, frame)`` for every signal of ``STOP_SIGNALS``; returns the handlers it replaced
    (``restore_handlers`` puts them back). Only the main thread may call it (``signal.signal``)."""
    return {s: signal.signal(s, handler) for s in STOP_SIGNALS}


def restore_handlers(old: dict) -> None:
    """Put back the handlers ``install_stop_handlers`` replaced."""
    for s, h in old.items():
        signal.signal(s, h if h is not None else signal.SIG_DFL)


def _prctl(option: int, arg: int) -> bool:
    if sys.platform.startswith("linux"):
        try:
            return ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0) == 0
        except (OSError, AttributeError):
            pass
    return False


def set_process_title(title: str) -> None:
    """Set the process name shown by ``ps -o comm``/``top`` (Linux: first 15 bytes)."""
    if sys.platform.startswith("linux"):
        buf = ctypes.create_string_buffer(title.encode()[:15])
        try:
            ctypes.CDLL(None).prctl(PR_SET_NAME, buf, 0, 0, 0)
        except (OSError, AttributeError):
            pass


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent exits (Linux only)."""
    _prctl(PR_SET_PDEATHSIG, int(sig))


def become_subreaper() -> bool:
    """Make this process the child subreaper of its descendants (Linux ``PR_SET_CHILD_SUBREAPER``): a
    descendant whose parent dies becomes this process's child instead of init's, so ``kill_orphans`` can
    find it. Returns whether it took effect (False elsewhere than Linux)."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def kill_orphans(keep: set[int], run_id: str) -> tuple[list[tuple[int, str]], int]:
    """SIGKILL every child of this process that is not in ``keep`` and carries ``SPECRING_RUN_ID=run_id``;
    reap every child not in ``keep`` that has exited.

    With ``become_subreaper()`` such children are orphans: descendants whose own parent is gone (a dead
    child's helpers, a daemon that double-forked). Others (a supervisor that is pid 1 of a container gets
    every orphan of the container) are reaped when they exit, never killed. Never blocks: one still dying
    is reaped by a later call. Returns ``([(pid, command line)] signalled now, number of this run's orphans
    not yet reaped)``.
    """
    try:
        kids = psutil.Process().children()
    except psutil.Error:
        return [], 0
    killed, pending = [], 0
    for p in kids:
        if p.pid in keep:
            continue
        try:
            ours = p.status() != psutil.STATUS_ZOMBIE and p.environ().get(RUN_ID_ENV) == run_id
            if ours:
                cmd = " ".join(p.cmdline())[:200]
                p.kill()  # psutil checks that the pid still names this very process
                killed.append((p.pid, cmd))
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            ours = False
        except psutil.AccessDenied:
            ours = False
            log.warning("kill_orphan pid=%d failed=access_denied", p.pid)
        try:
            if os.waitpid(p.pid, os.WNOHANG)[0] == 0 and ours:
                pending += 1
        except ChildProcessError:
            pass
    return killed, pending


def sweep_run_processes(run_alive: Callable[[str], bool]) -> list[tuple[int, str, str]]:
    """SIGKILL processes that carry ``SPECRING_RUN_ID`` of a run for which ``run_alive(run_id)`` is False:
    what a SIGKILLed supervisor's children had started. Returns ``[(pid, run id, command line)]``.

    Only processes this user may read are seen (others are skipped), and only in this PID namespace.
    """
    out, me, alive = [], os.getpid(), {}
    for p in psutil.process_iter():
        if p.pid == me:
            continue
        try:
            rid = p.environ().get(RUN_ID_ENV)
            if not rid:
                continue
            if rid not in alive:
                alive[rid] = run_alive(rid)
            if alive[rid]:
                continue
            cmd = " ".join(p.cmdline())[:200]
            p.kill()
            out.append((p.pid, rid, cmd))
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
    return out


@dataclass
class ChildContext:
    """Handed to a child's body: its identity, configuration, socket, and the stop flag.

    Liveness: after ``ready()`` a thread of its own sends a ``Heartbeat`` every
    ``monitor.heartbeat_interval_s``, also while the main thread is busy (a forward, a training step, a
    checkpoint) for longer than ``hang_timeout_s``. Each heartbeat says what the main thread is doing and for
    how long (``work``: e.g. ``"batch 17"``, ``""`` when idle; ``work_s``: seconds in that piece of work, or
    since the main loop last turned when idle), so the monitor still finds a main thread that is stuck while
    the heartbeat thread runs (``supervisor.monitor``). The body marks its work with ``working()`` and calls
    ``tick()`` once per turn of its loop. A process that is stopped (SIGSTOP) or stuck holding the GIL sends
    no heartbeat at all.

    Balance: the time inside outermost ``working()`` blocks is the process's busy time (``duty``, a
    ``shared.process.balance.DutyClock``); every heartbeat carries ``busy_s``, ``window_s`` and ``idle_tail_s``, from
    which the supervisor derives a producer's duty cycle and a consumer's starvation.

    The socket is used by both threads, never at once (``_sock_lock``); use ``send``/``recv``, not ``sock``.
    """
    role: str
    index: int
    generation: int
    run_dir: str
    config: RunConfig
    topology: Topology
    sock: zmq.Socket
    stop_reason: str = ""
    said_hello: bool = False
    parent_pid: int = field(default_factory=os.getppid)
    stats: Callable[[], ChildStats | dict] | None = None   # the role's heartbeat figures (shared.transport.stats)
    _work: tuple[str, float] = field(default_factory=lambda: ("", time.monotonic()))  # (what, since): one store
    duty: DutyClock = field(default_factory=DutyClock, repr=False)  # busy time of the main thread (balance)
    _sock_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _hb_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _hb_stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _hb_thread: threading.Thread | None = None

    @property
    def stopping(self) -> bool:
        """True once SIGTERM/SIGINT arrived, a Shutdown was received, or the parent is gone."""
        if not self.stop_reason and os.getppid() != self.parent_pid:
            self.stop_reason = "parent exited"
        return bool(self.stop_reason)

    def send(self, msg, block: bool = True) -> bool:
        """Send ``msg`` to the coordinator; returns False only when ``block`` is False and the queue is full."""
        with self._sock_lock:
            try:
                channel.send(self.sock, msg, block=block)
            except zmq.Again:
                if block:
                    raise
                return False
        return True

    def recv(self, timeout_s: float | None):
        """The next message from the coordinator, ``None`` after ``timeout_s`` (see ``channel.recv``)."""
        with self._sock_lock:
            return channel.recv(self.sock, timeout_s)

    # ------------------------------------------------------------------ liveness
    def tick(self) -> None:
        """The main loop turned (call once per turn): an idle main thread is not stuck."""
        if not self._work[0]:
            self._work = ("", time.monotonic())

    @contextmanager
    def working(self, what: str):
        """Mark the main thread busy with ``what`` (e.g. ``"batch 17"``) for the ``with`` block; the monitor
        then allows it ``batch_timeout_s`` instead of ``hang_timeout_s``. Nested, the outer work (and its
        clock) is back when the inner block ends."""
        outer = self._work
        self._work = (what or "work", time.monotonic())
        self.duty.start()
        try:
            yield
        finally:
            self.duty.stop()
            self._work = outer if outer[0] else ("", time.monotonic())

    def progress(self, what: str) -> None:
        """Inside ``working()``: the main thread moved on to a new piece of the work (``what``, e.g. the next
        prompt of an evaluation); its clock starts again."""
        if self._work[0]:
            self._work = (what or "work", time.monotonic())

    def work_stats(self) -> dict:
        """``{"work": what the main thread is doing ("" idle), "work_s": for how long, in seconds}``."""
        what, since = self._work
        return {"work": what, "work_s": round(time.monotonic() - since, 3)}

    def heartbeat(self, block: bool = True) -> bool:
        """Send one ``Heartbeat`` now: the role's figures (``stats()``: a ``shared.transport.stats`` class, or a flat
        map read with ``parse_stats``), ``work_stats()`` and the balance figures, as the role's stats class
        (``to_wire``). Returns False if it was not queued (``block`` False and the queue full)."""
        with self._hb_lock:
            figures = stats_class(self.role)()
            if self.stats is not None:
                try:
                    figures = parse_stats(self.role, self.stats())
                except Exception as e:  # figures are optional; the heartbeat is not
                    figures = stats_class(self.role)(stats_error=f"{type(e).__name__}: {e}"[:200])
            figures = dataclasses.replace(figures, **self.work_stats(), **self.duty.figures())
            return self.send(messages.Heartbeat(role=self.role, index=self.index, generation=self.generation,
                                                pid=os.getpid(), stats=figures.to_wire()), block=block)

    def _heartbeats(self) -> None:
        interval_s = self.config.monitor.heartbeat_interval_s
        while not self._hb_stop.wait(interval_s):
            try:
                self.heartbeat(block=False)  # a full queue means the supervisor is not reading: skip one
            except Exception as e:  # the socket is closing; never let the thread die with a traceback
                if not self._hb_stop.is_set():
                    log.warning("heartbeat_failed error=%s: %s", type(e).__name__, e)

    def stop_heartbeats(self) -> None:
        """Stop the heartbeat thread and wait for it (before the socket is closed)."""
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=10)
            self._hb_thread = None

    def ready(self) -> None:
        """Say ``Hello``: the child is loaded and can take work, and start the heartbeat thread. Call once,
        after the slow start-up (model loading), so the monitor's hang clock starts only then
        (``startup_timeout_s`` covers the time before). Set ``stats`` first."""
        if not self.said_hello:
            self.send(messages.Hello(role=self.role, index=self.index, generation=self.generation, pid=os.getpid()))
            self.said_hello = True
            self.tick()
            self._hb_thread = threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True)
            self._hb_thread.start()


def peer_identity(role: str, index: int, generation: int) -> str:
    """The ZeroMQ routing identity of one child incarnation: ``<role>-<index>-g<generation>``.

    Each incarnation has its own identity, so a restarted producer never collides with the socket of the
    one it replaces, and a message still in flight from a dead incarnation is recognisable as stale.
    """
    return f"{role}-{index}-g{generation}"


def parse_identity(identity: bytes) -> tuple[str, int, int] | None:
    """``(role, index, generation)`` of an identity made by ``peer_identity``; None for anything else,
    including other spellings of the same numbers (leading zeros, a trailing newline, non-ASCII digits),
    which ZeroMQ would treat as different peers."""
    m = _IDENTITY_RE.fullmatch(identity.decode(errors="replace"))
    if not m:
        return None
    parsed = (m["role"], int(m["index"]), int(m["gen"]))
    return parsed if peer_identity(*parsed).encode() == identity else None


_IDENTITY_RE = re.compile(r"(?P<role>producer|consumer)-(?P<index>[0-9]+)-g(?P<gen>[0-9]+)")


def child_argv(module: str, run_dir: str, index: int, generation: int) -> list[str]:
    """Command line that starts a child: ``python -m <module> --run-dir R --index I --generation G``."""
    return [sys.executable, "-m", module, "--run-dir", str(run_dir), "--index", str(index),
            "--generation", str(generation)]


def spawn_child(module: str, run_dir: str, index: int, generation: int, log_path: str | Path,
                env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a child process in its own process group, its stdout/stderr appended to ``log_path``."""
    full_env = dict(os.environ)  # the child imports the same specring, installed or from a checkout
    full_env["PYTHONPATH"] = str(IMPORT_ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    if env:
        full_env.update(env)
    with open(log_path, "ab") as logf:
        return subprocess.Popen(child_argv(module, run_dir, index, generation), stdin=subprocess.DEVNULL,
                                stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                                env=full_env)


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to ``proc``'s whole process group (ignoring a group that is already gone)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass


def terminate(proc: subprocess.Popen, timeout_s: float) -> int:
    """SIGTERM the child's group, wait up to ``timeout_s``, then SIGKILL and reap; returns the exit code."""
    if proc.poll() is None:
        kill_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("kill pid=%d reason=terminate_timeout timeout_s=%.1f", proc.pid, timeout_s)
    if proc.poll() is None:
        kill_group(proc, signal.SIGKILL)
        proc.wait()
    else:
        kill_group(proc, signal.SIGKILL)  # stragglers of its group
    return proc.returncode


def child_main(role: str, module_doc: str, body: Callable[[ChildContext], None],
               argv: list[str] | None = None) -> int:
    """The template every child's ``main`` follows; returns the exit code.

    Parses ``--run-dir/--index/--generation``, sets the title and parent-death signal, installs
    handlers of ``STOP_SIGNALS`` (SIGTERM, SIGINT, SIGHUP, ...) that only set the stop flag, connects the DEALER
    socket, runs ``body(ctx)``
    inside try/finally, and on an exception sends a fatal ``Error`` to the coordinator before exiting 1; a
    body that returns is followed by one last ``Heartbeat`` (its final figures). The body calls
    ``ctx.ready()`` (which sends ``Hello`` and starts the heartbeat thread) once it can take work; the thread
    is stopped before the socket is closed.
    """
    ap = argparse.ArgumentParser(description=module_doc)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--generation", type=int, default=1)
    args = ap.parse_args(argv)
    name = f"{role}-{args.index}"
    set_parent_death_signal(signal.SIGKILL)
    set_process_title(f"sr-{role[:4]}{args.index}")
    configure_logging(f"{name}/g{args.generation}")
    run = RunDir(args.run_dir)
    config = run.read_config()
    topology = run.read_topology()
    if os.getppid() != topology.supervisor_pid:
        log.error("exit reason=parent_gone supervisor_pid=%d", topology.supervisor_pid)
        return EXIT_ERROR
    zctx = zmq.Context()
    sock = channel.connect_dealer(zctx, topology.address, peer_identity(role, args.index, args.generation))
    ctx = ChildContext(role=role, index=args.index, generation=args.generation, run_dir=args.run_dir,
                       config=config, topology=topology, sock=sock)

    def on_signal(signum, _frame):
        ctx.stop_reason = signal.Signals(signum).name

    install_stop_handlers(on_signal)  # every terminating signal it can catch: a graceful stop, as SIGTERM
    code = EXIT_OK
    try:
        body(ctx)
        if ctx.said_hello:
            ctx.heartbeat(block=False)  # the last figures (balance: the busy time up to the exit)
        log.info("exit reason=%s", ctx.stop_reason or "done")
    except BaseException as e:  # report everything, SystemExit included, then exit non-zero
        code = EXIT_ERROR
        text = f"{type(e).__name__}: {e}"
        log.error("fatal %s\n%s", text, traceback.format_exc())
        try:
            ctx.send(messages.Error(role=role, index=args.index, generation=args.generation,
                                    message=text[:4000], fatal=True))
        except Exception:
            pass
    finally:
        ctx.stop_heartbeats()
        sock.close(linger=channel.LINGER_MS)
        zctx.term()
    return code
