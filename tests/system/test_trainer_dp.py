"""Two consumer processes (torch.distributed, gloo) make the same update as one process on the union of
their batches (consumer/trainer.py). Real processes, a real process group; no sockets of our own."""

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from specring.consumer.trainer import Trainer
from specring.shared.config.run_config import TrainerConfig
from specring.shared.models.dflash import DFlashConfig
from tests.support import REPO, TARGET, cat_batches, make_batch_in_process

LAYERS = [1, 3, 5]
STEPS = 2
TIMEOUT_S = 180

WORKER = textwrap.dedent('''
    import json, os, sys, torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    rank, world, work = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    from specring.shared.models.dflash import DFlashConfig
    from specring.consumer.trainer import Trainer
    from specring.shared.config.run_config import TrainerConfig
    spec = json.load(open(os.path.join(work, "spec.json")))
    batches = torch.load(os.path.join(work, "batches.pt"))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg = TrainerConfig(**spec["trainer"])
        dcfg = DFlashConfig.from_dict(spec["dflash"])
        tr = Trainer(cfg, dcfg, spec["target"], "cpu", os.path.join(work, "dp"), rank=rank, world_size=world,
                     process_group=dist.group.WORLD)
        out = []
        for k in range(spec["steps"]):
            i = k * world + rank
            out.append(tr.step(batches[i], [i]))
        torch.save({"weights": tr.model.trainable_state_dict(), "metrics": out},
                   os.path.join(work, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batches():
    """2 * STEPS packed batches of real hidden states from the fixture, of different sizes."""
    from transformers import AutoModelForCausalLM

    from specring.shared.data.dataset import TokenDataset
    from specring.shared.data.demo import ensure_demo

    ds = TokenDataset(ensure_demo()[0])
    target = AutoModelForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32).eval()
    out = []
    for i in range(2 * STEPS):
        seqs = []
        for j in range(2 + i % 2):                      # 2 or 3 sequences: ranks get unequal work
            ids, lm = ds[100 * i + 7 * j]
            n = 20 + 6 * j
            seqs.append((torch.from_numpy(ids[40:40 + n].copy()), torch.from_numpy(lm[40:40 + n].copy())))
        out.append(make_batch_in_process(target, seqs, LAYERS, target_ids=True))
    return out


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_two_gloo_consumers_equal_one_process_on_the_union(tmp_path):
    batches = _batches()
    trainer_kw = dict(block_size=4, num_anchors=10_000, lr=3e-3, warmup_steps=1, max_steps=10, seed=0)
    dcfg = DFlashConfig.from_target(TARGET, LAYERS, block_size=4, num_draft_layers=1)
    (tmp_path / "spec.json").write_text(json.dumps({"trainer": trainer_kw, "dflash": dcfg.to_dict(),
                                                    "target": str(TARGET), "steps": STEPS}))
    torch.save(batches, tmp_path / "batches.pt")
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), PYTHONPATH=str(REPO),
               OMP_NUM_THREADS="1")
    procs = []
    try:
        for rank in range(2):
            procs.append(subprocess.Popen([sys.executable, str(worker), str(rank), "2", str(tmp_path)], cwd=REPO,
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + TIMEOUT_S
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert p.returncode == 0, out.decode(errors="replace")[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)

    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    for k in r0["weights"]:
        assert torch.equal(r0["weights"][k], r1["weights"][k]), f"ranks disagree on {k}"

    # one process: the union of both ranks' batches, packed into one batch per step
    single = Trainer(TrainerConfig(**trainer_kw), dcfg, TARGET, "cpu", tmp_path / "single", write_metrics=False)
    w0 = {k: v.clone() for k, v in single.model.trainable_state_dict().items()}
    for k in range(STEPS):
        m = single.step(cat_batches([batches[2 * k], batches[2 * k + 1]]), [1000 + k])
        dp = r0["metrics"][k]
        assert dp["optimizer_step"] and dp["batch_ids"] == [2 * k, 2 * k + 1]
        assert r1["metrics"][k]["batch_ids"] == [2 * k, 2 * k + 1]
        assert dp["loss"] == pytest.approx(m["loss"], rel=1e-5)
        assert dp["accept_proxy"] == pytest.approx(m["accept_proxy"], rel=1e-6)
        assert dp["num_tokens"] == m["num_tokens"] and dp["num_blocks"] == m["num_blocks"]
    ws = single.model.trainable_state_dict()
    moved = max(float((ws[k] - w0[k]).abs().max()) for k in ws)
    assert moved > 1e-3
    for k in ws:
        diff = float((r0["weights"][k] - ws[k]).abs().max())
        # float noise only (summation order differs; Adam magnifies it where a gradient is near eps)
        assert diff <= 0.02 * float((ws[k] - w0[k]).abs().max()) + 1e-7, (k, diff)
    lines = [json.loads(x) for x in (tmp_path / "dp" / "metrics.jsonl").read_text().splitlines()]
    assert [x["batch_ids"] for x in lines] == [[0, 1], [2, 3]]  # rank 0 writes every rank's ids
