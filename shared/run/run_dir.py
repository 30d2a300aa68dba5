"""The run directory: what a run writes there, who writes it and when, and how to read it back (``RunDir``).

A run directory (``--run-dir``, by default ``runs/<UTC time>``, with ``runs/latest`` pointing at the newest) holds
everything a run leaves. ``RunDir(path)`` is the one place that knows its names: every path is a property, and it
claims the directory for a launcher, says whether a run is going there, moves ``runs/latest`` and reads and writes
the records, typed by ``shared.run.run_records`` (the configuration by ``shared.config.run_config.RunConfig``). Every
other module asks it instead of joining names. Nothing here imports torch: ``status`` and ``clean`` use it too.

| file | written by, when | format | record |
| --- | --- | --- | --- |
| ``.lock`` | the launcher (``claim``), its ``flock`` held for the life of the run | empty | (the lock) |
| ``data.json`` | the launcher, claiming a run without a checkpoint | JSON | ``supervisor.resume.data_record`` |
| ``draft_vocab.safetensors`` | the launcher, before an EAGLE-3 run | safetensors | ``shared.drafters.draft_vocab`` |
| ``config.json`` | the supervisor, at start | JSON, indent 1 | ``RunConfig`` |
| ``topology.json`` | the supervisor, at start (atomic) | JSON, indent 1 | ``Topology`` |
| ``coord.sock`` | the supervisor binds it at start, removes it at exit (¹) | ipc socket | the coordinator's ROUTER |
| ``status.json`` | the supervisor, about once a second (atomic) | JSON | ``StatusFile`` of ``StatusRow`` |
| ``timeseries.jsonl`` | the supervisor: samples, lifecycle events | JSON lines | ``supervisor.timeseries`` |
| ``summary.json`` | the supervisor, at the end of each session (atomic) | JSON, indent 1 | ``Summary`` |
| ``metrics.jsonl`` | consumer rank 0, a line per optimizer step (cut on resume) | JSON lines | ``MetricsRecord`` |
| ``eval.jsonl`` | the τ evaluator, a line per evaluation or failure | JSON lines | ``EvalRecord`` |
| ``logs/`` | the supervisor's, one per child, the trackers' (``log_file``) | text | ``shared.process.logs`` |
| ``checkpoints/`` | consumer rank 0: ``step-NNNNNN/``, ``latest`` | safetensors | ``shared.drafters.checkpoint`` |
| ``tau/`` | consumer rank 0: weights of a τ evaluation between checkpoints (deleted once read) | safetensors | - |
| ``report/`` | ``train`` at the end of a run, ``launch.py report`` | HTML, PNG | ``supervisor.report`` |
| ``tensorboard/``, ``wandb/``, ``mlruns/`` | the trackers (``--report-to``) | theirs | ``supervisor.reporting`` |

¹ In a run directory whose path is too long for an ipc socket, the socket goes to this user's private directory
(``socket_file``).

``runs/latest`` (beside the run directories, ``latest_link``) points at the newest run that passed its start-up
checks (``point_latest``).

A run directory is held by a live launcher exactly while its ``flock`` on ``.lock`` is held (``held``): the kernel
says so, whatever PID namespace the launcher runs in and whatever pid ``topology.json`` records, and drops the lock
when the launcher dies (``kill -9`` included). ``status`` and ``clean`` ask the same lock.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import secrets
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from specring.shared import paths
from specring.shared.errors import ConfigError
from specring.shared.run.run_records import (
    EvalRecord,
    MetricsRecord,
    StatusFile,
    Summary,
    Topology,
    append_line,
    read_lines,
)

if TYPE_CHECKING:
    from specring.shared.config.run_config import RunConfig

LOCK_FILE = ".lock"
CONFIG_FILE = "config.json"
DATA_FILE = "data.json"
TOPOLOGY_FILE = "topology.json"
SOCKET_FILE = "coord.sock"
STATUS_FILE = "status.json"
SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"
TIMESERIES_FILE = "timeseries.jsonl"
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"
LOGS_DIR = "logs"
CHECKPOINTS_DIR = "checkpoints"
TAU_DIR = "tau"
REPORT_DIR = "report"
LATEST_LINK = "latest"
# inside a checkpoints directory (``shared.drafters.checkpoint`` writes them): the weights of a step directory, and
# the file naming the newest complete one
WEIGHTS_FILE = "drafter.safetensors"
LATEST_FILE = "latest"
# what a run writes into its directory: files, then directories (a --run-dir that would replace an input is refused)
RECORD_FILES = (CONFIG_FILE, SUMMARY_FILE, DATA_FILE, STATUS_FILE, TOPOLOGY_FILE, METRICS_FILE, EVAL_FILE,
                DRAFT_VOCAB_FILE, TIMESERIES_FILE, SOCKET_FILE, LOCK_FILE)
RECORD_DIRS = (CHECKPOINTS_DIR, LOGS_DIR, "tensorboard", "wandb", "mlruns")
# the records of a start that saved no checkpoint: void once its weights are gone (``forget_void_records``)
VOID_RECORDS = (METRICS_FILE, EVAL_FILE, SUMMARY_FILE)
CLAIM_RETRY_S = 1.0  # how long claim() retries a lock that a momentary held() probe elsewhere may hold


def private_socket_dir() -> Path:
    """``<tempdir>/specring-<uid>``: where the ipc socket of a run directory too deep for one goes
    (``RunDir.socket_file``)."""
    return Path(tempfile.gettempdir()) / f"specring-{os.getuid()}"


def make_private_socket_dir() -> Path:
    """Make ``private_socket_dir()`` (mode 0700) if missing and return it. Raises ``ValueError`` naming it when it
    is a link, not a directory, not this user's, or open to others: a socket there could be taken over."""
    d = private_socket_dir()
    try:
        d.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ValueError(f"{d} (for the ipc sockets of run directories whose paths are too long) must be a "
                         f"directory of this user with mode 0700; remove it, or use a shorter --run-dir or --tcp")
    return d


class RunDir:
    """One run directory at ``path`` (see the module docstring for what it holds). A value: creating one touches
    nothing on disk; ``str()`` and ``os.fspath()`` give its path."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, RunDir) and other.path == self.path

    def __hash__(self) -> int:
        return hash(self.path)

    @classmethod
    def of_checkpoint(cls, step_dir: str | os.PathLike) -> "RunDir":
        """The run directory that holds the checkpoint ``RUN_DIR/checkpoints/step-N`` (resolved; whether it is
        one says ``is_run``)."""
        return cls(Path(step_dir).resolve().parent.parent)

    # ------------------------------------------------------------------ files and directories
    @property
    def is_run(self) -> bool:
        """Whether a run was started here (its ``config.json`` exists)."""
        return self.config_file.is_file()

    @property
    def lock_file(self) -> Path:
        return self.path / LOCK_FILE

    @property
    def config_file(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def data_file(self) -> Path:
        return self.path / DATA_FILE

    @property
    def topology_file(self) -> Path:
        return self.path / TOPOLOGY_FILE

    @property
    def socket_file(self) -> Path:
        """The coordinator's ipc socket: ``RUN_DIR/coord.sock``; when that absolute path is longer than an ipc
        socket's may be (``paths.IPC_PATH_MAX`` characters: Linux's ``sun_path`` is 108 bytes), the same socket in this
        user's private directory instead, ``<tempdir>/specring-<uid>/<hash of the run directory>.sock``: the same
        path for the same run directory, so a restart, ``status`` and ``clean`` find it. Computed only;
        ``coordinator_address`` makes the private directory."""
        here = Path(os.path.abspath(self.path / SOCKET_FILE))
        if len(str(here)) <= paths.IPC_PATH_MAX:
            return here
        digest = hashlib.sha256(str(here.parent).encode()).hexdigest()[:20]
        return private_socket_dir() / f"{digest}.sock"

    @property
    def status_file(self) -> Path:
        return self.path / STATUS_FILE

    @property
    def summary_file(self) -> Path:
        return self.path / SUMMARY_FILE

    @property
    def metrics_file(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def eval_file(self) -> Path:
        return self.path / EVAL_FILE

    @property
    def timeseries_file(self) -> Path:
        return self.path / TIMESERIES_FILE

    @property
    def draft_vocab_file(self) -> Path:
        return self.path / DRAFT_VOCAB_FILE

    @property
    def logs_dir(self) -> Path:
        return self.path / LOGS_DIR

    def log_file(self, name: str) -> Path:
        """``logs/<name>.log`` (``supervisor``, ``producer-0``, ``consumer-1``, ``trackers``)."""
        return self.logs_dir / f"{name}.log"

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / CHECKPOINTS_DIR

    @property
    def checkpoint_pointer(self) -> Path:
        """``checkpoints/latest``: the file naming the newest complete checkpoint (``shared.drafters.checkpoint``)."""
        return self.checkpoints_dir / LATEST_LINK

    def checkpoint_dir(self, step: int) -> Path:
        """``checkpoints/step-NNNNNN`` of optimizer step ``step`` (it may not exist)."""
        return self.checkpoints_dir / f"step-{int(step):06d}"

    def checkpoint_names(self) -> list[str]:
        """The names of the ``step-*`` directories under ``checkpoints/``, sorted (``[]`` without any)."""
        d = self.checkpoints_dir
        return sorted(p.name for p in d.glob("step-*") if p.is_dir()) if d.is_dir() else []

    @property
    def tau_dir(self) -> Path:
        """``tau/``: weights of τ evaluations between checkpoints (``tau/step-NNNNNN.safetensors``)."""
        return self.path / TAU_DIR

    @property
    def report_dir(self) -> Path:
        return self.path / REPORT_DIR

    def tracker_dir(self, name: str) -> Path:
        """The directory of a tracker of ``--report-to``: ``tensorboard``, ``wandb`` or ``mlruns`` (mlflow)."""
        return self.path / name

    def records(self, dirs: bool = True) -> dict[str, Path]:
        """Everything a run writes here (``RECORD_FILES``, then, with ``dirs``, ``RECORD_DIRS``),
        ``description -> path``, as ``shared.config.outputs.check_outputs`` takes it (a directory's description ends in
        ``directory``)."""
        out = {f"run record {name}": self.path / name for name in RECORD_FILES}
        if dirs:
            out.update({f"run's {name} directory": self.path / name for name in RECORD_DIRS})
        return out

    def coordinator_address(self, tcp: str = "") -> str:
        """The coordinator's endpoint: ``tcp`` when given, else ``ipc://`` of ``socket_file`` (absolute), making
        the private directory that a long run directory's socket goes to. Raises ``ValueError`` when even that path
        is too long for an ipc socket (a very long ``TMPDIR``; ``shared.transport.channel``) or when the private
        directory is not this user's alone."""
        from specring.shared.transport.channel import coordinator_address
        sock = self.socket_file
        if not tcp and sock.parent == private_socket_dir():
            make_private_socket_dir()
        return coordinator_address(sock, tcp)

    # ------------------------------------------------------------------ runs/ and runs/latest
    @staticmethod
    def latest_link() -> Path:
        """``./runs/latest``: the link to the newest run, and the default of ``status``/``restart``/``--resume``."""
        return paths.runs_dir() / LATEST_LINK

    @classmethod
    def new_default(cls) -> "RunDir":
        """A fresh ``./runs/<UTC time>`` (``%Y%m%d-%H%M%S``; nothing is created)."""
        return cls(paths.runs_dir() / time.strftime("%Y%m%d-%H%M%S", time.gmtime()))

    @staticmethod
    def under_runs() -> list["RunDir"]:
        """Every entry of ``./runs`` (sorted by name), ``latest`` included."""
        return [RunDir(p) for p in sorted(paths.runs_dir().glob("*"))]

    def point_latest(self) -> None:
        """Point ``runs/latest`` at this directory (by its name: it is one under ``runs/``), atomically. Raises
        ``ConfigError`` naming ``--run-dir`` when the link cannot be replaced."""
        latest = self.latest_link()
        latest.parent.mkdir(parents=True, exist_ok=True)
        tmp = latest.with_name(f".latest-{secrets.token_hex(8)}")  # not the pid: launchers in containers share it
        if tmp.is_symlink():
            tmp.unlink()
        tmp.symlink_to(self.path.name)
        try:
            os.replace(tmp, latest)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise ConfigError(f"--run-dir: cannot point {latest} at {self.path}: {e}") from None

    # ------------------------------------------------------------------ the lock and liveness
    def claim(self, retry_s: float = CLAIM_RETRY_S) -> IO:
        """Create the directory and take an exclusive ``flock`` on ``.lock`` for this launcher; returns the open
        lock file: keep it open for the life of the run (closing it releases the run directory; the kernel drops
        it if the process dies). Retries for ``retry_s`` seconds (a ``held()`` probe elsewhere holds a shared lock
        for a moment). Raises ``ConfigError`` naming ``--run-dir`` when another launcher holds it."""
        self.path.mkdir(parents=True, exist_ok=True)
        lock = open(self.lock_file, "a")
        deadline = time.monotonic() + retry_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return lock
            except OSError:
                if time.monotonic() >= deadline:
                    lock.close()
                    raise ConfigError(f"--run-dir: another launcher is starting or running in {self.path}") from None
                time.sleep(0.02)

    def held(self) -> bool:
        """Whether a live launcher holds this directory (its ``flock`` on ``.lock``, see ``claim``). The kernel
        says whether the lock is held, so the answer is right whatever PID namespace the launcher runs in (a
        container sharing the directory) and whatever pid it had. A lock held by this very process counts.
        Creates nothing."""
        try:
            fd = os.open(self.lock_file, os.O_RDONLY)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def supervisor_pid(self) -> int | None:
        """Liveness: when a live launcher holds the directory (``held``), the supervisor pid that
        ``topology.json`` records (as seen in the supervisor's own PID namespace; 0 when unreadable); None when no
        run is going here, whatever pid the file records (a dead one, or one that now names another process)."""
        if not self.held():
            return None
        try:
            return int(self.read_topology().supervisor_pid)
        except (OSError, ValueError, TypeError):
            return 0

    def stale_sockets(self) -> list[Path]:
        """Socket files left here by a launcher that no longer holds the directory (``clean`` removes them)."""
        sock = self.socket_file
        if sock.exists() and not self.held():
            return [sock]
        return []

    # ------------------------------------------------------------------ checkpoints (names only: no torch here)
    def latest_checkpoint_step(self) -> int | None:
        """Optimizer step of the checkpoint that ``checkpoints/latest`` names (read from its name, nothing is
        loaded), or None when there is no complete one."""
        try:
            path = latest_checkpoint(self.checkpoints_dir)
        except (OSError, ValueError):  # latest names a directory without weights, or cannot be read
            return None
        if path is None or not path.name.startswith("step-") or not path.name[5:].isdigit():
            return None
        return int(path.name[5:])

    def remove_half_written_checkpoints(self) -> None:
        """Remove checkpoint writes cut short by a dead consumer (``checkpoints/.step-*.tmp-*``,
        ``.latest.tmp-*``): never a checkpoint. Only a launcher that holds the directory may call it."""
        d = self.checkpoints_dir
        if d.is_dir():
            for tmp in d.glob(".step-*.tmp-*"):
                shutil.rmtree(tmp, ignore_errors=True)
            for tmp in d.glob(".latest.tmp-*"):
                tmp.unlink(missing_ok=True)

    def forget_void_records(self) -> None:
        """Remove the records of an earlier start that saved no checkpoint (``VOID_RECORDS``, ``tensorboard/``,
        ``data.json``): the weights they describe are gone."""
        for name in VOID_RECORDS:
            (self.path / name).unlink(missing_ok=True)
        shutil.rmtree(self.tracker_dir("tensorboard"), ignore_errors=True)
        self.data_file.unlink(missing_ok=True)

    # ------------------------------------------------------------------ records
    def write_config(self, cfg: "RunConfig") -> None:
        """``config.json``: ``cfg.to_dict()`` (indent 1)."""
        self.config_file.write_text(json.dumps(cfg.to_dict(), indent=1))

    def config_dict(self) -> dict[str, Any]:
        """``config.json`` as it is (a plain dict, for tools that compare runs of other versions: the report,
        ``--plan``'s recorded rates). Raises ``OSError``, ``ValueError`` (not JSON, not an object)."""
        d = json.loads(self.config_file.read_text())
        if not isinstance(d, dict):
            raise ValueError(f"{self.config_file} is not a JSON object")
        return d

    def read_config(self) -> "RunConfig":
        """``config.json`` read back as a ``RunConfig`` (``RunConfig.from_dict``: a key that an older file lacks
        takes its default). Raises ``OSError``, ``ValueError``, and ``ConfigError`` (a ``ValueError``) for a key or
        value the configuration does not know."""
        from specring.shared.config.run_config import RunConfig
        return RunConfig.from_dict(self.config_dict())

    def write_topology(self, topo: Topology) -> None:
        """``topology.json``, atomically (written aside as ``topology.tmp``, then renamed)."""
        _replace(self.topology_file, json.dumps(topo.to_json(), indent=1))

    def read_topology(self) -> Topology:
        """``topology.json``. Raises ``OSError``, ``ValueError``."""
        return Topology.from_json(json.loads(self.topology_file.read_text()))

    def write_status(self, status: StatusFile) -> None:
        """``status.json``, atomically (``status.tmp`` renamed): a reader sees a whole file or the previous one."""
        _replace(self.status_file, json.dumps(status.to_json()))

    def read_status(self) -> StatusFile | None:
        """``status.json``; None before the supervisor has written it, or when it cannot be read."""
        try:
            return StatusFile.from_json(json.loads(self.status_file.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def write_summary(self, summary: Summary) -> None:
        """``summary.json`` (indent 1), atomically (``summary.tmp`` renamed)."""
        _replace(self.summary_file, json.dumps(summary.to_json(), indent=1))

    def read_summary(self) -> Summary:
        """``summary.json``. Raises ``OSError`` (missing: the run is going, or its supervisor was killed),
        ``ValueError`` (not JSON, not an object)."""
        return Summary.from_json(json.loads(self.summary_file.read_text()))

    def append_metrics(self, rec: MetricsRecord) -> None:
        """Append a line to ``metrics.jsonl``. Raises ``OSError``."""
        append_line(self.metrics_file, rec)

    def read_metrics(self) -> list[MetricsRecord]:
        """The records of ``metrics.jsonl`` in file order (lines that do not parse skipped; ``[]`` without it)."""
        return read_lines(self.metrics_file, MetricsRecord)

    def last_metrics(self, tail_bytes: int = 1 << 16) -> MetricsRecord | None:
        """The last complete record of ``metrics.jsonl``, read from the file's last ``tail_bytes`` only (None when
        there is none yet)."""
        try:
            with open(self.metrics_file, "rb") as f:
                f.seek(0, 2)
                size = f.tell()
                f.seek(max(0, size - tail_bytes))
                data = f.read()
        except OSError:
            return None
        for line in reversed(data[:data.rfind(b"\n") + 1].splitlines()):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                return MetricsRecord.from_json(rec)
        return None

    def keep_metrics_before(self, step: int) -> None:
        """Drop the lines of ``metrics.jsonl`` of steps at or after ``step`` (a record without a step counts as step
        0), keeping the others byte for byte; the file is replaced atomically. Nothing happens without the file.
        Raises ``ValueError`` for a line that does not parse, ``OSError``."""
        path = self.metrics_file
        if not path.is_file():
            return
        keep = [ln for ln in path.read_text().splitlines()
                if ln.strip() and (MetricsRecord.from_json(json.loads(ln)).step or 0) < step]
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text("".join(ln + "\n" for ln in keep))
        os.replace(tmp, path)

    def append_eval(self, rec: EvalRecord) -> None:
        """Append a line to ``eval.jsonl``. Raises ``OSError``."""
        append_line(self.eval_file, rec)

    def read_evals(self) -> list[EvalRecord]:
        """The records of ``eval.jsonl`` in file order (lines that do not parse skipped; ``[]`` without it)."""
        return read_lines(self.eval_file, EvalRecord)

    def write_data_record(self, record: dict[str, Any]) -> None:
        """``data.json`` (``supervisor.resume.data_record``; indent 1 and a newline), atomically."""
        tmp = self.path / f".{DATA_FILE}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, self.data_file)

    def read_data_record(self) -> dict[str, Any]:
        """``data.json``. Raises ``FileNotFoundError`` (a run started before it existed), ``OSError``,
        ``ValueError``."""
        return json.loads(self.data_file.read_text())


def latest_checkpoint(checkpoints_dir: str | Path) -> Path | None:
    """The step directory ``latest`` names, or None when there is no ``latest``."""
    root = Path(checkpoints_dir)
    ptr = root / LATEST_FILE
    if not ptr.is_file():
        return None
    path = root / ptr.read_text().strip()
    if not (path / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"{ptr} names {path.name}, which has no {WEIGHTS_FILE}")
    return path


def _replace(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically: ``path`` with the suffix ``.tmp`` first, then renamed over it."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
