"""The DFlash Trainer in-process (consumer/trainer.py, shared/drafters/checkpoint.py): steps, accumulation, the
normaliser, non-finite handling, checkpoints and resume, and learning on the fixture + demo corpus."""

import functools
import json
import math
import time

import pytest
import torch
from safetensors import safe_open

from specring.consumer.trainer import Trainer, lr_factor
from specring.shared.config.run_config import TrainerConfig
from specring.shared.drafters import checkpoint as ckpt
from specring.shared.errors import BadBatch
from specring.shared.models.dflash import DFlashConfig
from tests.support import TARGET, cat_batches, evaluate_batch, make_batch_in_process, windows

LAYERS = [1, 3, 5]


@pytest.fixture(scope="module")
def target():
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def demo():
    from specring.shared.data.dataset import TokenDataset
    from specring.shared.data.demo import ensure_demo
    train, heldout = ensure_demo()
    return TokenDataset(train), TokenDataset(heldout)


def make_batches(target, seqs, per_batch):
    return [make_batch_in_process(target, seqs[i:i + per_batch], LAYERS) for i in range(0, len(seqs), per_batch)]


def small_cfg(**kw):
    base = dict(block_size=4, num_anchors=6, lr=3e-3, warmup_steps=2, max_steps=20, seed=0, label_source="data")
    base.update(kw)
    return TrainerConfig(**base)


@functools.lru_cache(maxsize=None)
def _dcfg(block_size, layers):
    return DFlashConfig.from_target(TARGET, LAYERS, block_size=block_size, num_draft_layers=layers)


def dcfg_for(cfg, layers=1):
    return _dcfg(cfg.block_size, layers)


@pytest.fixture(scope="module")
def few(target, demo):
    """Six small packed batches of real hidden states (3 sequences of 24..40 tokens each)."""
    seqs = windows(demo[0], 18, 40)
    seqs = [(i[: 24 + 4 * (k % 5)], m[: 24 + 4 * (k % 5)]) for k, (i, m) in enumerate(seqs)]
    return make_batches(target, seqs, 3)


def weights(tr):
    return {k: v.clone() for k, v in tr.model.trainable_state_dict().items()}


def same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def same_update(w0, a, b, rel=0.02):
    """``a`` and ``b`` made the same update from ``w0``, up to float noise that Adam amplifies where a
    gradient is near its epsilon: per tensor, ``max|a - b| <= rel * max|a - w0|`` (+ 1e-7)."""
    for k in w0:
        moved = float((a[k] - w0[k]).abs().max())
        diff = float((a[k] - b[k]).abs().max())
        assert diff <= rel * moved + 1e-7, (k, diff, moved)
    assert max(float((a[k] - w0[k]).abs().max()) for k in w0) > 1e-3  # they really moved


def test_lr_schedule():
    assert lr_factor(0, 10, 100, 0.1) == pytest.approx(0.1)
    assert lr_factor(9, 10, 100, 0.1) == pytest.approx(1.0)
    assert lr_factor(10, 10, 100, 0.1) == pytest.approx(1.0)
    assert lr_factor(55, 10, 100, 0.1) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(100, 10, 100, 0.1) == pytest.approx(0.1)
    assert lr_factor(500, 10, 100, 0.1) == pytest.approx(0.1)


def test_step_metrics_and_metrics_file(few, tmp_path):
    cfg = small_cfg()
    tr = Trainer(cfg, dcfg_for(cfg), TARGET, "cpu", tmp_path)
    before = weights(tr)
    m = tr.step(few[0], [7])
    assert m["optimizer_step"] and not m["skipped"] and m["step"] == 0 and tr.step_count == 1
    assert m["batch_ids"] == [7] and m["num_tokens"] == int(few[0]["cu_seqlens"][-1])
    assert len(m["per_slot_acc"]) == 3 and 1.0 <= m["accept_proxy"] <= 4.0
    assert math.isfinite(m["loss"]) and m["tokens_per_s"] > 0 and m["lr"] == pytest.approx(3e-3 / 2)
    assert not same(before, weights(tr))
    tr.step(few[1], [8])
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1] and lines[1]["batch_ids"] == [8]
    assert {"loss", "per_slot_acc", "accept_proxy", "tokens_per_s", "batch_ids", "lr", "time"} <= set(lines[0])


def test_head_stays_the_targets_and_is_not_optimised(few, tmp_path):
    cfg = small_cfg()
    tr = Trainer(cfg, dcfg_for(cfg), TARGET, "cpu", tmp_path)
    for i in range(3):
        tr.step(few[i], [i])
    index = json.loads((TARGET / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(TARGET / index["model.embed_tokens.weight"]), framework="pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    assert torch.equal(tr.model.embed_tokens.weight, embed) and torch.equal(tr.model.lm_head.weight, embed)
    opt_ids = {id(p) for g in tr.optimizer.param_groups for p in g["params"]}
    assert id(tr.model.embed_tokens.weight) not in opt_ids and id(tr.model.lm_head.weight) not in opt_ids
    assert tr.model.embed_tokens.weight.grad is None


def test_accumulation_equals_one_step_on_the_union(few, tmp_path):
    """grad_accum=2 over two batches == one step on the two packed together (all anchors, so the
    anchor draw cannot differ): the normaliser is the window's total weight, not a per-batch mean."""
    cfg1 = small_cfg(num_anchors=10_000, grad_accum=2)
    cfg2 = small_cfg(num_anchors=10_000, grad_accum=1)
    a = Trainer(cfg1, dcfg_for(cfg1), TARGET, "cpu", tmp_path / "a", write_metrics=False)
    b = Trainer(cfg2, dcfg_for(cfg2), TARGET, "cpu", tmp_path / "b", write_metrics=False)
    w_init = w0 = weights(a)
    for k in range(2):
        m1 = a.step(few[2 * k], [2 * k])
        assert not m1["optimizer_step"] and same(weights(a), w0)
        ma = a.step(few[2 * k + 1], [2 * k + 1])
        mb = b.step(cat_batches([few[2 * k], few[2 * k + 1]]), [100 + k])
        assert ma["optimizer_step"] and ma["batch_ids"] == [2 * k, 2 * k + 1]
        assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-5)
        assert ma["accept_proxy"] == pytest.approx(mb["accept_proxy"], rel=1e-6)
        assert ma["num_tokens"] == mb["num_tokens"]
        w0 = weights(a)
    same_update(w_init, weights(a), weights(b))


@pytest.mark.parametrize("attention", ["structured", "dense"])
def test_grouped_forward_equals_one_forward(few, tmp_path, attention):
    """Cutting the sequences into groups to bound the mask/scores, and the attention form (structured
    context mask + own block, or dense [Q, C+Q] mask), change nothing but memory and speed."""
    cfg = small_cfg()
    big = Trainer(cfg, dcfg_for(cfg), TARGET, "cpu", tmp_path / "a", write_metrics=False, max_mask_elems=10**12)
    tiny = Trainer(cfg, dcfg_for(cfg), TARGET, "cpu", tmp_path / "b", write_metrics=False, max_mask_elems=1,
                   attention=attention)
    assert big.attention == "structured" and tiny.attention == attention  # "auto" on the CPU: structured
    w_init = weights(big)
    for i in range(2):
        m1, m2 = big.step(few[i], [i]), tiny.step(few[i], [i])
        assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-5)
        assert m1["accept_proxy"] == pytest.approx(m2["accept_proxy"], rel=1e-6)
    same_update(w_init, weights(big), weights(tiny))


def test_nonfinite_steps_are_skipped_counted_and_stop_training(few, tmp_path):
    cfg = small_cfg(max_nonfinite_in_row=2)
    tr = Trainer(cfg, dcfg_for(cfg), TARGET, "cpu", tmp_path)
    tr.step(few[0], [0])
    bad = dict(few[1])
    bad["hidden"] = few[1]["hidden"].clone()
    bad["hidden"][5] = float("nan")
    w = weights(tr)
    m = tr.step(bad, [41])
    assert m["skipped"] and m["optimizer_step"] and m["nonfinite_in_row"] == 1 and m["batch_ids"] == [41]
    assert same(w, weights(tr)) and tr.skipped_batch_ids == [41] and tr.num_skipped == 1
    assert tr.step(few[2], [2])["nonfinite_in_row"] == 0  # a good step resets the run
    tr.step(bad, [42])
    with pytest.raises(BadBatch, match="non-finite"):
        tr.step(bad, [43])
    assert tr.num_skipped == 3
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["batch_ids"] for x in lines if x["skipped"]] == [[41], [42], [43]]
    assert tr.trained_batch_ids == [0, 2]


def test_malformed_batch_is_rejected_naming_the_field(few, tmp_path):
    cfg = small_cfg()
    tr = Trainer(cfg, dcfg_for(cfg), TARGET, "cpu", tmp_path, write_metrics=False)
    with pytest.raises(BadBatch, match="loss_mask"):
        tr.step({k: v for k, v in few[0].items() if k != "loss_mask"}, [0])
    with pytest.raises(BadBatch, match="hidden"):
        tr.step(dict(few[0], hidden=few[0]["hidden"][:, :256]), [0])
    with pytest.raises(BadBatch, match="cu_seqlens"):
        tr.step(dict(few[0], cu_seqlens=torch.tensor([0, 5], dtype=torch.int32)), [0])


def test_resume_gives_the_same_weights_and_losses(few, tmp_path):
    n = 6
    cfg = small_cfg(max_steps=n, checkpoint_every=3)
    full = Trainer(cfg, dcfg_for(cfg), TARGET, "cpu", tmp_path / "full")
    losses_full = [full.step(few[i], [i])["loss"] for i in range(n)]

    first = Trainer(cfg, dcfg_for(cfg), TARGET, "cpu", tmp_path / "res")
    losses = [first.step(few[i], [i])["loss"] for i in range(n // 2)]
    step_dir = first.save_checkpoint()
    first.step(few[n // 2], [n // 2])  # trained after the checkpoint, then "crashed": must be redone
    del first

    root = tmp_path / "res" / "checkpoints"
    assert step_dir == root / "step-000003" and (root / "latest").read_text().strip() == "step-000003"
    assert {p.name for p in step_dir.iterdir()} == {"drafter.safetensors", "trainer_state.pt", "dflash_config.json"}
    second = Trainer(cfg, dcfg_for(cfg), TARGET, "cpu", tmp_path / "res")
    assert second.load_checkpoint(tmp_path / "res") == step_dir
    assert second.step_count == n // 2 and second.trained_batch_ids == [0, 1, 2]
    lines = [json.loads(x) for x in (tmp_path / "res" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2]  # the post-checkpoint line was dropped
    losses += [second.step(few[i], [i])["loss"] for i in range(n // 2, n)]
    assert losses == losses_full
    assert same(weights(second), weights(full))
    assert second.optimizer.param_groups[0]["lr"] == full.optimizer.param_groups[0]["lr"]


def test_checkpoint_files_and_refusals(few, tmp_path):
    cfg = small_cfg()
    tr = Trainer(cfg, dcfg_for(cfg), TARGET, "cpu", tmp_path, write_metrics=False)
    tr.step(few[0], [0])
    root = tmp_path / "checkpoints"
    (root).mkdir()
    (root / ".step-000009.tmp-123").mkdir()  # debris of a crashed save
    d = tr.save_checkpoint()
    assert not (root / ".step-000009.tmp-123").exists()
    with safe_open(str(d / "drafter.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert {"embed_tokens.weight", "lm_head.weight", "fc.weight", "layers.0.self_attn.q_proj.weight"} <= keys
    model = ckpt.load_drafter(tmp_path)
    assert same(model.trainable_state_dict(), tr.model.trainable_state_dict())
    assert torch.equal(model.lm_head.weight, tr.model.lm_head.weight)
    # a checkpoint without the target head is refused for export/eval
    tensors, state, conf = ckpt.load_checkpoint(d)
    bare = {k: v for k, v in tensors.items() if k not in ("embed_tokens.weight", "lm_head.weight")}
    ckpt.save_checkpoint(tmp_path / "bare", 1, bare, state, conf)
    with pytest.raises(ValueError, match="lm_head"):
        ckpt.load_drafter(tmp_path / "bare")
    # a checkpoint of a drafter with other layer ids is not resumed silently
    cfg2 = small_cfg()
    other = DFlashConfig.from_target(TARGET, [1, 2, 5], block_size=4, num_draft_layers=1)
    with pytest.raises(ValueError, match="target_layer_ids"):
        Trainer(cfg2, other, TARGET, "cpu", tmp_path / "o", write_metrics=False).load_checkpoint(d)
    with pytest.raises(FileNotFoundError):
        ckpt.resolve_checkpoint(tmp_path / "nowhere")


def test_resume_refuses_weights_it_does_not_train_or_of_another_shape_by_name(few, tmp_path):
    """A checkpoint whose trainable tensors are not this drafter's is refused before anything is copied: an
    extra name (even one of the frozen head's, or a typo), a tensor of another shape, a missing one."""
    cfg = small_cfg()
    tr = Trainer(cfg, dcfg_for(cfg), TARGET, "cpu", tmp_path / "a", write_metrics=False)
    tr.step(few[0], [0])
    state = tr.state_dict()
    fresh = Trainer(cfg, dcfg_for(cfg), TARGET, "cpu", tmp_path / "b", write_metrics=False)
    before = {k: v.clone() for k, v in fresh.model.trainable_state_dict().items()}
    extra = {**state, "model": {**state["model"], "layers.0.mlp.gate_proj.weigth": torch.zeros(2)}}
    with pytest.raises(ValueError, match=r"unexpected \['layers.0.mlp.gate_proj.weigth'\]"):
        fresh.load_state_dict(extra)
    frozen = {**state, "model": {**state["model"], "lm_head.weight": tr.model.lm_head.weight.detach()}}
    with pytest.raises(ValueError, match="does not train.*lm_head.weight"):
        fresh.load_state_dict(frozen)
    key = "fc.weight"
    other = {**state, "model": {**state["model"], key: state["model"][key][:, :-1].clone()}}
    with pytest.raises(ValueError, match=r"shapes: fc.weight"):
        fresh.load_state_dict(other)
    lacking = {**state, "model": {k: v for k, v in state["model"].items() if k != key}}
    with pytest.raises(ValueError, match=r"missing \['fc.weight'\]"):
        fresh.load_state_dict(lacking)
    assert same(fresh.model.trainable_state_dict(), before)  # nothing was copied by a refused load
    fresh.load_state_dict(state)
    assert same(fresh.model.trainable_state_dict(), tr.model.trainable_state_dict())


def test_200_steps_on_the_demo_corpus_learn(target, demo, tmp_path):
    """Fixture target, demo corpus: 200 steps of 4 x 64 tokens (16 anchors per sequence, B = 4,
    2 draft layers, 3 captured layers, lr 3e-3). The held-out loss falls clearly and the acceptance
    proxy rises above its step-0 value (both measured on the same 4 held-out batches)."""
    t0 = time.time()
    train = make_batches(target, windows(demo[0], 200, 64), 4)        # 50 batches, cycled
    held = make_batches(target, windows(demo[1], 16, 64), 4)          # 4 held-out batches
    cfg = TrainerConfig(block_size=4, num_anchors=16, lr=3e-3, warmup_steps=10, max_steps=200, seed=0,
                        label_source="data")
    tr = Trainer(cfg, dcfg_for(cfg, layers=2), TARGET, "cpu", tmp_path)

    def held_metrics():
        ms = [evaluate_batch(tr, b, [10_000 + i]) for i, b in enumerate(held)]
        return (sum(m["loss"] for m in ms) / len(ms), sum(m["accept_proxy"] for m in ms) / len(ms))

    loss0, acc0 = held_metrics()
    hist = [tr.step(train[s % len(train)], [s % len(train)]) for s in range(200)]
    loss1, acc1 = held_metrics()
    first = sum(m["loss"] for m in hist[:20]) / 20
    last = sum(m["loss"] for m in hist[-20:]) / 20
    print(f"held-out loss {loss0:.3f} -> {loss1:.3f}; accept proxy {acc0:.4f} -> {acc1:.4f}; train loss "
          f"step0 {hist[0]['loss']:.3f} first20 {first:.3f} last20 {last:.3f}; {time.time() - t0:.1f}s")
    assert loss1 < 0.4 * loss0
    assert last < first - 1.0
    assert acc1 > acc0 + 0.02
    assert hist[-1]["step"] == 199 and not any(m["skipped"] for m in hist)


def test_target_label_source_trains_on_the_targets_tokens(target, demo, tmp_path):
    """label_source=target: a batch without target_ids is refused naming the field; with them the drafter
    learns target_ids, not the data: with a (made-up) target that always says token 7, slot accuracy on
    those labels goes to 1 while a data-label drafter on the same batches stays near 0 on them."""
    seqs = windows(demo[0], 24, 40)
    train = [make_batch_in_process(target, seqs[i:i + 4], LAYERS, target_ids=True) for i in range(0, 24, 4)]
    for b in train:
        b["target_ids"] = torch.full_like(b["target_ids"], 7)
    cfg = TrainerConfig(block_size=4, num_anchors=8, lr=3e-3, warmup_steps=2, max_steps=30, seed=0,
                        label_source="target")
    tr = Trainer(cfg, dcfg_for(cfg, layers=1), TARGET, "cpu", tmp_path / "t", write_metrics=False)
    with pytest.raises(BadBatch, match="target_ids"):
        tr.step({k: v for k, v in train[0].items() if k != "target_ids"}, [0])
    hist = [tr.step(train[s % len(train)], [s % len(train)]) for s in range(30)]
    assert min(hist[-1]["per_slot_acc"]) > 0.95
    data_cfg = TrainerConfig(**{**cfg.__dict__, "label_source": "data"})
    td = Trainer(data_cfg, dcfg_for(data_cfg, layers=1), TARGET, "cpu", tmp_path / "d", write_metrics=False)
    for s in range(30):
        td.step(train[s % len(train)], [s % len(train)])
    judge = Trainer(cfg, dcfg_for(cfg, layers=1), TARGET, "cpu", tmp_path / "j", write_metrics=False)
    judge.model.load_state_dict(td.model.state_dict())
    assert max(evaluate_batch(judge, train[0], [0])["per_slot_acc"]) < 0.2


def test_warm_up_falls_back_when_a_form_cannot_compile(few, tmp_path, caplog):
    """Flex attention has no CPU backward: warm_up logs the failure naming the form and trains densely; the
    weights are untouched by the warm-up."""
    cfg = small_cfg()
    tr = Trainer(cfg, dcfg_for(cfg), TARGET, "cpu", tmp_path, write_metrics=False, attention="flex",
                 compile_layers=False)
    w0 = weights(tr)
    with caplog.at_level("ERROR"):
        tr.warm_up()
    assert tr.attention == "dense" and "form=flex fallback=dense" in caplog.text
    assert same(w0, weights(tr)) and all(p.grad is None for p in tr.params)
    assert math.isfinite(tr.step(few[0], [0])["loss"])


def test_fused_linear_ce_path_trains_exactly_as_the_chunked_loss(few, tmp_path):
    """--trainer.fused-ce: one fused linear + cross-entropy per block slot (here the torch reference the Liger
    kernel is held to on CUDA, tests/unit/test_linear_ce.py) gives the chunked loss's loss, metrics and update."""
    off, fused = small_cfg(fused_ce="off"), small_cfg(fused_ce="torch")
    a = Trainer(off, dcfg_for(off), TARGET, "cpu", tmp_path / "a", write_metrics=False)
    b = Trainer(fused, dcfg_for(fused), TARGET, "cpu", tmp_path / "b", write_metrics=False)
    assert a.objective_ctx.linear_ce is None and b.objective_ctx.linear_ce is not None
    w_init = weights(a)
    for i in range(2):
        ma, mb = a.step(few[i], [i]), b.step(few[i], [i])
        assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-5)
        assert ma["accept_proxy"] == pytest.approx(mb["accept_proxy"], rel=1e-6)
        assert ma["per_slot_acc"] == pytest.approx(mb["per_slot_acc"], rel=1e-6)
    same_update(w_init, weights(a), weights(b))


def test_fused_ce_auto_takes_liger_only_for_a_large_vocabulary(monkeypatch):
    """auto's decision on a CUDA device with Liger importable (a stand-in module: the decision, not the kernel, is
    under test): the chunked loss below LIGER_AUTO_MIN_VOCAB (the fixture's 8,192), Liger's from it up and when
    the vocabulary is not known; never on the CPU."""
    import importlib.util
    import sys
    import types

    from specring.shared.config.run_config import LIGER_AUTO_MIN_VOCAB
    from specring.shared.drafters import linear_ce
    for name in ("liger_kernel", "liger_kernel.transformers", "liger_kernel.transformers.functional"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "liger_kernel" else real(name, *a))
    assert linear_ce.resolve_linear_ce("auto", "cuda", 8192) is None
    assert linear_ce.resolve_linear_ce("auto", "cuda", LIGER_AUTO_MIN_VOCAB - 1) is None
    assert linear_ce.resolve_linear_ce("auto", "cuda", LIGER_AUTO_MIN_VOCAB) is linear_ce.liger_linear_ce_sum
    assert linear_ce.resolve_linear_ce("auto", "cuda:0", 151_936) is linear_ce.liger_linear_ce_sum
    assert linear_ce.resolve_linear_ce("auto", "cuda") is linear_ce.liger_linear_ce_sum
    assert linear_ce.resolve_linear_ce("liger", "cuda", 8192) is linear_ce.liger_linear_ce_sum  # asked for: taken
    assert linear_ce.resolve_linear_ce("auto", "cpu", 151_936) is None


def test_fused_linear_ce_is_refused_where_liger_cannot_run_and_skipped_where_the_loss_needs_logits(few, tmp_path):
    from specring.shared.drafters.linear_ce import resolve_linear_ce
    with pytest.raises(ValueError, match="liger needs a CUDA device"):
        resolve_linear_ce("liger", "cpu")
    assert resolve_linear_ce("auto", "cpu") is None  # auto on the CPU: the chunked path
    # D-PACE weighs each slot by its own cross-entropy: the fused path stands aside, the loss is D-PACE's
    d_off, d_fused = small_cfg(loss="dpace", fused_ce="off"), small_cfg(loss="dpace", fused_ce="torch")
    a = Trainer(d_off, dcfg_for(d_off), TARGET, "cpu", tmp_path / "a", write_metrics=False)
    b = Trainer(d_fused, dcfg_for(d_fused), TARGET, "cpu", tmp_path / "b", write_metrics=False)
    assert a.step(few[0], [0])["loss"] == pytest.approx(b.step(few[0], [0])["loss"], rel=1e-6)


def test_feature_noise_perturbs_the_features_by_their_rms_and_resumes_exactly(few, tmp_path):
    cfg = small_cfg(feature_noise=0.1, max_steps=4, checkpoint_every=2)
    tr = Trainer(cfg, dcfg_for(cfg), TARGET, "cpu", tmp_path / "a")
    hidden = few[0]["hidden"]
    noised = tr._noised(hidden)
    assert noised.shape == hidden.shape and noised.dtype == hidden.dtype
    layers = tr.dcfg.num_target_layers
    h = hidden.float().reshape(hidden.shape[0], layers, -1)
    d = (noised.float().reshape(h.shape) - h).abs()
    rms = h.pow(2).mean(-1, keepdim=True).sqrt()
    assert bool((d <= 0.1 * rms + 1e-5).all()) and float(d.max()) > 0.05 * float(rms.max())  # bounded, not zero
    assert torch.equal(tr._noised(hidden), noised)  # the same micro-step draws the same noise
    # the loss sees the noise: the first step differs from a run without it, from the same initial weights
    plain = Trainer(small_cfg(max_steps=4, checkpoint_every=2), dcfg_for(cfg), TARGET, "cpu", tmp_path / "b")
    assert tr.step(few[0], [0])["loss"] != plain.step(few[0], [0])["loss"]
    # and a resumed run draws the noise of the run it continues
    losses_full = [tr.step(few[i], [i])["loss"] for i in (1, 2, 3)]
    first = Trainer(cfg, dcfg_for(cfg), TARGET, "cpu", tmp_path / "c")
    first.step(few[0], [0]), first.step(few[1], [1])
    first.save_checkpoint()
    second = Trainer(cfg, dcfg_for(cfg), TARGET, "cpu", tmp_path / "c")
    second.load_checkpoint(tmp_path / "c")
    assert [second.step(few[i], [i])["loss"] for i in (2, 3)] == losses_full[1:]


def _synthetic_batch(dcfg, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return {"hidden": torch.randn(t, dcfg.num_target_layers * dcfg.hidden_size, generator=g),
            "input_ids": torch.randint(4, dcfg.vocab_size, (t,), generator=g, dtype=torch.int32),
            "loss_mask": torch.ones(t, dtype=torch.uint8), "cu_seqlens": cu}


def _flex_trainer_counting_traces(tmp_path):
    """A 2-layer flex-form trainer with eager layers, the list of dynamo traces and the compile backend that
    appends to it (each trace's input count) and runs the traced graph as it is."""
    cfg = small_cfg(num_anchors=8)
    tr = Trainer(cfg, dcfg_for(cfg, layers=2), TARGET, "cpu", tmp_path, write_metrics=False, attention="flex",
                 compile_layers=False)
    traces = []

    def counting_backend(gm, example_inputs):
        traces.append(len(example_inputs))
        return gm.forward

    return tr, traces, counting_backend


@pytest.mark.parametrize("first,duck_sizing", [("warm_up", False), ("coincident", False), ("coincident", True)])
def test_compiled_layers_trace_once_for_the_first_batch_and_never_again(tmp_path, monkeypatch, first, duck_sizing):
    """The compiled draft layers (flex form, dynamic shapes) are traced at the first batch, the warm-up's, and
    never again for the real batches that follow, one of them a single query tile (flex masks are padded to
    two tiles at least: dynamo assumes dynamic sizes >= 2). ``compile_shape_scope`` turns duck sizing off: a
    first batch whose padded context equals its padded queries (12 sequences of 30 tokens, 8 anchors of 4 each:
    384 and 384) must not tie the two sizes; with duck sizing on (the scope replaced by a no-op) the later
    batches are traced again, so this test fails where the guard returns. (The old warm-up's context of 128
    positions tied to the fixture's 2 x 64 key/value features: about 20 s of recompile at the first real step
    on the H200.) Forward only (flex attention has no CPU backward); dynamo's guards are the ones of training."""
    import contextlib

    from specring.consumer import trainer as trainer_mod
    if duck_sizing:
        monkeypatch.setattr(trainer_mod, "compile_shape_scope", contextlib.nullcontext)
    tr, traces, counting_backend = _flex_trainer_counting_traces(tmp_path)

    torch._dynamo.reset()
    try:
        for layer in tr.family.compiled_modules(tr.model):
            layer.compile(dynamic=True, backend=counting_backend)
        with torch.no_grad():
            start = tr._warm_up_batch() if first == "warm_up" else _synthetic_batch(tr.dcfg, [30] * 12, seed=9)
            tr._forward_backward(start, [-1], backward=False)
            assert traces, "the first batch traced nothing"
            after_first = len(traces)
            for k, lengths in enumerate([[300, 260, 280], [200] * 5, [600], [150, 90, 410, 333]]):
                tr._forward_backward(_synthetic_batch(tr.dcfg, lengths, seed=k), [k], backward=False)
        retraced = len(traces) - after_first
    finally:
        torch._dynamo.reset()
    if duck_sizing:
        assert retraced > 0  # the guard this test is about exists: without the scope the shapes retrace
    else:
        assert retraced == 0, f"{retraced} traces after the first batch"


@pytest.mark.parametrize("rewarm", [True, False])
def test_a_pytree_type_registered_during_the_warm_up_does_not_retrace_the_first_batch(tmp_path, monkeypatch, rewarm):
    """A module imported inside the first step (Liger Kernel's, which registers transformers' output classes as
    pytree nodes) grows ``torch.utils._pytree.SUPPORTED_NODES`` after the draft layers were traced; dynamo guards
    every graph on that size, so on the H200 the first real batch recompiled both layer graphs (about 15 s,
    ``TORCH_LOGS=recompiles``: ``len(...SUPPORTED_NODES) != 102``). The warm-up now sees the registry grow and
    runs again: no trace after it. With the second pass disabled the first batch traces anew (the guard this
    test is about exists)."""
    import dataclasses

    import torch.utils._pytree as pytree

    from specring.consumer import trainer as trainer_mod
    tr, traces, counting_backend = _flex_trainer_counting_traces(tmp_path)

    @dataclasses.dataclass
    class LateNode:  # registered by the step's first call, like a lazy import would
        x: int

    objective = tr.family.objective
    registered = []

    def late_import_objective(*a, **k):
        out = objective(*a, **k)
        if not registered:
            pytree.register_dataclass(LateNode)
            registered.append(LateNode)
        return out

    def forward_only(self):  # flex attention has no CPU backward: the warm-up pass forward only
        with torch.no_grad():
            self._forward_backward(self._warm_up_batch(), [-1], backward=False, checked=True)

    monkeypatch.setattr(tr.family, "objective", late_import_objective)
    monkeypatch.setattr(Trainer, "_warm_up_once", forward_only)
    if not rewarm:
        monkeypatch.setattr(trainer_mod, "pytree_registry_size", lambda: 0)
    torch._dynamo.reset()
    try:
        for layer in tr.family.compiled_modules(tr.model):
            layer.compile(dynamic=True, backend=counting_backend)
        tr.compiled = True
        tr.warm_up()
        assert traces, "the warm-up traced nothing"
        after_warm_up = len(traces)
        with torch.no_grad():
            for k, lengths in enumerate([[300, 260, 280], [200] * 5]):
                tr._forward_backward(_synthetic_batch(tr.dcfg, lengths, seed=k), [k], backward=False)
        retraced = len(traces) - after_warm_up
    finally:
        torch._dynamo.reset()
        if registered:
            pytree._deregister_pytree_node(LateNode)
    if rewarm:
        assert retraced == 0, f"{retraced} traces after the warm-up"
    else:
        assert retraced > 0


@pytest.mark.parametrize("fails", [False, True])
def test_background_warm_up_trains_eagerly_then_takes_the_compiled_form_without_touching_the_weights(
        few, tmp_path, monkeypatch, fails):
    """``warm_up="background"``: the compile runs in a thread on a shadow copy of the drafter while the live
    steps train eagerly; the live weights follow exactly the steps of a trainer that never compiles (the thread's
    passes touch neither weights nor gradients), the compiled form is taken after the thread's two passes (the
    warm-up batch, then the first real batch) and traces nothing more for later batches (the shadow's graphs
    serve the live layers). A compiler error in the thread leaves training on the eager form. The layers are
    compiled with dynamo's ``aot_eager`` backend (forward and backward graphs, no code generation: seconds on CPU)."""
    import torch._dynamo.utils as dynamo_utils

    from specring.consumer import trainer as trainer_mod

    def fake_compile(layer):
        if fails:
            def broken(gm, example_inputs):
                raise RuntimeError("no toolchain here")
            layer.compile(dynamic=True, backend=broken)
        else:
            layer.compile(dynamic=True, backend="aot_eager")

    monkeypatch.setattr(trainer_mod, "compile_layer", fake_compile)
    cfg = small_cfg(warm_up="background", max_steps=len(few) * 3)
    eager = Trainer(cfg, dcfg_for(cfg, layers=2), TARGET, "cpu", tmp_path / "e", write_metrics=False,
                    attention="structured", compile_layers=False)
    torch._dynamo.reset()
    try:
        tr = Trainer(cfg, dcfg_for(cfg, layers=2), TARGET, "cpu", tmp_path / "b", write_metrics=False,
                     attention="structured", compile_layers=True)
        assert same(weights(tr), weights(eager))
        assert tr.start_background_warm_up() and tr.warming_up and not tr.compiled
        batches = few * 3
        graphs_at_swap = None
        for k in range(len(batches)):
            if k == 1:  # the thread's second pass needs the first real batch: hold the second step until it is done
                assert tr.wait_for_warm_up(120), "the background compile did not end within 120 s"
                assert tr.warming_up, "the compiled form is taken in a step, not by the thread"
            a, b = tr.step(batches[k], [k]), eager.step(batches[k], [k])
            if not tr.warming_up and graphs_at_swap is None:
                graphs_at_swap = dynamo_utils.counters["stats"]["unique_graphs"]
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-5), k
        assert not tr.warming_up, "the background compile never ended"
        assert tr.compiled is (not fails)
        for k_, v in weights(tr).items():
            torch.testing.assert_close(v, weights(eager)[k_], rtol=1e-4, atol=1e-5)
        if not fails:
            assert graphs_at_swap and dynamo_utils.counters["stats"]["unique_graphs"] == graphs_at_swap
    finally:
        torch._dynamo.reset()
