"""The batched EAGLE-3 training-time test (shared/drafters/eagle3_ttt.py, Eagle3Drafter.ttt_forward) against the
unbatched reference it replaced (shared/drafters/eagle3_ttt_reference.py): the same loss, weight, statistics and
gradients in float32 on CPU, no host reads in the step, and a compiled step that keeps its graphs (issue 25)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from specring.shared.drafters.eagle3 import Eagle3Family
from specring.shared.drafters.eagle3_ttt import eagle3_loss, ttt_inputs
from specring.shared.drafters.eagle3_ttt_reference import (
    reference_eagle3_loss,
    reference_ttt_forward,
    reference_ttt_inputs,
)
from specring.shared.models.eagle3 import Eagle3Config, Eagle3Drafter, build_draft_vocab
from specring.shared.transport.slot_batch import SlotBatch

TARGET = Path(__file__).resolve().parents[2] / "assets" / "tiny-code-lm"
V = 50


def small_model(steps: int = 5, vd: int = 30, seed: int = 0) -> Eagle3Drafter:
    """A float32 drafter of 4/2 heads over a 50-token vocabulary, 30 of them drafted (so labels fall outside)."""
    torch.manual_seed(seed)
    cfg = Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=V, draft_vocab_size=vd, target_hidden_size=24,
                       max_position_embeddings=128, target_layer_ids=[1, 2, 3], ttt_steps=steps)
    model = Eagle3Drafter(cfg)
    model.set_draft_vocab(*build_draft_vocab(torch.randint(0, 100, (V,)), vd))
    model.load_frozen(torch.randn(V, 32))
    return model


def fixture_model(steps: int = 4) -> Eagle3Drafter:
    """The fixture target's drafter shape (hidden 256, 4/2 heads of 64, vocabulary 8192, 6000 drafted)."""
    torch.manual_seed(1)
    cfg = Eagle3Config.from_target(TARGET, draft_vocab_size=6000, ttt_steps=steps)
    model = Eagle3Drafter(cfg)
    model.set_draft_vocab(*build_draft_vocab(torch.randint(0, 1000, (cfg.vocab_size,)), 6000))
    model.load_frozen(torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02)
    return model


def make_batch(model: Eagle3Drafter, cu: list[int], topk: int, seed: int = 3) -> SlotBatch:
    """Random packed batch: a loss mask with holes, top-K ids partly outside the draft vocabulary."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    t, v = cu[-1], cfg.vocab_size
    batch = {"hidden": torch.randn(t, 3 * cfg.target_hidden_size, generator=g),
             "input_ids": torch.randint(0, v, (t,), generator=g, dtype=torch.int32),
             "loss_mask": (torch.rand(t, generator=g) > 0.25).to(torch.uint8),
             "target_ids": torch.randint(0, v, (t,), generator=g, dtype=torch.int32),
             "cu_seqlens": torch.tensor(cu, dtype=torch.int32)}
    if topk:
        batch["target_topk_ids"] = torch.randint(0, v, (t, topk), generator=g, dtype=torch.int32)
        batch["target_topk_logprobs"] = torch.log_softmax(torch.randn(t, topk, generator=g) * 2, -1)
    return SlotBatch(**batch)


def loss_and_grads(fn, model: Eagle3Drafter, batch: SlotBatch, label_source: str):
    model.zero_grad(set_to_none=True)
    out = fn(model, batch, batch.cu_seqlens, label_source, True)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def assert_same(model: Eagle3Drafter, batch: dict, label_source: str) -> None:
    (loss_r, wsum_r, corr_r, cnt_r, acc_r, npos_r), grads_r = loss_and_grads(reference_eagle3_loss, model, batch,
                                                                             label_source)
    (loss_b, wsum_b, corr_b, cnt_b, acc_b, npos_b), grads_b = loss_and_grads(eagle3_loss, model, batch, label_source)
    assert float(loss_b) == pytest.approx(float(loss_r), rel=1e-5)
    assert float(wsum_b) == pytest.approx(float(wsum_r), rel=1e-6)
    assert corr_b.tolist() == corr_r.tolist() and cnt_b.tolist() == cnt_r.tolist()
    assert float(acc_b) == float(acc_r) and int(npos_b) == int(npos_r)
    assert set(grads_b) == set(grads_r) and "embed_tokens.weight" not in grads_b
    for name, g in grads_r.items():
        scale = float(g.abs().max()) or 1.0
        assert float((grads_b[name] - g).abs().max()) <= 1e-5 * scale, name


@pytest.mark.parametrize("label_source,topk", [("target", 6), ("target", 0), ("data", 0)])
def test_batched_loss_statistics_and_gradients_equal_the_reference(label_source, topk):
    """Unequal sequences (an empty one, a one-token one, the longest in the middle), a loss mask with holes,
    labels and top-K ids outside the draft vocabulary: everything equal to the step-by-step reference."""
    model = small_model()
    assert_same(model, make_batch(model, [0, 7, 7, 8, 27, 33, 45], topk), label_source)
    assert_same(model, make_batch(model, [0, 19], topk, seed=4), label_source)      # one sequence


def test_batched_loss_equals_the_reference_at_the_fixture_shape():
    model = fixture_model()
    assert_same(model, make_batch(model, [0, 24, 40, 64], topk=8), "target")


def test_the_statistics_agree_when_the_drafter_hits():
    """A head of zeros predicts draft id 0 everywhere (the first of equal maxima); with that id as every label
    every valid step is a hit, so the per-step accuracy and the acceptance proxy count leading hits."""
    model = small_model(steps=3)
    batch = make_batch(model, [0, 10, 22], topk=0)
    with torch.no_grad():
        model.lm_head.weight.zero_()
    batch = dataclasses.replace(batch, target_ids=torch.full_like(batch.target_ids, int(model.d2t[0])))  # id 0's
    out, _ = loss_and_grads(eagle3_loss, model, batch, "target")
    ref, _ = loss_and_grads(reference_eagle3_loss, model, batch, "target")
    assert out[2].tolist() == out[3].tolist() == ref[2].tolist() and int(out[2].sum()) > 0
    assert float(out[4]) == float(ref[4]) > 2 * float(out[5])


def test_ttt_inputs_and_forward_equal_the_reference_step_by_step():
    model = small_model(steps=4)
    batch = make_batch(model, [0, 3, 3, 15, 16, 24], topk=0)
    ids, cu = batch.input_ids.long(), batch.cu_seqlens
    steps, pred, inside, pos = ttt_inputs(ids, cu, 4)
    r_steps, r_pred, r_inside, r_pos = reference_ttt_inputs(ids, cu, 4)
    assert torch.equal(steps, torch.stack(r_steps)) and torch.equal(pred, r_pred)
    assert torch.equal(inside, r_inside) and torch.equal(pos, r_pos)
    with torch.no_grad():
        outs = model.ttt_forward(steps, cu, batch.hidden)
        ref = reference_ttt_forward(model, r_steps, r_pos, cu, batch.hidden)
    assert outs.shape == (4, 24, 32)
    for k in range(4):
        assert torch.allclose(outs[k], ref[k], atol=1e-5, rtol=1e-5), f"step {k}"


def test_the_batched_step_reads_no_device_value_on_the_host():
    """No ``.item()``/``int()``/``float()`` of a tensor, no boolean-mask indexing (``nonzero``), in the forward and
    backward of a step: on a GPU each would wait for every queued kernel."""
    from torch.profiler import ProfilerActivity, profile

    model = small_model()
    batch = make_batch(model, [0, 7, 7, 8, 27], topk=4)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        eagle3_loss(model, batch, batch.cu_seqlens, "target", True)
    names = [e.name for e in prof.events()]
    for op in ("aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::masked_select"):
        assert op not in names, op


class ReferenceFamily(Eagle3Family):
    ttt_loss = staticmethod(reference_eagle3_loss)


def test_trainer_steps_equal_those_of_the_reference_family(tmp_path):
    """Through ``Trainer.step`` (the family objective, the optimizer): three steps, the same metrics and weights."""
    from specring.consumer.trainer import Trainer
    from specring.shared.config.run_config import TrainerConfig

    dcfg = Eagle3Config.from_target(TARGET, draft_vocab_size=3000, ttt_steps=3)
    vocab = build_draft_vocab(torch.randint(0, 1000, (8192,), generator=torch.Generator().manual_seed(0)), 3000)
    cfg = TrainerConfig(lr=3e-3, warmup_steps=1, max_steps=6, seed=0)
    probe = Eagle3Drafter(dcfg)
    batches = [make_batch(probe, [0, 20, 29, 48], topk=5, seed=s) for s in range(3)]
    runs = []
    for name, family in (("batched", None), ("reference", ReferenceFamily())):
        tr = Trainer(cfg, dcfg, TARGET, "cpu", tmp_path / name, draft_vocab=vocab, write_metrics=False)
        if family is not None:
            tr.family = family
        hist = [tr.step(b, [i]) for i, b in enumerate(batches)]
        runs.append((hist, tr.model.trainable_state_dict()))
    (hist_b, w_b), (hist_r, w_r) = runs
    for mb, mr in zip(hist_b, hist_r):
        assert mb["loss"] == pytest.approx(mr["loss"], rel=1e-5)
        assert mb["per_step_acc"] == mr["per_step_acc"] and mb["accept_proxy"] == mr["accept_proxy"]
        assert mb["grad_norm"] == pytest.approx(mr["grad_norm"], rel=1e-4)
    # Adam's first update is lr * g / (|g| + eps): an element whose gradient is near eps moves by a part of lr
    # (3e-3) whatever the gradient's last digits, so weights agree to 1e-4, not to the gradients' 1e-5
    for k, v in w_r.items():
        assert torch.allclose(w_b[k], v, atol=1e-4), k


def test_the_compiled_step_keeps_two_graphs_for_any_batch_shape():
    """``torch.compile(dynamic=True)`` of the layer step (what the trainer compiles): step 0 and the later steps,
    two graphs for batches of any number and length of sequences and any TTT depth, equal to eager."""
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        model = small_model(steps=5)
        eager = {}
        for i, cu in enumerate(([0, 7, 7, 8, 27, 33, 45], [0, 5, 10, 21], [0, 30, 31, 40, 42])):
            batch = make_batch(model, cu, topk=3, seed=i)
            eager[i] = loss_and_grads(eagle3_loss, model, batch, "target")
        model.midlayer.compile(dynamic=True, backend=counting_backend)
        for i, cu in enumerate(([0, 7, 7, 8, 27, 33, 45], [0, 5, 10, 21], [0, 30, 31, 40, 42])):
            batch = make_batch(model, cu, topk=3, seed=i)
            (loss, *_), grads = loss_and_grads(eagle3_loss, model, batch, "target")
            assert float(loss) == pytest.approx(float(eager[i][0][0]), rel=1e-5)
            for name, g in eager[i][1].items():
                assert torch.allclose(grads[name], g, atol=1e-5 * (float(g.abs().max()) or 1.0)), name
        assert len(graphs) == 2
    finally:
        torch._dynamo.reset()


def test_soft_cross_entropy_and_its_gradient_are_log_softmax_and_gather():
    from specring.shared.drafters.eagle3_ttt import soft_cross_entropy

    g = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 5, 40, generator=g, dtype=torch.float64)
    idx = torch.randint(0, 40, (3, 5, 4), generator=g)
    p = torch.softmax(torch.randn(3, 5, 4, generator=g, dtype=torch.float64), -1)
    p[1, 2] = 0.0                                                    # a row whose top-K is outside the vocabulary
    weights = torch.randn(3, 5, generator=g, dtype=torch.float64)
    a = logits.clone().requires_grad_()
    ref = -(p * torch.log_softmax(a, -1).gather(-1, idx)).sum(-1)
    (ref * weights).sum().backward()
    b = logits.clone().requires_grad_()
    out = soft_cross_entropy(b, idx, p.float())
    loss = (out * weights).sum()
    loss.backward(retain_graph=True)
    assert out.dtype == torch.float32 and torch.allclose(out.double(), ref.detach(), atol=1e-5)
    assert torch.allclose(b.grad, a.grad, atol=1e-6)
    with pytest.raises(RuntimeError, match="runs once"):
        loss.backward()
