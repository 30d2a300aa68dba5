"""The EAGLE-3 drafter (shared/models/eagle3.py) and its TTT loss (shared/drafters/eagle3_ttt.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from specring.shared.drafters.eagle3_ttt import eagle3_loss, ttt_inputs
from specring.shared.errors import ConfigError
from specring.shared.models.eagle3 import (
    Eagle3Config,
    Eagle3Drafter,
    build_draft_vocab,
    build_eagle3,
    draft_to_target,
    eagle3_chain,
    eagle3_extend,
    target_to_draft,
)
from specring.shared.models.layer_ids import default_eagle3_layer_ids
from specring.shared.transport.slot_batch import SlotBatch

TARGET = Path(__file__).resolve().parents[2] / "assets" / "tiny-code-lm"


def tiny_cfg(vd=30, steps=4):
    return Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=50, draft_vocab_size=vd,
                        target_hidden_size=24, max_position_embeddings=128, target_layer_ids=[1, 2, 3],
                        ttt_steps=steps)


def tiny_model(vd=30, steps=4, seed=0):
    torch.manual_seed(seed)
    cfg = tiny_cfg(vd, steps)
    model = Eagle3Drafter(cfg).double()
    counts = torch.randint(0, 100, (50,))
    model.set_draft_vocab(*build_draft_vocab(counts, vd))
    model.load_frozen(torch.randn(50, 32, dtype=torch.float64))
    return model


def test_default_layers_are_the_references_low_mid_high_and_valid_for_any_depth():
    assert default_eagle3_layer_ids(36) == [1, 17, 32]   # hidden_states[2], [18], [33] of Qwen3-8B
    assert default_eagle3_layer_ids(32) == [1, 15, 28]
    assert default_eagle3_layer_ids(8) == [1, 3, 4]
    for n in range(1, 80):
        ids = default_eagle3_layer_ids(n)
        assert ids == sorted(set(ids)) and all(0 <= i < n for i in ids) and len(ids) == min(3, n)
    with pytest.raises(ConfigError, match="target-layers"):
        Eagle3Config.from_target(TARGET, [1, 1, 2])


def test_draft_vocab_is_the_most_frequent_ids_as_offsets():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    d2t, t2d = build_draft_vocab(counts, 4)
    used = draft_to_target(d2t)
    assert used.tolist() == [0, 2, 3, 5] and d2t.dtype == torch.int64 and d2t.tolist() == [0, 1, 1, 2]
    assert torch.nonzero(t2d).flatten().tolist() == used.tolist()
    assert target_to_draft(d2t, 8).tolist() == [0, -1, 1, 2, -1, 3, -1, -1]
    d2t_all, t2d_all = build_draft_vocab(counts, 100)              # a vocabulary no larger than Vd: identity
    assert d2t_all.tolist() == [0] * 8 and bool(t2d_all.all())
    with pytest.raises(ValueError, match="t2d"):
        tiny_model().set_draft_vocab(d2t_all[:4] * 0 + torch.tensor([0, 0, 0, 0]), t2d_all[:50].repeat(7)[:50])


def test_training_time_test_equals_chain_drafting_at_inference():
    """What TTT trains is what chain drafting computes: with the drafted tokens fed at a position's later steps,
    the training forward's outputs at that position equal the inference cache + chain's, step by step."""
    model = tiny_model()
    n, p, k = 12, 7, 4
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 50, (n,), generator=g)
    feats = torch.randn(n, 72, generator=g, dtype=torch.float64)
    cache, out = eagle3_extend(model, None, feats[:p + 1], x[1:p + 2], torch.arange(p + 1))
    tokens, hiddens = eagle3_chain(model, cache, out[-1], p, k)
    # the same context fed in two pieces gives the same cache and outputs (it is verified context)
    c1, o1 = eagle3_extend(model, None, feats[:3], x[1:4], torch.arange(3))
    c2, o2 = eagle3_extend(model, c1, feats[3:p + 1], x[4:p + 2], torch.arange(3, p + 1))
    assert torch.allclose(torch.cat([o1, o2]), out, atol=1e-10) and torch.allclose(c2.keys, cache.keys, atol=1e-10)
    step_ids = ttt_inputs(x, torch.tensor([0, n]), k)[0]
    for j in range(1, k):
        step_ids[j] = step_ids[j].clone()
        step_ids[j][p] = tokens[j - 1]
    with torch.no_grad():
        outs = model.ttt_forward(step_ids, torch.tensor([0, n]), feats)
    assert torch.allclose(outs[0][:p + 1], out, atol=1e-10)
    for j in range(1, k):
        assert torch.allclose(outs[j][p], hiddens[j - 1], atol=1e-10), f"step {j}"


def test_sequences_of_a_packed_batch_do_not_see_each_other():
    model = tiny_model()
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, 50, (15,), generator=g)
    feats = torch.randn(15, 72, generator=g, dtype=torch.float64)
    cu = torch.tensor([0, 6, 15])
    with torch.no_grad():
        packed = model.ttt_forward(ttt_inputs(x, cu, 3)[0], cu, feats)
        alone = model.ttt_forward(ttt_inputs(x[6:], torch.tensor([0, 9]), 3)[0], torch.tensor([0, 9]), feats[6:])
    for a, b in zip(packed, alone):
        # the second sequence's last positions read past its end (token 0 in both): equal everywhere
        assert torch.allclose(a[6:], b, atol=1e-10)


def test_loss_labels_soft_targets_and_statistics():
    model = tiny_model(vd=30, steps=3)
    g = torch.Generator().manual_seed(3)
    t = 10
    x = torch.randint(0, 50, (t,), generator=g)
    cu = torch.tensor([0, t])
    batch = SlotBatch(hidden=torch.randn(t, 72, generator=g, dtype=torch.float64), input_ids=x,
                      loss_mask=torch.ones(t, dtype=torch.uint8), cu_seqlens=cu,
                      target_ids=torch.randint(0, 50, (t,), generator=g))
    loss, wsum, correct, counted, accept, npos = eagle3_loss(model, batch, cu, "target", backward=True)
    # step k is valid at t with t+2+k < 10: 8, 7, 6 positions
    assert counted.tolist() == [8, 7, 6] and int(npos) == 8
    in_vocab = model.t2d[batch.target_ids]
    expect = sum(0.8 ** k * float(in_vocab[1 + k:9].sum()) for k in range(3))  # labels at t+1+k, t < 8-k
    assert float(wsum) == pytest.approx(expect)
    assert model.fc.weight.grad is not None and model.embed_tokens.weight.grad is None
    assert float(accept) >= float(npos)
    # soft targets: a top-1 "distribution" equal to the hard label gives the same loss
    model.zero_grad()
    soft = dataclasses.replace(batch, target_topk_ids=batch.target_ids[:, None], target_topk_logprobs=torch.zeros(t, 1))
    loss_soft = eagle3_loss(model, soft, cu, "target", backward=False)[0]
    assert float(loss_soft.detach()) == pytest.approx(float(loss))


def test_a_fixture_drafter_learns_the_next_tokens(tmp_path):
    """Fixture target features; 40 steps of Adam on 4 sequences: the loss falls and step-0 accuracy rises."""
    from transformers import AutoModelForCausalLM

    from specring.shared.models.target import LayerCapture
    cfg = Eagle3Config.from_target(TARGET, draft_vocab_size=8192, ttt_steps=3)
    target = AutoModelForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 8000, (4, 32), generator=g)
    ids[:, 16:] = ids[:, :16]                                    # a repeat: learnable from the context
    with torch.no_grad(), LayerCapture(target, cfg.target_layer_ids) as cap:
        target.model(input_ids=ids)
        feats = torch.cat(cap.outputs(), dim=-1).reshape(-1, 3 * cfg.target_hidden_size)
        greedy = target(input_ids=ids).logits.argmax(-1).reshape(-1)
    cu = torch.arange(0, 129, 32)
    batch = SlotBatch(hidden=feats, input_ids=ids.reshape(-1), loss_mask=torch.ones(128, dtype=torch.uint8),
                      cu_seqlens=cu, target_ids=greedy)
    torch.manual_seed(0)
    model = build_eagle3(cfg, TARGET, *build_draft_vocab(torch.ones(8192), 8192))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    first = last = None
    for step in range(40):
        opt.zero_grad()
        loss, wsum, correct, counted, _, _ = eagle3_loss(model, batch, cu, "target", backward=True)
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= float(wsum)
        opt.step()
        value = float(loss / wsum)
        first = value if first is None else first
        last = value
    assert last < 0.5 * first
    assert float(correct[0]) / float(counted[0]) > 0.3


def test_chain_speculative_decoding_with_an_eagle3_drafter_is_lossless():
    """Chain drafting through the real verify loop: output equals greedy decoding, acceptance counted per step."""
    from transformers import AutoModelForCausalLM

    from specring.shared.models.speculative import Eagle3Proposer, greedy_generate, speculative_generate
    target = AutoModelForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32).eval()
    cfg = Eagle3Config.from_target(TARGET, draft_vocab_size=4000, ttt_steps=3)
    torch.manual_seed(0)
    model = build_eagle3(cfg, TARGET, *build_draft_vocab(torch.arange(8192, 0, -1), 4000)).eval()
    g = torch.Generator().manual_seed(4)
    for n in range(2):
        prompt = torch.randint(4, 8000, (20,), generator=g).tolist()
        ref = greedy_generate(target, prompt, 24).tokens
        res = speculative_generate(target, Eagle3Proposer(model, 4), prompt, 24, 5, cfg.target_layer_ids)
        assert res.tokens == ref
        assert set(res.drafted) == {4} and all(1 <= a <= 5 for a in res.accept_lengths)


def test_the_trainer_trains_checkpoints_and_resumes_an_eagle3_drafter_exactly(tmp_path):
    """Same Trainer, other drafter: steps with per-TTT-step accuracy, a checkpoint with eagle3_config.json and the
    draft vocabulary, an exact resume, and load_drafter rebuilding the drafter for eval/export."""
    from transformers import AutoModelForCausalLM

    from specring.consumer.trainer import Trainer, check_batch
    from specring.shared.config.run_config import TrainerConfig
    from specring.shared.drafters import checkpoint as ckpt
    from specring.shared.models.target import LayerCapture
    target = AutoModelForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32).eval()
    dcfg = Eagle3Config.from_target(TARGET, draft_vocab_size=2000, ttt_steps=3)
    vocab = build_draft_vocab(torch.arange(8192, 0, -1), 2000)
    g = torch.Generator().manual_seed(5)
    batches = []
    for _ in range(4):
        ids = torch.randint(4, 1999, (3, 24), generator=g)
        with torch.no_grad(), LayerCapture(target, dcfg.target_layer_ids) as cap:
            target.model(input_ids=ids)
            feats = torch.cat(cap.outputs(), dim=-1).reshape(-1, 3 * 256)
            greedy = target(input_ids=ids).logits.argmax(-1).reshape(-1)
        batches.append({"hidden": feats, "input_ids": ids.reshape(-1).to(torch.int32),
                        "loss_mask": torch.ones(72, dtype=torch.uint8), "target_ids": greedy.to(torch.int32),
                        "cu_seqlens": torch.tensor([0, 24, 48, 72], dtype=torch.int32)})
    assert check_batch(batches[0], dcfg, "target") == 72
    cfg = TrainerConfig(lr=3e-3, warmup_steps=1, max_steps=6, seed=0)

    def trainer(d):
        return Trainer(cfg, dcfg, TARGET, "cpu", tmp_path / d, draft_vocab=vocab)

    a = trainer("a")
    hist = [a.step(batches[i % 4], [i]) for i in range(6)]
    assert len(hist[-1]["per_step_acc"]) == 3 and "per_slot_acc" not in hist[-1]
    assert hist[-1]["loss"] < hist[0]["loss"]
    b = trainer("b")
    for i in range(3):
        b.step(batches[i % 4], [i])
    path = b.save_checkpoint()
    assert (path / "eagle3_config.json").is_file() and ckpt.drafter_kind(path) == "eagle3"
    c = trainer("c")
    c.load_checkpoint(path)
    for i in range(3, 6):
        m = c.step(batches[i % 4], [i])
    assert m["loss"] == pytest.approx(hist[-1]["loss"], rel=1e-5)
    for k, v in a.model.trainable_state_dict().items():
        assert torch.allclose(v, c.model.trainable_state_dict()[k], atol=1e-6), k
    loaded = ckpt.load_drafter(path)
    assert isinstance(loaded, Eagle3Drafter) and torch.equal(loaded.d2t, vocab[0])
    other = Trainer(cfg, dcfg, TARGET, "cpu", tmp_path / "e", draft_vocab=build_draft_vocab(torch.arange(8192), 2000))
    with pytest.raises(ValueError, match=r"its draft vocabulary \(d2t\) differs"):   # never another vocabulary
        other.load_checkpoint(path)
    with pytest.raises(ValueError, match="eagle3 drafter"):
        from specring.shared.models.dflash import DFlashConfig
        Trainer(cfg, DFlashConfig.from_target(TARGET, None), TARGET, "cpu", tmp_path / "d").load_checkpoint(path)


# What SGLang's and vLLM's llama_eagle3.py load_weights accept (read from their source; see
# shared/drafters/eagle3_export.py): these names, no "model." prefix, "midlayer." for the layer, d2t as offsets.
ENGINE_NAMES = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
    f"midlayer.{n}.weight" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
                                     "hidden_norm", "post_attention_layernorm")}


def test_export_has_the_engines_names_shapes_and_config_and_bad_ones_are_refused(tmp_path):
    import json

    from safetensors import safe_open

    from specring.shared.drafters import checkpoint as ckpt
    from specring.shared.drafters.eagle3_export import check_eagle3_export, export_eagle3
    cfg = Eagle3Config.from_target(TARGET, draft_vocab_size=3000, ttt_steps=2)
    d2t, t2d = build_draft_vocab(torch.arange(8192) % 97, 3000)
    model = build_eagle3(cfg, TARGET, d2t, t2d)
    tensors = dict(model.trainable_state_dict(), **model.frozen_state_dict())
    step = ckpt.save_checkpoint(tmp_path / "run" / "checkpoints", 7, tensors, {"step": 7}, cfg.to_dict(),
                                drafter="eagle3")
    (tmp_path / "run" / "config.json").write_text(json.dumps({"producer": {"target": str(TARGET)}}))
    out = export_eagle3(step, tmp_path / "export", dtype="bfloat16")
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLMEagle3"] and conf["num_hidden_layers"] == 1
    assert conf["draft_vocab_size"] == 3000 and conf["vocab_size"] == 8192 and conf["tie_word_embeddings"] is False
    assert conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert "eagle_aux_hidden_state_layer_ids" not in conf        # the engines' default layers: no vLLM override
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        got = {k: f.get_tensor(k) for k in names}
    assert names == ENGINE_NAMES
    assert got["fc.weight"].shape == (256, 768) and got["midlayer.self_attn.q_proj.weight"].shape == (256, 512)
    assert got["lm_head.weight"].shape == (3000, 256) and got["lm_head.weight"].dtype == torch.bfloat16
    assert got["d2t"].dtype == torch.int64 and torch.equal(torch.nonzero(got["t2d"]).flatten(),
                                                           got["d2t"] + torch.arange(3000))
    assert oct((out / "model.safetensors").stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    bad = dict(got)
    bad["d2t"] = bad["d2t"] + torch.arange(3000)               # absolute ids instead of offsets
    with pytest.raises(ValueError, match="offsets"):
        check_eagle3_export(conf, bad)
    with pytest.raises(ValueError, match="missing"):
        check_eagle3_export(conf, {k: v for k, v in got.items() if k != "d2t"})
    with pytest.raises(ValueError, match="lacks"):
        check_eagle3_export({k: v for k, v in conf.items() if k != "draft_vocab_size"}, got)
    # read back as served (launch.py eval --drafter EXPORT): the exported weights in bf16, the target's embedding
    from specring.shared.drafters import load_export as load_exported_as_served
    served = load_exported_as_served(out)
    assert isinstance(served, Eagle3Drafter) and served.fc.weight.dtype == torch.bfloat16
    assert torch.equal(served.d2t, d2t) and served.config.ttt_steps == 2
    assert torch.equal(served.embed_tokens.weight, model.embed_tokens.weight)
    assert torch.equal(served.lm_head.weight, model.lm_head.weight.bfloat16())


def _umask() -> int:
    import os
    old = os.umask(0)
    os.umask(old)
    return old
