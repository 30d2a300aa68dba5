"""The run directory (shared/run/run_dir.py) and its typed records (shared/run/run_records.py): the lock that claims it,
liveness, the runs/latest link, and every record read back and written again byte for byte as the writers
before these types wrote it (the dicts below are built in their order, with their values)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import pytest

from specring.shared.config.run_config import RunConfig
from specring.shared.errors import ConfigError
from specring.shared.paths import IPC_PATH_MAX
from specring.shared.run.run_dir import RECORD_DIRS, RECORD_FILES, RunDir, private_socket_dir
from specring.shared.run.run_records import (
    EvalRecord,
    MetricsRecord,
    RunStatus,
    StatusFile,
    StatusRow,
    Summary,
    Topology,
)

HOLDER = """
import sys, time
from specring.shared.run.run_dir import RunDir
lock = RunDir(sys.argv[1]).claim()
print("held", flush=True)
time.sleep(600)
"""


# ---------------------------------------------------------------------------------------------- the lock
def test_a_run_directory_is_claimed_once_and_free_again_when_released(tmp_path):
    run = RunDir(tmp_path / "r")
    assert not run.held() and not run.lock_file.exists()  # asking creates nothing
    lock = run.claim()
    assert run.held() and run.lock_file.is_file()
    with pytest.raises(ConfigError, match=r"^--run-dir: another launcher is starting or running in .*/r$"):
        run.claim(retry_s=0.05)
    assert run.held(), "a refused claim leaves the holder's lock alone"
    lock.close()
    assert not run.held()
    run.claim(retry_s=0).close()


def test_liveness_is_the_lock_not_the_pid_topology_records(tmp_path):
    """A dead supervisor's pid (or a pid that now names another process) says nothing: without the lock no run
    is going; while a process holds the lock, the recorded pid is reported, and once it is SIGKILLed the kernel
    has dropped the lock: the run is not going and its socket is stale."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run = RunDir(tmp_path / "r")
    run.path.mkdir()
    run.write_topology(Topology(run_id="x", address="ipc://x", rings=[], slot_bytes=0, num_slots=0,
                                supervisor_pid=dead.pid))
    run.socket_file.write_text("")
    assert run.supervisor_pid() is None and run.stale_sockets() == [run.socket_file]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run.path)], stdout=subprocess.PIPE, env=env)
    try:
        assert holder.stdout.readline().strip() == b"held"
        assert run.held() and run.supervisor_pid() == dead.pid and run.stale_sockets() == []
        holder.kill()
        holder.wait()
        deadline = time.monotonic() + 5
        while run.held() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not run.held() and run.supervisor_pid() is None and run.stale_sockets() == [run.socket_file]
    finally:
        holder.kill()
        holder.wait()
    run.topology_file.write_text("{not json")
    with run.claim():
        assert run.supervisor_pid() == 0, "held, but topology.json does not read"


def test_the_latest_link_points_at_the_newest_run_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert RunDir.latest_link() == tmp_path / "runs" / "latest"
    first = RunDir.new_default()
    assert first.path.parent == tmp_path / "runs" and first.path.name[:8].isdigit()
    first.path.mkdir(parents=True)
    first.point_latest()
    assert os.readlink(RunDir.latest_link()) == first.path.name  # relative: the runs directory may move
    second = RunDir(tmp_path / "runs" / "other")
    second.path.mkdir()
    second.point_latest()
    assert RunDir.latest_link().resolve() == second.path.resolve()
    assert [r.path.name for r in RunDir.under_runs()] == sorted([first.path.name, "latest", "other"])
    assert not [p for p in (tmp_path / "runs").iterdir() if p.name.startswith(".latest-")]


def test_every_path_is_the_run_directory_s_and_records_lists_them(tmp_path):
    run = RunDir(tmp_path)
    assert os.fspath(run) == str(tmp_path) and RunDir(str(tmp_path)) == run
    names = {"config_file": "config.json", "summary_file": "summary.json", "data_file": "data.json",
             "status_file": "status.json", "topology_file": "topology.json", "metrics_file": "metrics.jsonl",
             "eval_file": "eval.jsonl", "draft_vocab_file": "draft_vocab.safetensors",
             "timeseries_file": "timeseries.jsonl", "socket_file": "coord.sock", "lock_file": ".lock",
             "logs_dir": "logs", "checkpoints_dir": "checkpoints", "tau_dir": "tau", "report_dir": "report"}
    for attr, name in names.items():
        assert getattr(run, attr) == tmp_path / name, attr
    assert run.log_file("producer-1") == tmp_path / "logs" / "producer-1.log"
    assert run.checkpoint_dir(12) == tmp_path / "checkpoints" / "step-000012"
    assert run.coordinator_address() == f"ipc://{tmp_path / 'coord.sock'}"
    assert run.coordinator_address("tcp://127.0.0.1:5") == "tcp://127.0.0.1:5"
    assert list(run.records().values()) == [tmp_path / n for n in RECORD_FILES + RECORD_DIRS]
    assert RunDir.of_checkpoint(tmp_path / "checkpoints" / "step-000012") == RunDir(tmp_path.resolve())


def test_a_start_without_a_checkpoint_forgets_its_records_and_half_written_checkpoints(tmp_path):
    run = RunDir(tmp_path)
    (run.checkpoints_dir / ".step-000004.tmp-9").mkdir(parents=True)
    (run.checkpoints_dir / ".latest.tmp-9").write_text("")
    for p in (run.metrics_file, run.eval_file, run.summary_file, run.data_file, run.config_file):
        p.write_text("{}\n")
    (run.tracker_dir("tensorboard")).mkdir()
    run.remove_half_written_checkpoints()
    run.forget_void_records()
    assert list(run.checkpoints_dir.iterdir()) == []
    assert [p.name for p in tmp_path.iterdir() if p.is_file()] == ["config.json"]
    assert run.latest_checkpoint_step() is None and run.checkpoint_names() == []


# ---------------------------------------------------------------------------------------------- the records
def _same_bytes(cls, d: dict, indent=None) -> None:
    assert json.dumps(cls.from_json(json.loads(json.dumps(d))).to_json(), indent=indent) == \
        json.dumps(d, indent=indent)


def test_config_reads_back_as_the_run_config(tmp_path):
    cfg = RunConfig()
    cfg.trainer.lr, cfg.producer.target = 1e-4, "some/target"
    run = RunDir(tmp_path)
    run.write_config(cfg)
    assert run.config_file.read_text() == json.dumps(cfg.to_dict(), indent=1)  # what the supervisor wrote
    assert run.read_config() == cfg and run.config_dict() == cfg.to_dict()
    old = cfg.to_dict()
    del old["trainer"]["lr"]  # an older run: the field takes its default
    run.config_file.write_text(json.dumps(old))
    assert run.read_config().trainer.lr == RunConfig().trainer.lr
    run.config_file.write_text(json.dumps({"no_such_key": 1}))
    with pytest.raises(ConfigError, match="no_such_key"):
        run.read_config()


@pytest.mark.parametrize("family", [
    {"loss": 3.25, "per_slot_acc": [0.5, None, 0.25], "accept_proxy": 1.5},
    {"loss": float("nan"), "per_step_acc": [0.75, 0.5], "accept_proxy": float("nan")},
    {"loss": 2.0, "per_slot_acc": [0.5], "accept_proxy": 1.0, "selector_acc": [0.25], "topk_recall": [1.0],
     "selector_loss": 0.125},
])
def test_a_metrics_line_reads_back_byte_for_byte(tmp_path, family):
    # as Trainer._metrics and _optimizer_step build it: step, the family's, the trainer's, then the step's outcome
    d = {"step": 7, **family, "num_blocks": 12, "num_tokens": 340, "tokens_per_s": 1234.5, "batch_ids": [3, 9],
         "lr": 0.003, "time": 1700000000.123456, "optimizer_step": True, "skipped": False, "grad_norm": 0.875,
         "num_skipped": 0, "nonfinite_in_row": 0}
    _same_bytes(MetricsRecord, d)
    rec = MetricsRecord.from_json(d)
    assert rec.step == 7 and rec.batch_ids == [3, 9] and rec.family.keys() == family.keys()
    assert rec.loss == family["loss"] or rec.loss != rec.loss
    run = RunDir(tmp_path)
    for step in range(4):
        run.append_metrics(MetricsRecord.from_json(dict(d, step=step)))
    assert run.metrics_file.read_text() == "".join(json.dumps(dict(d, step=s)) + "\n" for s in range(4))
    assert run.last_metrics().step == 3 and [r.step for r in run.read_metrics()] == [0, 1, 2, 3]
    before = run.metrics_file.read_text().splitlines(keepends=True)
    run.keep_metrics_before(2)
    assert run.metrics_file.read_text() == "".join(before[:2])


def test_eval_lines_measured_and_failed_read_back_byte_for_byte(tmp_path):
    # as CheckpointEvaluator.__call__ and record_failure built them
    measured = {"step": 20, "tau_mean": 2.375, "tau_p50": 2.0, "tau_p90": 3, "forwards_per_token": 0.5,
                "cache_rollback": "crop", "loss": 4.5, "prompts": 2, "eval_s": 3.02, "time": 1700000000.5}
    failed = {"step": 40, "tau_mean": None, "error": "RuntimeError: boom", "stage": "weights", "eval_s": None,
              "time": 1700000001.25}
    _same_bytes(EvalRecord, measured)
    _same_bytes(EvalRecord, failed)
    m, f = EvalRecord.from_json(measured), EvalRecord.from_json(failed)
    assert m.measured and not m.failed and f.failed and not f.measured and f.stage == "weights"
    old = EvalRecord.from_json({"step": 10, "tau_mean": 1.5})  # an older record: what it lacks reads as None
    assert old.measured and old.loss is None and old.cache_rollback is None
    run = RunDir(tmp_path)
    run.append_eval(m)
    run.append_eval(f)
    with open(run.eval_file, "a") as fh:
        fh.write('{"step": 60, "tau_me')  # a torn last line of a killed writer
    assert run.read_evals() == [m, f]


def test_the_tau_evaluator_writes_the_records_it_wrote_before(tmp_path):
    from specring.consumer.tau import record_failure
    rec = record_failure(RunDir(tmp_path).eval_file, 8, ValueError("bad\nweights"), stage="weights", eval_s=1.234)
    line = RunDir(tmp_path).eval_file.read_text()
    assert line == json.dumps({"step": 8, "tau_mean": None, "error": "ValueError: bad weights", "stage": "weights",
                               "eval_s": 1.23, "time": rec["time"]}) + "\n"


def _summary_dict(**over) -> dict:
    # as RunRecords.write_summary built it (nodes and report_to only when they apply)
    d = {"exit_reason": "done", "run_id": "abc123", "planned_batches": 12, "trained_before_resume": 0,
         "trained_batches": 12, "duplicate_batches": 0, "lost_batches": 0, "remaining_batches": 0, "bad_batches": 0,
         "skipped_batches": 1, "updated_steps": 5, "restarts": {"0": 0, "1": 2}, "loss_first": 9.5,
         "loss_last": 4.25, "tokens_per_s": 812.4, "elapsed_s": 31.07, "first_step_s": 8.5,
         "rejected_messages": {"stale_generation": 1}, "rejected_frames": 0, "refused_commands": 0,
         "last_checkpoint": {"step": 6, "path": "/r/checkpoints/step-000006"},
         "tau_last": {"step": 6, "tau_mean": 1.75},
         "tau_best": {"step": 4, "tau_mean": 2.0, "checkpoint": None},
         "eval_failures": [{"step": 2, "error": "RuntimeError: x"}],
         "balance": {"producers": {"0": {"busy_s": 1.0, "duty_cycle": 0.5}}, "producer_duty_cycle": 0.5,
                     "consumer_starvation": None}}
    d.update(over)
    return d


def test_the_summary_reads_back_byte_for_byte(tmp_path):
    run = RunDir(tmp_path)
    for d in (_summary_dict(), _summary_dict(exit_reason="interrupted", remaining_batches=3, tau_last=None,
                                             tau_best=None, first_step_s=None),
              _summary_dict(nodes={"nnodes": 2, "node_rank": 0, "dead_nodes": []},
                            report_to={"backends": {"tensorboard": "started"}, "sent": 3})):
        _same_bytes(Summary, d, indent=1)
        run.write_summary(Summary.from_json(d))
        assert run.summary_file.read_text() == json.dumps(d, indent=1)
        assert run.read_summary() == Summary.from_json(d)
    assert not (tmp_path / "summary.tmp").exists()
    partial = Summary.from_json({"exit_reason": "done", "balance": {"producer_tokens_per_busy_s": 1.0}})
    assert partial.trained_batches is None and partial.balance == {"producer_tokens_per_busy_s": 1.0}
    assert "nodes" not in partial.to_json() and "report_to" not in partial.to_json()


def _row(role: str, alive: bool = True, **over) -> dict:
    # as MessageDispatch.status_rows built it: the monitor's psutil figures only for a live child, a ring only
    # for a producer, the duty cycle or the starvation by role
    d = {"role": role, "index": 1, "pid": 4242, "generation": 2, "state": "running", "heartbeat_age_s": 0.3,
         "tokens_per_s": 1500.25, "gpu_mem_bytes": None, "restarts": 1, "work": "batch 17", "work_s": 2.5}
    d.update({"duty_cycle": 0.875} if role == "producer" else {"starvation": None})
    if alive:
        d.update({"cpu_percent": 97.5, "rss_bytes": 123456789, "threads": 9})
    if role == "producer":
        d["ring"] = {"FREE": 1, "WRITING": 1, "READY": 0, "READING": 1}
    d.update(over)
    return d


def test_status_rows_and_the_status_file_read_back_byte_for_byte(tmp_path):
    rows = [_row("producer"), _row("producer", alive=False, pid=None, state="starting", heartbeat_age_s=None),
            _row("consumer"), _row("consumer", alive=False)]
    for r in rows:
        _same_bytes(StatusRow, r)
    status = {"pid": 77, "run_id": "abc123", "rows": rows}
    _same_bytes(StatusFile, status)
    run = RunDir(tmp_path)
    run.write_status(StatusFile.from_json(status))
    assert run.status_file.read_text() == json.dumps(status)
    back = run.read_status()
    assert back.run_id == "abc123" and [r.name for r in back.rows] == ["producer-1"] * 2 + ["consumer-1"] * 2
    assert back.rows[0].ring["FREE"] == 1 and back.rows[2].starvation is None and back.rows[1].cpu_percent is None
    from specring.supervisor.status import read_status_rows
    assert read_status_rows(tmp_path) == rows
    run.status_file.write_text('{"pid": 1')
    assert run.read_status() is None and read_status_rows(tmp_path) == []


def test_the_status_reply_reads_back_byte_for_byte():
    for key, acc in (("per_slot_acc", [0.5, 0.25]), ("per_step_acc", [0.75]), ("per_slot_acc", None)):
        # as MessageDispatch._command built it, the accuracy under the family's acc_key
        d = {"rows": [_row("producer"), _row("consumer")], "run_id": "abc123", "step": 9, "trained": 40,
             "planned": 60, "loss": 3.5, "drafter": "dflash", key: acc, "acc_step": 8,
             "balance": {"producer_duty_cycle": 0.5, "consumer_starvation": 0.25}}
        _same_bytes(RunStatus, d)
        st = RunStatus.from_json(d)
        assert st.acc == acc and st.rows[1].role == "consumer"


def test_the_topology_reads_back_byte_for_byte_and_tolerates_a_partial_file(tmp_path):
    topo = Topology(run_id="abc", address="ipc:///r/coord.sock", rings=["specring-abc-p0"], slot_bytes=4096,
                    num_slots=3, supervisor_pid=123)
    run = RunDir(tmp_path)
    run.write_topology(topo)
    assert run.topology_file.read_text() == json.dumps(topo.__dict__, indent=1)  # as the writers before RunDir wrote it
    assert run.read_topology() == topo
    run.topology_file.write_text(json.dumps({"supervisor_pid": 5}))
    assert run.read_topology().supervisor_pid == 5 and run.read_topology().rings is None


def test_the_data_record_is_written_as_before(tmp_path):
    record = {"data": "/d/train.arrow", "content_digest": "sha256:00", "num_samples": 3, "plan_fields": {"a": 1}}
    run = RunDir(tmp_path)
    run.write_data_record(record)
    assert run.data_file.read_text() == json.dumps(record, indent=1) + "\n" and run.read_data_record() == record


def test_a_run_directory_too_deep_for_an_ipc_socket_gets_one_in_the_private_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "t"))
    (tmp_path / "t").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    short = RunDir(tmp_path / "r")
    assert short.socket_file == tmp_path / "r" / "coord.sock"
    run, other = RunDir(deep), RunDir(deep.parent / "f")
    sock = run.socket_file
    assert len(str(deep / "coord.sock")) > IPC_PATH_MAX >= len(str(sock))
    assert sock.parent == private_socket_dir() == tmp_path / "t" / f"specring-{os.getuid()}"
    assert sock == RunDir(str(deep)).socket_file != other.socket_file  # one path per run directory
    assert not sock.parent.exists()  # socket_file computes only
    assert run.coordinator_address() == f"ipc://{sock}"
    assert sock.parent.is_dir() and (sock.parent.stat().st_mode & 0o777) == 0o700
    sock.write_text("")  # a socket left by a launcher that no longer holds the directory
    assert run.stale_sockets() == [sock]
    os.chmod(sock.parent, 0o755)  # open to others: refused, naming the directory
    with pytest.raises(ValueError, match=f"specring-{os.getuid()}.*mode 0700"):
        run.coordinator_address()
    assert run.coordinator_address("tcp://127.0.0.1:5") == "tcp://127.0.0.1:5"
    monkeypatch.setenv("TMPDIR", str(tmp_path / ("t" * 90)))  # even the private directory is too deep
    (tmp_path / ("t" * 90)).mkdir()
    monkeypatch.setattr(tempfile, "tempdir", None)
    with pytest.raises(ValueError, match="too long for an ipc socket.*TMPDIR"):
        run.coordinator_address()
