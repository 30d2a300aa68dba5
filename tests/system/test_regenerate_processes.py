"""``launch.py regenerate`` with several workers, its launcher killed (issue 27, kind 2), with real processes.

The workers die with their launcher, whether it is SIGKILLed (the parent-death signal) or gets SIGTERM (it stops
them, exits 130 and says what is kept); no worker writes a shard after that. A shard left by a run with other
arguments (as a straggler of an earlier run would write it into a directory that was deleted and made again) is
discarded and generated again, never merged: every sample of the output has at most the ``--max-new-tokens`` its
sidecar records.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import psutil
import pytest

from tests.support import REPO, TARGET, make_dataset
from tests.system.launcher_util import process_alive, wait_for

pytestmark = pytest.mark.timeout(300)


def _start(data, out, max_new: int, devices: str, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, str(REPO / "launch.py"), "regenerate", "--target", str(TARGET), "--input", str(data),
           "--output", str(out), "--devices", devices, "--shard-size", "1", "--max-new-tokens", str(max_new),
           "--prefix-len", "12", "--no-progress"]
    return subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _workers(proc: subprocess.Popen) -> list[int]:
    """The launcher's worker processes (multiprocessing's spawned ``_worker``s, not its resource tracker)."""
    out = []
    for p in psutil.Process(proc.pid).children():
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "multiprocessing.spawn" in cmd and "resource_tracker" not in cmd:
            out.append(p.pid)
    return out


def _shards(parts) -> list:
    return sorted(parts.glob("shard-*.arrow")) if parts.is_dir() else []


def _kill(proc: subprocess.Popen, pids: list[int]) -> None:
    for pid in pids + [proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(10)


def _interrupt(data, out, parts, sig, shards_before: int) -> tuple[int, str]:
    """Start a regeneration of two workers (``--max-new-tokens 6``), each sleeping after every shard, wait for
    both to write one, send ``sig`` to the launcher and wait for every worker to die; returns (exit code, output)."""
    proc = _start(data, out, max_new=6, devices="cpu,cpu", env={"SPECRING_SLOW_SHARD_S": "120"})
    workers: list[int] = []
    try:
        wait_for(lambda: len(_shards(parts)) >= shards_before + 2 or proc.poll() is not None, 200,
                 "the workers' shards")
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        workers = _workers(proc)
        assert len(workers) == 2, workers
        proc.send_signal(sig)
        code = proc.wait(60)
        wait_for(lambda: not any(process_alive(w) for w in workers), 30, "the workers to die with their launcher")
    finally:
        if proc.poll() is None or any(process_alive(w) for w in workers):
            _kill(proc, workers)
    return code, proc.stdout.read()


def test_workers_die_with_their_launcher_and_other_arguments_shards_are_never_merged(tmp_path):
    data = make_dataset(tmp_path / "in.arrow", num_samples=4)
    out = tmp_path / "regen.arrow"
    parts = tmp_path / "regen.arrow.parts"
    code, text = _interrupt(data, out, parts, signal.SIGTERM, 0)     # stopped: exit 130, what is kept said
    assert code == 130, text[-3000:]
    assert f"interrupted (SIGTERM): its workers are stopped; 2/4 shards are done and kept in {parts}" in text, \
        text[-3000:]
    assert len(_shards(parts)) == 2
    code, text = _interrupt(data, out, parts, signal.SIGKILL, 2)     # the same command resumes; then SIGKILLed
    assert "(2 already done)" in text, text[-3000:]
    assert len(_shards(parts)) == 4                                  # no worker wrote after its launcher died

    # a run with other arguments finds shards of the first one in a directory that holds no manifest of it
    # (deleted and made again by a straggler's write): they are discarded, never merged
    keep = tmp_path / "stale"
    shutil.copytree(parts, keep)
    shutil.rmtree(parts)
    parts.mkdir()
    for f in keep.glob("shard-*"):
        shutil.copy(f, parts / f.name)
    proc = _start(data, out, max_new=2, devices="cpu")
    try:
        text, _ = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            _kill(proc, _workers(proc))
    assert proc.returncode == 0, text[-3000:]
    assert "regenerate: discarded shard-00000.arrow (made with other arguments: max_new_tokens 6 -> 2)" in text, text
    from specring.shared.data.dataset import TokenDataset
    ds = TokenDataset(out)
    generated = [int(np.asarray(ds[i][1]).sum()) for i in range(len(ds))]
    assert len(ds) == 4 and max(generated) <= 2, generated
    assert json.loads(out.with_suffix(".json").read_text())["regenerated"]["max_new_tokens"] == 2
