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
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from specring.shared.config import REPORT_BACKENDS
from specring.shared.errors import ConfigError

log = logging.getLogger(__name__)

BACKENDS = REPORT_BACKENDS
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
        self.w = SummaryWriter(str(run_dir / "tensorboard"))
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
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "specring"), name=run_id, id=run_id,
                              dir=str(run_dir), config=config, mode=mode, resume="allow", reinit=True)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class _Mlflow:
    def __init__(self, run_dir: Path, run_id: str, config: dict):
        import mlflow
        self.mlflow = mlflow
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # the default: a file store in the run directory (newer MLflow asks for an explicit opt-in)
            uri = (run_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "specring"))
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


def last_metrics(run_dir: str | Path, tail_bytes: int = 1 << 16) -> dict:
    """The last complete record of ``RUN_DIR/metrics.jsonl`` (``{}`` when there is none yet), read from the
    file's last ``tail_bytes`` only."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - tail_bytes))
            data = f.read()
    except OSError:
        return {}
    for line in reversed(data[:data.rfind(b"\n") + 1].splitlines()):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            return rec
    return {}


def train_metrics(m: dict) -> dict[str, float]:
    """The tracked figures of one ``metrics.jsonl`` record (``train/...``), finite numbers only."""
    out = {f"train/{k}": m[k] for k in ("loss", "accept_proxy", "lr", "grad_norm", "tokens_per_s")
           if isinstance(m.get(k), (int, float))}
    for key, name in (("per_slot_acc", "slot"), ("per_step_acc", "step")):
        for i, a in enumerate(m.get(key) or []):
            if isinstance(a, (int, float)):
                out[f"train/acc_{name}{i + (1 if name == 'slot' else 0)}"] = a
    return {k: float(v) for k, v in out.items() if math.isfinite(float(v))}


class Reporter:
    """The run's trackers (module docstring). ``names`` from ``parse_report_to``; ``config``: the run's
    configuration (``RunConfig.to_dict()``), recorded once. With no names it does nothing.

    ``start_step`` (a resumed run: the step of the checkpoint it resumed from): records of earlier steps
    were reported by the run's previous start and are not sent again; ``metrics.jsonl`` is read only once
    the resumed consumer has rewritten it (``JsonlTail``)."""

    def __init__(self, names: list[str], run_dir: str | Path, run_id: str, config: dict, start_step: int = 0):
        self.run_dir = Path(run_dir)
        self.backends: dict[str, Any] = {}
        for n in names:
            try:
                self.backends[n] = _CLASSES[n](self.run_dir, run_id, config)
            except Exception as e:  # noqa: BLE001 - a tracker must never stop a run
                log.error("report_to backend=%s disabled error=%s: %s", n, type(e).__name__, e)
        self.start_step = int(start_step)
        self.metrics = JsonlTail(self.run_dir / "metrics.jsonl", wait_for_replace=self.start_step > 0)
        self.evals = JsonlTail(self.run_dir / "eval.jsonl")
        self.step = self.start_step

    def _send(self, metrics: dict[str, float], step: int) -> None:
        for name, b in list(self.backends.items()):
            try:
                b.log(metrics, step)
            except Exception as e:  # noqa: BLE001
                log.error("report_to backend=%s dropped error=%s: %s", name, type(e).__name__, e)
                self.backends.pop(name, None)

    def refresh(self, pipeline: dict[str, float] | None = None) -> None:
        """Send what is new in ``metrics.jsonl``/``eval.jsonl`` and the supervisor's ``pipeline`` figures
        (``pipeline/tokens_per_s``, ``pipeline/ring{i}_ready``, ``pipeline/restarts``, ...)."""
        if not self.backends:
            return
        for m in self.metrics.read():
            step = int(m.get("step", 0))
            if step < self.start_step:
                continue
            self.step = max(self.step, step)
            figures = train_metrics(m)
            if figures:
                self._send(figures, step)
        for e in self.evals.read():
            if self.start_step and int(e.get("step", 0)) <= self.start_step:
                continue
            if isinstance(e.get("tau_mean"), (int, float)):
                self._send({"eval/tau": float(e["tau_mean"])}, int(e.get("step", 0)))
        if pipeline:
            self._send({k: float(v) for k, v in pipeline.items() if v is not None}, self.step)

    def close(self, pipeline: dict[str, float] | None = None) -> None:
        """A last ``refresh`` and every backend closed."""
        self.refresh(pipeline)
        for name, b in self.backends.items():
            try:
                b.close()
            except Exception as e:  # noqa: BLE001
                log.error("report_to backend=%s close failed error=%s: %s", name, type(e).__name__, e)
        self.backends.clear()
