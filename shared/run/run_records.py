"""The typed records of a run directory: one dataclass per kind of record a run writes there.

``shared.run.run_dir.RunDir`` says where each record lives and reads and writes it; this module says what a record
holds. Each record's ``to_json()`` gives the plain dict that is written (the same keys, in the same order, with
the same values as the writers produced before these types existed, so the files are byte-compatible), and
``from_json(d)`` reads one back: a key that an older file lacks reads as None (the readers' ``.get`` of
before), keys of no field are ignored, and values are kept as they were read (no rounding, no casting: a
record read and written again is the same bytes).

==================  ====================  ========================================================================
record              file                  one of
==================  ====================  ========================================================================
``MetricsRecord``   ``metrics.jsonl``     a line per optimizer step (rank 0's trainer)
``EvalRecord``      ``eval.jsonl``        a line per τ evaluation, measured or failed (the τ evaluator)
``Summary``         ``summary.json``      the run's outcome (the supervisor, at the end)
``StatusRow``       ``status.json``       a row per child process (``StatusFile``: the rows, rewritten each second)
``RunStatus``       (the socket)          what ``launch.py status`` asks a live supervisor for and prints
``Topology``        ``topology.json``     what a child needs to find the others (the supervisor, at start)
==================  ====================  ========================================================================

The run's configuration (``config.json``) is ``shared.config.run_config.RunConfig`` (``to_dict``/``from_dict``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar


def _pick(cls, d: dict[str, Any]) -> dict[str, Any]:
    """The fields of dataclass ``cls`` found in ``d`` (None for those it lacks; keys of no field dropped)."""
    return {f.name: d.get(f.name) for f in dataclasses.fields(cls) if f.init}


def _dict(x: Any) -> dict:
    if not isinstance(x, dict):
        raise ValueError(f"a record must be a JSON object, got {type(x).__name__}")
    return x


def append_line(path: str | Path, rec: Any) -> None:
    """Append ``rec.to_json()`` as one JSON line to ``path`` (created if missing). Raises ``OSError``."""
    with open(path, "a") as f:
        f.write(json.dumps(rec.to_json()) + "\n")


def read_lines(path: str | Path, cls) -> list:
    """Every record of the JSON-lines file ``path`` as ``cls.from_json``, in file order; lines that do not parse
    or are not objects are skipped (a torn last line of a killed writer). ``[]`` when the file is missing or
    cannot be read."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if isinstance(d, dict):
            out.append(cls.from_json(d))
    return out


# ---------------------------------------------------------------------------------------------- metrics.jsonl
@dataclass
class MetricsRecord:
    """One line of ``metrics.jsonl``: an optimizer step of the trainer (``consumer.trainer.Trainer``), written by
    rank 0 for the whole data-parallel group. ``--resume`` drops the lines of steps after the checkpoint resumed
    from (``RunDir.keep_metrics_before``).

    * ``step``: the optimizer step (0-based, skipped steps counted);
    * ``family``: the drafter family's named metrics of the step (``DrafterFamily.step_metrics``), in its order:
      at least ``loss`` (nats per weighted token), ``accept_proxy`` and its per-position accuracy under the
      family's ``acc_key`` (``per_slot_acc``: block slots 1..B-1; ``per_step_acc``: TTT steps 0..K-1; fractions
      in [0, 1], None for a position never counted); DFlash2 adds ``selector_acc``, ``topk_recall``,
      ``selector_loss``;
    * ``num_blocks``: blocks (anchors) trained; ``num_tokens``: target tokens of the window's batches;
    * ``tokens_per_s``: target tokens per second of the window (None when no time elapsed);
    * ``batch_ids``: every rank's batch ids of the window; ``lr``: the learning rate the step used;
    * ``time``: epoch seconds when the record was made;
    * ``optimizer_step``: always true in the file; ``skipped``: the step changed no weight (no labels, a
      non-finite loss); ``grad_norm``: the clipped gradient's norm before clipping (None when skipped);
    * ``num_skipped``: skipped steps so far; ``nonfinite_in_row``: non-finite steps in a row up to this one.

    In the file the family's keys come right after ``step``."""
    step: int | None = None
    family: dict[str, Any] = field(default_factory=dict)
    num_blocks: int | None = None
    num_tokens: int | None = None
    tokens_per_s: float | None = None
    batch_ids: list[int] | None = None
    lr: float | None = None
    time: float | None = None
    optimizer_step: bool | None = None
    skipped: bool | None = None
    grad_norm: float | None = None
    num_skipped: int | None = None
    nonfinite_in_row: int | None = None

    OWN: ClassVar[tuple[str, ...]] = ("num_blocks", "num_tokens", "tokens_per_s", "batch_ids", "lr", "time",
                                      "optimizer_step", "skipped", "grad_norm", "num_skipped", "nonfinite_in_row")

    @property
    def loss(self) -> float | None:
        """The step's loss (the family's ``loss``; None when the record has none)."""
        return self.family.get("loss")

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, **self.family, **{k: getattr(self, k) for k in self.OWN}}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "MetricsRecord":
        """A record from a parsed line: the keys that are no field of the trainer's are the family's."""
        d = _dict(d)
        fam = {k: v for k, v in d.items() if k != "step" and k not in cls.OWN}
        return cls(step=d.get("step"), family=fam, **{k: d.get(k) for k in cls.OWN})


# ---------------------------------------------------------------------------------------------- eval.jsonl
@dataclass
class EvalRecord:
    """One line of ``eval.jsonl``: a τ evaluation at a training step (``consumer.tau.CheckpointEvaluator``, run by
    the τ evaluator process), measured or failed.

    * ``step``: the optimizer step whose weights were evaluated;
    * ``tau_mean``: mean acceptance length τ (accepted drafts + 1 per target forward, over the prompts; None when
      the evaluation failed); ``tau_p50``/``tau_p90``: its median and 90th percentile over the prompts;
    * ``forwards_per_token``: target forwards per generated token; ``cache_rollback``: how the target's cache went
      back after a partial acceptance (``crop``, ``replay``; None when not reported);
    * ``loss``: the training loss of that step (None when not known); ``prompts``: prompts decoded;
    * ``eval_s``: seconds the evaluation took (None when not measured); ``time``: epoch seconds when recorded;
    * a failed evaluation (``failed``): ``error`` (``"<type>: <message>"``, one line, at most 500 characters) and
      ``stage`` (``eval``, ``load``, ``weights``, ``process``); its measured fields are absent from the file.
    """
    step: int | None = None
    tau_mean: float | None = None
    tau_p50: float | None = None
    tau_p90: float | None = None
    forwards_per_token: float | None = None
    cache_rollback: str | None = None
    loss: float | None = None
    prompts: int | None = None
    eval_s: float | None = None
    time: float | None = None
    error: str | None = None
    stage: str | None = None

    MEASURED: ClassVar[tuple[str, ...]] = ("step", "tau_mean", "tau_p50", "tau_p90", "forwards_per_token",
                                           "cache_rollback", "loss", "prompts", "eval_s", "time")
    FAILED: ClassVar[tuple[str, ...]] = ("step", "tau_mean", "error", "stage", "eval_s", "time")

    @property
    def failed(self) -> bool:
        """The evaluation raised (``error`` set)."""
        return bool(self.error)

    @property
    def measured(self) -> bool:
        """The record holds a τ: not failed and ``tau_mean`` set."""
        return not self.failed and self.tau_mean is not None

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in (self.FAILED if self.failed else self.MEASURED)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "EvalRecord":
        return cls(**_pick(cls, _dict(d)))


# ---------------------------------------------------------------------------------------------- summary.json
@dataclass
class Summary:
    """``summary.json``: how a run ended, written by the supervisor at the end of every session
    (``supervisor.records.RunRecords``); README "Outputs" explains each figure.

    * ``exit_reason`` (``done``, ``interrupted``, ``consumer_0_died``, ...), ``run_id``;
    * batches: ``planned_batches``, ``trained_before_resume``, ``trained_batches``, ``duplicate_batches``,
      ``lost_batches`` (a finished run that did not train a planned batch: must be 0), ``remaining_batches``
      (what ``--resume`` trains), ``bad_batches``, ``skipped_batches`` (of steps that updated no weight; counted in
      ``trained_batches``); ``updated_steps``: optimizer steps that updated the weights;
    * ``restarts``: producer index (a string) -> restarts; ``loss_first``/``loss_last`` (None before a step);
    * ``tokens_per_s`` (target tokens trained per second, steady state), ``elapsed_s`` (seconds of this session),
      ``first_step_s`` (seconds from the first child's spawn to the first optimizer step; None without one);
    * ``rejected_messages`` (reason -> count), ``rejected_frames``, ``refused_commands``;
    * ``last_checkpoint``: ``{"step", "path"}`` (``{}`` without one);
    * ``tau_last``: ``{"step", "tau_mean"}`` of the last measured τ; ``tau_best``: ``{"step", "tau_mean",
      "checkpoint"}`` of the highest (None without one); ``eval_failures``: ``[{"step", "error"}]``;
    * ``balance``: duty cycle, starvation and capacity per process (``shared.process.balance.run_balance``);
    * ``nodes`` (several nodes only) and ``report_to`` (with ``--report-to`` only): absent from the file
      otherwise."""
    exit_reason: str | None = None
    run_id: str | None = None
    planned_batches: int | None = None
    trained_before_resume: int | None = None
    trained_batches: int | None = None
    duplicate_batches: int | None = None
    lost_batches: int | None = None
    remaining_batches: int | None = None
    bad_batches: int | None = None
    skipped_batches: int | None = None
    updated_steps: int | None = None
    restarts: dict[str, int] | None = None
    loss_first: float | None = None
    loss_last: float | None = None
    tokens_per_s: float | None = None
    elapsed_s: float | None = None
    first_step_s: float | None = None
    rejected_messages: dict[str, int] | None = None
    rejected_frames: int | None = None
    refused_commands: int | None = None
    last_checkpoint: dict[str, Any] | None = None
    tau_last: dict[str, Any] | None = None
    tau_best: dict[str, Any] | None = None
    eval_failures: list[dict[str, Any]] | None = None
    balance: dict[str, Any] | None = None
    nodes: dict[str, Any] | None = None
    report_to: dict[str, Any] | None = None

    OPTIONAL: ClassVar[tuple[str, ...]] = ("nodes", "report_to")  # written only when set

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in self.OPTIONAL or getattr(self, f.name) is not None}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Summary":
        return cls(**_pick(cls, _dict(d)))


# ---------------------------------------------------------------------------------------------- status.json
@dataclass
class StatusRow:
    """A child process as ``launch.py status`` shows it: a row of ``status.json`` and of the status reply
    (``supervisor.dispatch.MessageDispatch.status_rows``).

    * ``role`` (``producer``/``consumer``), ``index``, ``pid`` (None before the first spawn), ``generation``,
      ``state`` (the monitor's: ``starting``, ``running``, ``restarting``, ...), ``restarts``;
    * ``heartbeat_age_s``: seconds since its last heartbeat (None before Hello);
    * ``tokens_per_s``, ``gpu_mem_bytes``, ``work``/``work_s`` (what its main thread is busy with and for how many
      seconds): from its last heartbeat, None when it sent none;
    * ``duty_cycle`` (producers; fraction of the time working) or ``starvation`` (consumers; fraction waiting for
      a batch): None before the first batch; each is written for its role only (``shared.process.balance``);
    * ``cpu_percent``, ``rss_bytes``, ``threads``: psutil's figures of a live process (absent when it is not);
    * ``ring``: a producer's slots by state (``{"FREE", "WRITING", "READY", "READING"}`` -> count; absent for a
      consumer)."""
    role: str | None = None
    index: int | None = None
    pid: int | None = None
    generation: int | None = None
    state: str | None = None
    heartbeat_age_s: float | None = None
    tokens_per_s: float | None = None
    gpu_mem_bytes: int | None = None
    restarts: int | None = None
    work: str | None = None
    work_s: float | None = None
    duty_cycle: float | None = None
    starvation: float | None = None
    cpu_percent: float | None = None
    rss_bytes: int | None = None
    threads: int | None = None
    ring: dict[str, int] | None = None

    BY_ROLE: ClassVar[dict[str, str]] = {"duty_cycle": "producer", "starvation": "consumer"}
    IF_SET: ClassVar[tuple[str, ...]] = ("cpu_percent", "rss_bytes", "threads", "ring")

    @property
    def name(self) -> str:
        """``producer-0``."""
        return f"{self.role}-{self.index}"

    def to_json(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in self.BY_ROLE and self.role != self.BY_ROLE[f.name]:
                continue
            if f.name in self.IF_SET and v is None:
                continue
            out[f.name] = v
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "StatusRow":
        return cls(**_pick(cls, _dict(d)))


@dataclass
class StatusFile:
    """``status.json``: the supervisor's ``pid`` (in its own PID namespace), the ``run_id`` and one ``StatusRow`` per
    child, rewritten about once a second (``supervisor.status``)."""
    pid: int | None = None
    run_id: str | None = None
    rows: list[StatusRow] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "run_id": self.run_id, "rows": [r.to_json() for r in self.rows]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "StatusFile":
        """Raises ``ValueError`` when ``d`` or a row is not an object, ``KeyError`` when it has no ``rows``."""
        d = _dict(d)
        return cls(pid=d.get("pid"), run_id=d.get("run_id"), rows=[StatusRow.from_json(r) for r in d["rows"]])


@dataclass
class RunStatus:
    """What a live supervisor answers ``launch.py status`` (``Command(action="status")``; sent over the socket as
    ``to_json()``, never written to a file).

    ``run_id``; ``step`` (the last optimizer step), ``trained``/``planned`` batches, ``loss`` (the last step's;
    None before one); ``drafter`` (the family's name); ``acc``: the per-position accuracy of the last record of
    ``metrics.jsonl``, under the family's ``acc_key`` (``per_slot_acc``/``per_step_acc``), and ``acc_step`` its
    step (both None before one); ``balance``: the live duty cycles and starvation
    (``shared.process.balance.run_balance``, idle tails counted); ``rows``: one ``StatusRow`` per child."""
    run_id: str | None = None
    step: int | None = None
    trained: int | None = None
    planned: int | None = None
    loss: float | None = None
    drafter: str | None = None
    acc_key: str = "per_slot_acc"
    acc: list[float | None] | None = None
    acc_step: int | None = None
    balance: dict[str, Any] | None = None
    rows: list[StatusRow] = field(default_factory=list)

    ACC_KEYS: ClassVar[tuple[str, ...]] = ("per_step_acc", "per_slot_acc")

    def to_json(self) -> dict[str, Any]:
        return {"rows": [r.to_json() for r in self.rows], "run_id": self.run_id, "step": self.step,
                "trained": self.trained, "planned": self.planned, "loss": self.loss, "drafter": self.drafter,
                self.acc_key: self.acc, "acc_step": self.acc_step, "balance": self.balance}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "RunStatus":
        """The accuracy is read from the first of ``ACC_KEYS`` that holds a value."""
        d = _dict(d)
        acc_key = next((k for k in cls.ACC_KEYS if d.get(k)), "per_slot_acc")
        return cls(run_id=d.get("run_id"), step=d.get("step"), trained=d.get("trained"), planned=d.get("planned"),
                   loss=d.get("loss"), drafter=d.get("drafter"), acc_key=acc_key, acc=d.get(acc_key),
                   acc_step=d.get("acc_step"), balance=d.get("balance"),
                   rows=[StatusRow.from_json(r) for r in d.get("rows") or []])


# ---------------------------------------------------------------------------------------------- topology.json
@dataclass
class Topology:
    """What every child needs to find the others: written by the supervisor to ``RUN_DIR/topology.json`` before it
    spawns a child; each child reads it at start (``shared.process.procs.child_main``).

    ``run_id`` (the random id in segment names and ``SPECRING_RUN_ID``), ``address`` (the coordinator's socket:
    ``ipc://RUN_DIR/coord.sock`` or ``tcp://...``), ``rings`` (one shared-memory segment name per producer),
    ``slot_bytes`` and ``num_slots`` of every ring, ``supervisor_pid``: the supervisor's pid in its own PID namespace
    (its children compare it with ``getppid()``); other processes must not judge liveness by it
    (``shared.run.run_dir.RunDir.held``)."""
    run_id: str
    address: str
    rings: list[str]
    slot_bytes: int
    num_slots: int
    supervisor_pid: int

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Topology":
        """A key the file lacks reads as None."""
        return cls(**_pick(cls, _dict(d)))
