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


def test_checkpoint_evaluator_batched_rows_equal_one_at_a_time(tmp_path, monkeypatch):
    """The GPU form (all prompts decoded together) gives the one-prompt loop's records (float32, CPU)."""
    from specring.shared.drafters import tau

    real, seen = tau.evaluate_tau, []

    def spy(*args, **kwargs):
        r = real(*args, **kwargs)
        seen.append((kwargs.get("batch_size"), r))
        return r

    monkeypatch.setattr(tau, "evaluate_tau", spy)

    class Batched(CheckpointEvaluator):
        batch_size = 3   # what the property gives on a GPU for 3 prompts

    heldout = make_dataset(tmp_path / "heldout.arrow", num_samples=6)
    cfg = RunConfig(run_dir=str(tmp_path / "run"),
                    data=DataConfig(data=str(heldout), heldout=str(heldout)),
                    producer=ProducerConfig(target=str(TARGET), devices=["cpu"], target_layer_ids=[1, 5]),
                    trainer=TrainerConfig(block_size=4, num_draft_layers=1, eval_prompts=3, eval_max_new_tokens=8))
    torch.manual_seed(0)
    drafter = build_drafter(drafter_config_from_run(cfg), TARGET, "cpu", torch.float32)
    out = {}
    for name, cls in (("loop", CheckpointEvaluator), ("batched", Batched)):
        (tmp_path / name).mkdir()
        ev = cls(cfg, torch.device("cpu"), tmp_path / name, prompt_len=16)
        out[name] = ev(drafter, step=10, loss=6.5)
    assert CheckpointEvaluator(cfg, torch.device("cpu"), tmp_path / "loop").batch_size == 1
    (b_loop, r_loop), (b_batched, r_batched) = seen
    assert (b_loop, b_batched) == (1, 3) and r_batched["batched"] is True and "batched" not in r_loop
    for key in ("tau_mean", "tau_p50", "tau_p90", "forwards_per_token"):
        assert out["batched"][key] == out["loop"][key], key
