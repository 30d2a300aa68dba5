"""Several nodes must run one target (issue 27, kind 1), with two real launchers on one machine.

Node 1 is given another target directory whose weights differ from node 0's (same architecture, names, shapes and
file sizes: what a path or a config cannot tell) and ``--random-target-weights``: both nodes are refused at the
rendezvous, by name, before any producer or consumer starts, and nothing is trained (the run used to end
``run done`` with a drafter trained on two targets' hidden states mixed). A copy of the same target at another
path is the same target (``tests/unit/test_node_target.py``).
"""

from __future__ import annotations

import pytest

from benchmarks.launcher import start_launcher
from tests.system.launcher_util import summary
from tests.system.test_nodes import finish, free_port, node_flags
from tests.unit.test_node_target import perturbed_copy

pytestmark = pytest.mark.timeout(240)


def test_a_node_with_another_target_is_refused_by_name_before_any_batch(dataset, tmp_path):
    other = perturbed_copy(tmp_path / "other-target")
    port = free_port()
    a, b = tmp_path / "node0", tmp_path / "node1"
    procs = [start_launcher(node_flags(dataset, a, 4, 0, port), log_path=tmp_path / "n0.log"),
             start_launcher([*node_flags(dataset, b, 4, 1, port, target=other), "--random-target-weights"],
                            log_path=tmp_path / "n1.log")]
    codes = finish(procs, 150)
    n0, n1 = ((tmp_path / f).read_text(errors="replace") for f in ("n0.log", "n1.log"))
    assert codes == [2, 2], n0[-3000:] + n1[-3000:]
    why = ("node 1's run differs from node 0's in producer.random_weights, target weights (the target checkpoints' "
           "weights differ (compared by content, not path: a copy elsewhere is fine))")
    assert f"error: {why}" in n0, n0[-3000:]
    assert f"error: node 0 refused node 1: {why}" in n1, n1[-3000:]
    for run_dir in (a, b):   # refused before any child started: nothing trained, no process log
        assert not (run_dir / "metrics.jsonl").exists()
        assert not list((run_dir / "logs").glob("producer-*.log")) and not list((run_dir / "logs").glob("consumer-*"))
    assert summary(a)["trained_batches"] == 0
