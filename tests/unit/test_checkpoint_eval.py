"""tau at training checkpoints: the consumer's evaluator loads the target once and appends to eval.jsonl."""

import json

import torch

from specring.consumer.tau import CheckpointEvaluator
from specring.consumer.trainer import drafter_config_from_run
from specring.shared.config.run_config import DataConfig, ProducerConfig, RunConfig, TrainerConfig
from specring.shared.models.dflash import build_drafter
from tests.support import TARGET, make_dataset


def test_checkpoint_evaluator_writes_tau_records(tmp_path):
    heldout = make_dataset(tmp_path / "heldout.arrow", num_samples=6)
    cfg = RunConfig(run_dir=str(tmp_path / "run"),
                    data=DataConfig(data=str(heldout), heldout=str(heldout)),
                    producer=ProducerConfig(target=str(TARGET), devices=["cpu"], target_layer_ids=[1, 5]),
                    trainer=TrainerConfig(block_size=4, num_draft_layers=1, eval_prompts=2, eval_max_new_tokens=8))
    (tmp_path / "run").mkdir()
    drafter = build_drafter(drafter_config_from_run(cfg), TARGET, "cpu", torch.float32)
    ev = CheckpointEvaluator(cfg, torch.device("cpu"), tmp_path / "run", prompt_len=16)
    first = ev(drafter, step=10, loss=6.5)
    ev(drafter, step=20, loss=6.0)
    recs = [json.loads(x) for x in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [10, 20]
    assert recs[0]["prompts"] == 2 and recs[0]["loss"] == 6.5
    assert 1.0 <= first["tau_mean"] <= 4.0  # at least the bonus token per target forward, at most B
    assert ev.target is not None  # loaded once, reused
