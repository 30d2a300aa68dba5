"""Speculative decoding and τ (shared/models/speculative.py, shared/models/ngram.py) on the fixture target, fp32 CPU.

Prompts are held-out stdlib code (files the fixture never trained on, by ``shared.data.demo.is_heldout``),
tokenized here so the tests need no prepared demo corpus.
"""

import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import torch

from specring.cli.eval import main
from specring.shared.data.prompts import load_prompts
from specring.shared.drafters import checkpoint as ckpt
from specring.shared.drafters.dflash_blocks import (
    block_loss,
    build_block_batch,
    loss_weights,
    sample_anchors,
)
from specring.shared.drafters.tau import evaluate_tau
from specring.shared.models.dflash import DFlashConfig, build_drafter
from specring.shared.models.draft_attention import build_attention_mask
from specring.shared.models.ngram import PromptLookupProposer
from specring.shared.models.speculative import (
    DecodeResult,
    DFlashProposer,
    greedy_generate,
    speculative_generate,
    summarize,
)
from specring.shared.models.target import load_target
from tests.support import TARGET, NoDraftProposer, stdlib_prompts

LAYERS = [1, 3, 5]
EOS = 0
NEW = 24


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def target():
    model, _ = load_target(TARGET, "cpu", "float32")
    return model


@pytest.fixture(scope="module")
def prompts():
    """Four 64-token prompts from the middle of held-out stdlib files."""
    return stdlib_prompts(("copy.py", "base64.py", "gzip.py", "enum.py"), 300, (64,) * 4)


@pytest.fixture(scope="module")
def dcfg():
    return DFlashConfig.from_target(TARGET, LAYERS, block_size=8, mask_token_id=3)


@pytest.fixture(scope="module")
def untrained(dcfg):
    return untrained_drafter(dcfg, TARGET, "cpu", torch.float32, seed=0)


@pytest.fixture(scope="module")
def greedy_refs(target, prompts):
    return [greedy_generate(target, p, NEW, [EOS]).tokens for p in prompts]


class OracleProposer:
    """Knows the greedy continuation; proposes its first ``j`` tokens right (``j`` random, sometimes all)
    and then wrong ones, so every acceptance length occurs and is known in advance."""

    name = "oracle"
    needs_features = False

    def __init__(self, prompt_len, truth, seed=0):
        self.prompt_len, self.truth = prompt_len, truth
        self.rng = random.Random(seed)
        self.planned = []          # (k, j) per call

    def reset(self, prompt_ids):
        pass

    def add_context(self, features, positions):
        pass

    def propose(self, tokens, k):
        done = len(tokens) - self.prompt_len            # generated so far, anchor included
        future = self.truth[done:done + k]
        j = self.rng.choice([0, 1, len(future) // 2, len(future), len(future)])
        draft = list(future[:j]) + [(t + 1) % 8192 for t in future[j:]]
        self.planned.append((len(draft), j))
        return draft


# ------------------------------------------------------------------------------------------ prompt lookup
def test_prompt_lookup_proposes_the_continuation_of_the_most_recent_match():
    p = PromptLookupProposer(max_ngram=3)
    assert p.propose([1, 2, 3, 4, 9, 1, 2, 3], 3) == [4, 9, 1]
    assert p.propose([5, 6, 7, 5, 6, 8, 5, 6], 5) == [8, 5, 6]      # most recent [5, 6] wins over the first
    assert p.propose([1, 2, 3, 7, 3], 2) == [7, 3]                     # falls back to a 1-gram
    assert p.propose([1, 2, 3, 4], 4) == []                            # no earlier occurrence
    assert p.propose([1, 2, 1], 0) == [] and p.propose([1], 3) == []
    assert PromptLookupProposer(max_ngram=2, min_ngram=2).propose([1, 2, 3, 7, 3], 2) == []
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupProposer(max_ngram=1, min_ngram=2)


# ------------------------------------------------------------------------------------------ losslessness
def test_greedy_reference_matches_transformers_generate(target, prompts, greedy_refs):
    ids = torch.tensor([prompts[0]])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                          eos_token_id=EOS, pad_token_id=3)
    assert out[0, ids.shape[1]:].tolist() == greedy_refs[0]



def untrained_drafter(dcfg, target_dir, device, dtype, seed: int = 0):
    """A seeded untrained DFlash drafter with the target's head (the global RNG untouched), eval mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_drafter(dcfg, target_dir, device="cpu", dtype=dtype)
    return model.to(device).eval()


def test_speculative_output_equals_greedy_for_every_proposer(target, prompts, greedy_refs, untrained):
    proposers = [DFlashProposer(untrained), PromptLookupProposer(), NoDraftProposer()]
    for prop in proposers:
        for p, ref in zip(prompts, greedy_refs):
            res = speculative_generate(target, prop, p, NEW, 8, LAYERS, [EOS])
            assert res.tokens == ref, prop.name
            assert res.target_forwards == 1 + len(res.accept_lengths)
            # z-lab's counting: steps are not cut at the limit, and run while at most NEW tokens exist
            produced = 1 + sum(res.accept_lengths)
            assert produced >= len(res.tokens)
            if not res.stopped:
                assert produced > NEW and produced - res.accept_lengths[-1] <= NEW


def test_every_acceptance_length_is_counted_exactly_and_stays_lossless(target, prompts):
    for i, p in enumerate(prompts[:3]):
        truth = greedy_generate(target, p, 60).tokens          # no stop token; the last step may look past 40
        oracle = OracleProposer(len(p), truth, seed=i)
        res = speculative_generate(target, oracle, p, 40, 8, None)
        assert res.tokens == truth[:40]
        produced = 1                                            # the prefill's token
        for (k, j), length in zip(oracle.planned, res.accept_lengths):
            assert k == 7                                       # always B - 1 drafts, as the reference
            assert length == j + 1, (k, j, length)              # j accepted drafts + the bonus, never cut
            assert produced <= 40                               # a step runs only while <= 40 tokens exist
            produced += length
        assert produced > 40
        assert max(res.accept_lengths) == 8                     # full acceptance happened: 7 drafts + bonus


def test_stop_token_ends_both_decodes_at_the_same_place(target, prompts):
    # use the 5th greedy token as a "stop token": both decodes must stop right after it
    full = greedy_generate(target, prompts[1], 16).tokens
    stop = full[4]
    ref = greedy_generate(target, prompts[1], 16, [stop])
    spec = speculative_generate(target, OracleProposer(len(prompts[1]), full, seed=3), prompts[1], 16, 8, None,
                                [stop])
    assert ref.tokens == spec.tokens == full[:full.index(stop) + 1] and spec.stopped and ref.stopped


# ------------------------------------------------------------------------------------------ drafter context
class OracleDFlash(DFlashProposer):
    """Runs the real drafter (its cache and context bookkeeping) but returns oracle drafts, so verify steps
    accept several tokens and the context grows by more than one token at a time."""

    def __init__(self, drafter, oracle):
        super().__init__(drafter)
        self.oracle = oracle
        self.calls = []              # (anchor_pos, anchor, k, logits, context positions fed so far)
        self.fed = []

    def add_context(self, features, positions):
        self.fed.append((features.clone(), positions.clone()))
        super().add_context(features, positions)

    def propose(self, tokens, k):
        orig = self.drafter.draft_block

        def record(feats, pos, anchor, anchor_pos, cache, block_size):
            logits, cache = orig(feats, pos, anchor, anchor_pos, cache, block_size=block_size)
            self.calls.append((anchor_pos, anchor, block_size - 1, logits.clone(),
                               torch.cat([p for _, p in self.fed])))
            return logits, cache

        self.drafter.draft_block = record
        try:
            super().propose(tokens, k)
        finally:
            del self.drafter.draft_block
        return self.oracle.propose(tokens, k)


def test_drafter_sees_exactly_the_verified_context_before_its_anchor(target, prompts, untrained):
    p = prompts[2]
    truth = greedy_generate(target, p, 32).tokens
    spy = OracleDFlash(untrained, OracleProposer(len(p), truth, seed=7))
    res = speculative_generate(target, spy, p, 32, 8, LAYERS)
    assert res.tokens == truth and max(res.accept_lengths) > 2
    seq = torch.tensor([p + truth])
    with torch.no_grad():
        hs = target(input_ids=seq, output_hidden_states=True).hidden_states
    full = torch.cat([hs[i + 1][0] for i in LAYERS], dim=-1)       # [T, 3H], DFlash layer-id convention
    fed_pos = torch.cat([q for _, q in spy.fed])
    fed_feat = torch.cat([f for f, _ in spy.fed])
    assert torch.equal(fed_pos, torch.arange(fed_pos.numel()))      # every position once, in order
    torch.testing.assert_close(fed_feat, full[:fed_pos.numel()], atol=2e-4, rtol=1e-4)
    for anchor_pos, anchor, k, logits, ctx_pos in spy.calls:
        assert torch.equal(ctx_pos, torch.arange(anchor_pos))        # context = every token before the anchor
        assert anchor == seq[0, anchor_pos]
        ids = torch.full((k + 1,), 3)
        ids[0] = anchor
        with torch.no_grad():
            h = untrained(ids, torch.arange(anchor_pos, anchor_pos + k + 1), full[:anchor_pos],
                          torch.arange(anchor_pos), None)
            ref = untrained.logits(h).float()
        torch.testing.assert_close(logits, ref, atol=1e-3, rtol=1e-4)


# ------------------------------------------------------------------------------------------ figures
def test_summarize_reports_reference_style_figures():
    a = DecodeResult(prompt_len=4, tokens=[1] * 7, accept_lengths=[1, 3, 2], drafted=[3, 3, 3],
                     target_forwards=4, wall_s=1.0)
    b = DecodeResult(prompt_len=4, tokens=[1] * 5, accept_lengths=[4], drafted=[3], target_forwards=2, wall_s=1.0)
    s = summarize([a, b], 4)
    assert s["tau_mean"] == pytest.approx((2.0 + 4.0) / 2)            # mean of per-prompt means
    assert s["tau_pooled"] == pytest.approx(10 / 4)
    assert s["accept_hist"] == {"1": 1, "2": 1, "3": 1, "4": 1}
    assert s["forwards_per_token"] == pytest.approx(6 / 12)
    assert s["tokens_per_s"] == pytest.approx(6.0) and s["verify_steps"] == 4
    empty = summarize([DecodeResult(prompt_len=4, tokens=[5], target_forwards=1)], 4)
    assert empty["tau_mean"] is None and empty["forwards_per_token"] == 1.0


def test_evaluate_tau_reuses_the_live_models_and_restores_the_mode(target, prompts, dcfg):
    drafter = untrained_drafter(dcfg, TARGET, "cpu", torch.float32).train()
    out = evaluate_tau(target, drafter, prompts[:2], 12, LAYERS, stop_token_ids=[EOS], check_lossless=True)
    assert drafter.training
    assert out["lossless_mismatches"] == 0 and out["num_prompts"] == 2
    # the reference runs one more verify step when exactly max_new_tokens exist: at most 13 forwards for 12
    assert out["tau_mean"] >= 1.0 and out["forwards_per_token"] <= 13 / 12
    ngram = evaluate_tau(target, PromptLookupProposer(), prompts[:2], 12, None, block_size=8, check_lossless=True)
    assert ngram["lossless_mismatches"] == 0 and ngram["tau_mean"] >= 1.0
    with pytest.raises(ValueError, match="layer_ids"):
        evaluate_tau(target, drafter, prompts[:1], 4, [1, 2, 3])


def _mini_train(target, dcfg, seqs, steps, lr=3e-3, seed=0, first_anchor=0):
    """DFlash steps on fixed sequences, in this process (shared/drafters/dflash_blocks.py conventions); anchors only at
    positions ``>= first_anchor`` of each sequence."""
    torch.manual_seed(seed)
    model = build_drafter(dcfg, TARGET).train()
    ids = torch.cat(seqs)
    cu = torch.tensor([0] + np.cumsum([s.numel() for s in seqs]).tolist())
    with torch.no_grad():
        pad = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)
        hs = target(input_ids=pad, output_hidden_states=True).hidden_states
    hidden = torch.cat([torch.cat([hs[i + 1][b, :s.numel()] for i in dcfg.target_layer_ids], -1)
                        for b, s in enumerate(seqs)])
    mask = torch.cat([(torch.arange(s.numel()) >= first_anchor).long() for s in seqs])
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=lr)
    w = loss_weights(dcfg.block_size, 4.0)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        anchors = sample_anchors(mask, cu, 24, dcfg.block_size, gen)
        bb = build_block_batch(ids, mask, cu, anchors, dcfg.block_size, dcfg.mask_token_id)
        am = build_attention_mask(anchors, cu, dcfg.block_size)
        h = model(bb.block_input_ids, bb.block_positions, hidden, bb.ctx_positions, am)
        loss = block_loss(model.logits, h, bb.labels, w)
        opt.zero_grad()
        (loss.weighted_ce / loss.weight_sum).backward()
        opt.step()
    return model.eval()


def test_a_trained_drafter_accepts_more_than_an_untrained_one(target, prompts, greedy_refs):
    """Training and decoding agree on the conventions (layer ids, context strictly before the anchor,
    same-position labels): a drafter fitted to the target's own continuations gets τ well above an
    untrained one. (Fitted on the continuations it is then asked to draft: a check of conventions, not of
    generalisation; the τ table in docs/evaluation.md measures that.)"""
    small = DFlashConfig.from_target(TARGET, LAYERS, block_size=4, mask_token_id=3, num_draft_layers=1)
    seqs = [torch.tensor(p + g) for p, g in zip(prompts[:2], greedy_refs[:2])]
    trained = _mini_train(target, small, seqs, steps=60, lr=3e-3, first_anchor=len(prompts[0]) - 1)
    untrained = untrained_drafter(small, TARGET, "cpu", torch.float32)
    tau_t = evaluate_tau(target, trained, prompts[:2], NEW, LAYERS, stop_token_ids=[EOS], check_lossless=True)
    tau_u = evaluate_tau(target, untrained, prompts[:2], NEW, LAYERS, stop_token_ids=[EOS])
    assert tau_t["lossless_mismatches"] == 0
    assert tau_t["tau_mean"] > tau_u["tau_mean"] + 0.5, (tau_t["tau_mean"], tau_u["tau_mean"])


# ------------------------------------------------------------------------------------------ inputs and CLI
def _write_arrow(path, rows):
    ids = pa.array([np.asarray(r, np.int32) for r in rows], type=pa.list_(pa.int32()))
    mask = pa.array([np.ones(len(r), np.uint8) for r in rows], type=pa.list_(pa.uint8()))
    table = pa.table({"input_ids": ids, "loss_mask": mask})
    with ipc.new_file(str(path), table.schema) as w:
        w.write_table(table)
    return path


def test_load_prompts_spreads_over_long_enough_samples(tmp_path):
    rows = [list(range(10)), list(range(100, 150)), list(range(200, 400)), list(range(500, 800)), [1, 2]]
    path = _write_arrow(tmp_path / "h.arrow", rows)
    two = load_prompts(path, 2, 40)
    assert two == [list(range(100, 140)), list(range(200, 240))]
    assert len(load_prompts(path, 10, 40)) == 3                      # only three samples are long enough
    with pytest.raises(ValueError, match="prompt-len"):
        load_prompts(path, 2, 1000)


def test_cli_reports_checkpoint_and_baselines_losslessly(tmp_path, prompts, dcfg, capsys):
    data = _write_arrow(tmp_path / "heldout.arrow", [p + p for p in prompts[:2]])
    torch.manual_seed(1)
    m = build_drafter(dcfg, TARGET)
    tensors = {**m.trainable_state_dict(), **m.frozen_state_dict()}
    ckpt.save_checkpoint(tmp_path / "run" / "checkpoints", 7, tensors, {"step": 7}, dcfg.to_dict())
    out_json = tmp_path / "tau.json"
    rc = main(["--drafter", str(tmp_path / "run"), "--data", str(data), "--num-prompts", "2", "--prompt-len", "48",
               "--max-new-tokens", "8", "--device", "cpu", "--output-json", str(out_json)])
    assert rc == 0
    report = json.loads(out_json.read_text())
    names = [r["drafter"] for r in report["rows"]]
    assert names[0].startswith("target greedy") and "dflash step-000007" in names
    assert any("untrained" in n for n in names) and any("prompt-lookup" in n for n in names)
    assert all(r.get("lossless_mismatches", 0) == 0 for r in report["rows"])
    assert report["target_layer_ids"] == LAYERS and report["block_size"] == 8
    assert "tau mean" in capsys.readouterr().out
    assert main(["--num-prompts", "0", "--data", str(data)]) == 2
    assert main(["--drafter", str(tmp_path / "nowhere"), "--data", str(data)]) == 2


def test_cli_names_a_decoding_failure_in_one_line_and_exits_1(tmp_path, prompts, capsys, monkeypatch):
    """Issue 24: a decode that raises (as a hybrid target's cache crop once did) is one ``error:`` line, exit 1,
    no traceback."""
    import specring.shared.commands.evaluation as evaluation

    data = _write_arrow(tmp_path / "heldout.arrow", [p + p for p in prompts[:1]])

    def broken(*args, **kwargs):
        raise RuntimeError("crop was called, but the current layer does not track past states.\nCall it first")

    monkeypatch.setattr(evaluation, "decode_prompts", broken)
    capsys.readouterr()
    rc = main(["--baselines-only", "--baselines", "prompt-lookup", "--data", str(data), "--num-prompts", "1",
               "--prompt-len", "48", "--max-new-tokens", "4", "--device", "cpu", "--no-lossless-check"])
    err = capsys.readouterr().err
    assert rc == 1
    lines = [x for x in err.splitlines() if x.startswith("error")]
    assert lines == ["error: evaluation failed: RuntimeError: crop was called, but the current layer does not "
                     "track past states. Call it first"], err
    assert "Traceback" not in err
