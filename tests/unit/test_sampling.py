"""Lossless speculative sampling (shared/models/speculative.py, temperature > 0) on a tiny random target, CPU.

The key check: whatever the drafter, the tokens speculative sampling emits are distributed as the target's own
(Leviathan et al. 2023; Chen et al. 2023). A fixed prompt is decoded with many seeds, 3 tokens each; the exact
joint distribution of those 3 tokens is enumerated with the target (``V**3`` cells, ``V = 24``) and a chi-square
test (cells expected under 5 times merged) must stay under its 1e-4 quantile. The same statistic, with the
rejection step broken (every draft accepted; the replacement drawn from ``p`` instead of ``max(0, p - q)``),
must exceed it: the bound has power. The drafters are random, with a flatter head than the target's, so their
``q`` differs from ``p`` and both acceptances and rejections happen.
"""

from __future__ import annotations

import math

import pytest
import torch

from specring.cli.eval import main
from specring.shared.drafters.tau import evaluate_tau
from specring.shared.models import speculative as spec
from specring.shared.models.dflash import DFlashConfig, DFlashDrafter
from specring.shared.models.eagle3 import (
    Eagle3Config,
    Eagle3Drafter,
    build_draft_vocab,
    draft_to_target,
    eagle3_chain,
    eagle3_extend,
)
from specring.shared.models.ngram import PromptLookupProposer
from specring.shared.models.speculative import (
    DFlashProposer,
    Eagle3Proposer,
    SamplePicker,
    SamplingParams,
    eagle3_chain_pick,
    greedy_generate,
    rejection_sample,
    sample_generate,
    speculative_generate,
)

V = 24                 # vocabulary of the tiny target
LAYERS = [0, 1, 2]     # captured target layers (the tiny target has 3)
PROMPT = [1, 5, 7, 2, 9, 4]
LOOKUP = PROMPT + [0, 17, 17] + PROMPT        # the target's likely continuation of PROMPT, then PROMPT: lookup finds it
NEW = 3                # tokens generated per run in the distribution tests
B = 3                  # verify block: 2 drafts per step


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def target():
    """A random 3-layer Qwen3 with a sharpened head (logits x20), so each next-token distribution puts its
    mass on a few tokens and the 3-token joint has few cells that matter."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model


def dflash_drafter(target, seed=1):
    """A random DFlash drafter on the target's embedding, with the target's head scaled by 0.2 (a flatter q)."""
    cfg = DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=V,
                       max_position_embeddings=64, target_layer_ids=LAYERS, num_target_layers=3, block_size=B,
                       mask_token_id=V - 1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DFlashDrafter(cfg).eval()
    model.load_frozen(target.model.embed_tokens.weight, target.lm_head.weight * 0.2)
    return model


def eagle3_drafter(target, draft_vocab=16, seed=2):
    """A random EAGLE-3 drafter whose draft vocabulary holds 16 of the 24 ids (q is 0 on the other 8)."""
    cfg = Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=V, draft_vocab_size=draft_vocab,
                       target_hidden_size=32, max_position_embeddings=64, target_layer_ids=LAYERS, ttt_steps=B - 1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Eagle3Drafter(cfg).eval()
        model.set_draft_vocab(*build_draft_vocab(torch.randint(0, 100, (V,)), draft_vocab))
    model.load_frozen(target.model.embed_tokens.weight)
    with torch.no_grad():
        model.lm_head.weight.copy_(target.lm_head.weight[draft_to_target(model.d2t)] * 0.2)
    return model


# ------------------------------------------------------------------------------------------ statistics
@torch.no_grad()
def exact_joint(target, prompt, params):
    """``[V**3]`` float64: the target's probability of each 3-token continuation ``(a, b, c)`` of ``prompt``
    (index ``a*V*V + b*V + c``), each token from ``params.probs`` of the target's logits."""
    p1 = params.probs(target(torch.tensor([prompt])).logits[:, -1])[0]
    p2 = params.probs(target(torch.tensor([prompt + [a] for a in range(V)])).logits[:, -1])
    p3 = params.probs(target(torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])).logits[:, -1])
    return (p1[:, None, None] * p2[:, :, None] * p3.view(V, V, V)).flatten().double()


def chi_square(counts, probs):
    """Pearson's statistic of ``counts`` against ``probs`` with every cell expected under 5 times merged into
    one (folded into the smallest kept cell when that one is still under 5). Returns ``(stat, df)``."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
        i = int(exp.argmin())
        obs[i] += counts[~big].sum()
        exp[i] += expected[~big].sum()
    return float(((obs - exp) ** 2 / exp).sum()), int(obs.numel()) - 1


def chi_square_bound(df, z=3.719):
    """The chi-square quantile at 1 - 1e-4 (``z``: the normal's) by Wilson and Hilferty's approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def continuation_counts(target, make_proposer, prompt, params, runs, layers=LAYERS):
    """Counts ``[V**3]`` of the 3-token outputs of ``runs`` seeded speculative-sampling runs, and the fraction
    of runs in which a verify step that produced token 2 or 3 accepted a draft."""
    counts = torch.zeros(V ** 3, dtype=torch.float64)
    accepted = 0
    proposer = make_proposer()
    for seed in range(runs):
        res = speculative_generate(target, proposer, prompt, NEW, B, layers, sampling=params,
                                   generator=torch.Generator().manual_seed(seed))
        a, b, c = res.tokens
        counts[a * V * V + b * V + c] += 1
        produced, hit = 1, False
        for length in res.accept_lengths:
            if produced >= NEW:
                break
            hit |= length > 1
            produced += length
        accepted += hit
    return counts, accepted / runs


def always_accept(drafts, q, p, generator):
    """Broken rule: every draft accepted, the bonus from p."""
    return len(drafts), spec.draw(p[len(drafts)], generator)


def replacement_from_p(drafts, q, p, generator):
    """Broken rule: the acceptance test is right, but the replacement is drawn from p, not max(0, p - q)."""
    n = len(drafts)
    a = 0
    if n:
        idx, rows = torch.tensor(drafts), torch.arange(n)
        a = int((torch.rand(n, generator=generator) * q[rows, idx] < p[rows, idx]).long().cumprod(0).sum())
    return a, spec.draw(p[a], generator)


# ------------------------------------------------------------------------------------------ SamplingParams
def test_sampling_params_reject_bad_values_naming_the_field():
    for kwargs, field in (({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
                          ({"temperature": float("inf")}, "temperature"), ({"temperature": True}, "temperature"),
                          ({"temperature": 1.0, "top_p": 0.0}, "top_p"), ({"temperature": 1.0, "top_p": 1.5}, "top_p"),
                          ({"temperature": 1.0, "top_k": -1}, "top_k"), ({"temperature": 1.0, "top_k": 2.5}, "top_k")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)
    p = SamplingParams(1, top_p=1, top_k=3)
    assert (p.temperature, p.top_p, p.top_k) == (1.0, 1.0, 3) and isinstance(p.temperature, float)
    assert SamplingParams(0).greedy and not p.greedy
    with pytest.raises(AttributeError):
        p.temperature = 2.0                                             # frozen


def test_probs_applies_temperature_then_top_k_then_top_p():
    base = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = base.log()[None].to(torch.bfloat16).float()
    exact = torch.softmax(logits, -1)
    out = SamplingParams(1.0).probs(logits.to(torch.bfloat16))
    assert out.dtype == torch.float32 and out.shape == (1, 4)
    torch.testing.assert_close(SamplingParams(1.0).probs(logits), exact)
    torch.testing.assert_close(SamplingParams(0.5).probs(logits), torch.softmax(logits / 0.5, -1))
    # top-k keeps exactly k, renormalised
    k2 = SamplingParams(1.0, top_k=2).probs(logits)[0]
    torch.testing.assert_close(k2, torch.tensor([exact[0, 0], exact[0, 1], 0, 0]) / exact[0, :2].sum())
    assert SamplingParams(1.0, top_k=4).probs(logits).equal(SamplingParams(1.0).probs(logits))  # k >= V: off
    # top-p: a token stays while the mass before it is below top_p (so the most likely one always does)
    p = exact[0]
    for top_p, kept in ((0.7, 2), (float(p[0]) + 1e-3, 2), (float(p[0]) - 1e-3, 1), (0.01, 1), (0.97, 4)):
        got = SamplingParams(1.0, top_p=top_p).probs(logits)[0]
        want = torch.cat([p[:kept] / p[:kept].sum(), torch.zeros(4 - kept)])
        torch.testing.assert_close(got, want, msg=f"top_p={top_p}")
    # top-k first, then top-p on the renormalised top-k: [0.5, 0.3, 0.15] / 0.95, mass before the third 0.84
    both = SamplingParams(1.0, top_k=3, top_p=0.8).probs(logits)[0]
    torch.testing.assert_close(both, torch.cat([p[:2] / p[:2].sum(), torch.zeros(2)]))
    # batch rows are independent, each sums to 1; -inf logits get 0; temperature 0 is the argmax one-hot
    rows = torch.randn(5, 7)
    rows[0, 3] = float("-inf")
    out = SamplingParams(0.8, top_p=0.9, top_k=5).probs(rows)
    torch.testing.assert_close(out.sum(-1), torch.ones(5))
    assert out[0, 3] == 0 and ((out > 0).sum(-1) <= 5).all()
    assert SamplingParams(0).probs(rows).equal(torch.nn.functional.one_hot(rows.argmax(-1), 7).float())


def test_rejection_sample_accepts_exact_drafts_and_replaces_from_the_residual():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, 6), -1)
    drafts = [int(p[0].argmax()), int(p[1].argmax())]
    for _ in range(20):                                   # q == p: u * q < p always, so all are accepted
        a, _ = rejection_sample(drafts, p[:2].clone(), p, g)
        assert a == 2
    # q all on token 0, p gives it nothing: always rejected, and the replacement never is token 0
    p = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.4, 0.4]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    for _ in range(20):
        a, tok = rejection_sample([0], q, p, g)
        assert a == 0 and tok in (1, 2)
    # residual max(0, p - q): q covers token 1 more than p does, so only token 0 or 2 can replace
    p = torch.tensor([[0.3, 0.3, 0.4], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.0, 1.0, 0.0]])
    seen = {rejection_sample([1], q, p, g) for _ in range(200)}
    assert seen <= {(1, 0), (0, 0), (0, 2)} and (0, 2) in seen and (1, 0) in seen
    assert rejection_sample([], torch.zeros(0, 3), torch.tensor([[0.0, 0.0, 1.0]]), g) == (0, 2)   # no drafts


# ------------------------------------------------------------------------------------------ proposers
def test_proposers_return_the_distribution_each_draft_was_drawn_from(target):
    params = SamplingParams(1.0)
    g = torch.Generator().manual_seed(3)
    # DFlash: parallel slots, q rows are params.probs of the block rows
    drafter = dflash_drafter(target)
    prop = DFlashProposer(drafter)
    prop.reset(PROMPT)
    feats = torch.randn(len(PROMPT), 3 * 32)
    prop.add_context(feats, torch.arange(len(PROMPT)))
    drafts, q = prop.propose_sample(PROMPT + [3], 5, params, g)
    assert len(drafts) == B - 1 and q.shape == (B - 1, V) and q.dtype == torch.float32
    logits, _ = drafter.draft_block(feats, torch.arange(len(PROMPT)), 3, len(PROMPT), None, block_size=B)
    torch.testing.assert_close(q, params.probs(logits[1:]))
    assert all(q[j, d] > 0 for j, d in enumerate(drafts))
    # EAGLE-3: a chain over the draft vocabulary, zero outside it; with an argmax pick it is eagle3_chain
    e3 = eagle3_drafter(target)
    in_vocab = torch.zeros(V, dtype=torch.bool)
    in_vocab[draft_to_target(e3.d2t)] = True
    prop = Eagle3Proposer(e3, B - 1)
    prop.reset(PROMPT)
    prop.add_context(feats, torch.arange(len(PROMPT)))
    drafts, q = prop.propose_sample(PROMPT + [3], 5, params, g)
    assert len(drafts) == B - 1 and q.shape == (B - 1, V)
    assert (q[:, ~in_vocab] == 0).all() and all(in_vocab[d] and q[j, d] > 0 for j, d in enumerate(drafts))
    torch.testing.assert_close(q.sum(-1), torch.ones(B - 1))
    nxt = torch.tensor(PROMPT[1:] + [3])
    cache, out = eagle3_extend(e3, None, feats, nxt, torch.arange(len(PROMPT)))
    greedy, _ = eagle3_chain(e3, cache, out[-1], len(PROMPT) - 1, 4)
    assert eagle3_chain_pick(e3, cache, out[-1], len(PROMPT) - 1, 4, lambda lg: int(lg.argmax())) == greedy
    # the chain feeds each drawn token to the next step: a fixed first token changes the second row's q
    second = []
    for first in draft_to_target(e3.d2t)[:2].tolist():
        pick = SamplePicker(params, torch.Generator().manual_seed(0), V)
        seen = []

        def choose(lg, first=first, pick=pick, seen=seen):
            seen.append(lg)
            return first if len(seen) == 1 else pick(lg)

        eagle3_chain_pick(e3, cache, out[-1], len(PROMPT) - 1, 2, choose)
        second.append(pick.q()[0])
    assert not torch.allclose(second[0], second[1])
    # prompt lookup: a deterministic proposal, q one-hot; vocab_size is needed
    pl = PromptLookupProposer(vocab_size=V)
    drafts, q = pl.propose_sample([1, 2, 3, 1, 2], 3, params, g)
    assert drafts == [3, 1, 2] and q.equal(torch.nn.functional.one_hot(torch.tensor(drafts), V).float())
    assert pl.propose_sample([1, 2, 3], 3, params, g)[1].shape == (0, V)
    with pytest.raises(ValueError, match="vocab_size"):
        PromptLookupProposer().propose_sample([1, 2, 1], 2, params, g)


# ------------------------------------------------------------------------------------------ greedy and seeds
def test_temperature_zero_takes_the_greedy_path_bit_for_bit(target):
    ref = greedy_generate(target, PROMPT, 12)
    g = torch.Generator().manual_seed(5)
    state = g.get_state()
    for make in (lambda: DFlashProposer(dflash_drafter(target)), lambda: Eagle3Proposer(eagle3_drafter(target), B - 1),
                 lambda: PromptLookupProposer()):
        plain = speculative_generate(target, make(), PROMPT, 12, B, LAYERS)
        zero = speculative_generate(target, make(), PROMPT, 12, B, LAYERS, sampling=SamplingParams(0.0, 0.5, 3),
                                    generator=g)
        assert zero.tokens == plain.tokens == ref.tokens
        assert zero.accept_lengths == plain.accept_lengths and zero.drafted == plain.drafted
    assert g.get_state().equal(state)                      # no random draw at temperature 0
    assert sample_generate(target, PROMPT, 12, SamplingParams(0.0), g).tokens == ref.tokens


def test_a_seed_reproduces_a_sampled_run(target):
    params = SamplingParams(1.0, top_p=0.95)
    for make in (lambda: DFlashProposer(dflash_drafter(target)), lambda: Eagle3Proposer(eagle3_drafter(target), B - 1),
                 lambda: PromptLookupProposer(vocab_size=V)):
        runs = [speculative_generate(target, make(), LOOKUP, 10, B, LAYERS, sampling=params,
                                     generator=torch.Generator().manual_seed(s)) for s in (7, 7, 8, 9, 10)]
        assert runs[0].tokens == runs[1].tokens and runs[0].accept_lengths == runs[1].accept_lengths
        assert len({tuple(r.tokens) for r in runs}) > 1    # other seeds, other samples
        assert all(len(r.tokens) == 10 and r.target_forwards == 1 + len(r.accept_lengths) for r in runs)
    one = sample_generate(target, PROMPT, 6, params, torch.Generator().manual_seed(1))
    assert one.tokens == sample_generate(target, PROMPT, 6, params, torch.Generator().manual_seed(1)).tokens
    assert one.target_forwards == 6 and len(one.tokens) == 6


# ------------------------------------------------------------------------------------------ distributions
RUNS = 1000


@pytest.fixture(scope="module")
def dflash_counts(target):
    params = SamplingParams(1.0)
    counts, accepted = continuation_counts(target, lambda: DFlashProposer(dflash_drafter(target)), PROMPT, params,
                                           RUNS)
    return counts, accepted, exact_joint(target, PROMPT, params)


def test_dflash_speculative_sampling_emits_the_target_distribution(dflash_counts):
    counts, accepted, joint = dflash_counts
    assert 0.2 < accepted < 0.8                            # drafts are accepted, and rejected
    stat, df = chi_square(counts, joint)
    assert df >= 20 and stat < chi_square_bound(df), (stat, df, chi_square_bound(df))


@pytest.mark.parametrize("broken", [always_accept, replacement_from_p], ids=["always-accept", "replacement-from-p"])
def test_the_bound_catches_a_broken_rejection_step(target, dflash_counts, monkeypatch, broken):
    """The same runs and statistic with the rule broken fail the bound: the test above has power."""
    joint = dflash_counts[2]
    monkeypatch.setattr(spec, "rejection_sample", broken)
    counts, _ = continuation_counts(target, lambda: DFlashProposer(dflash_drafter(target)), PROMPT,
                                    SamplingParams(1.0), RUNS)
    stat, df = chi_square(counts, joint)
    assert stat > chi_square_bound(df), (stat, df, chi_square_bound(df))


def dflash2_drafter(target, seed=3):
    """A random DFlash2 drafter whose selector offers 8 of the 24 ids per slot (q is 0 on the other 16) and, with a
    non-zero hidden projection, makes each slot's q depend on the draft before it."""
    from specring.shared.models.dflash2 import DFlash2Config, DFlash2Drafter
    cfg = DFlash2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=V,
                        max_position_embeddings=64, target_layer_ids=LAYERS, num_target_layers=3, block_size=B,
                        mask_token_id=V - 1, conv_group_size=8, selector_top_k=8, selector_rank=4)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DFlash2Drafter(cfg).eval()
        with torch.no_grad():
            model.candidate_selector.hidden_projection.weight.normal_(0, 0.5)
    model.load_frozen(target.model.embed_tokens.weight, target.lm_head.weight * 0.2)
    return model


@pytest.mark.parametrize("kind", ["eagle3", "prompt-lookup", "dflash2"])
def test_eagle3_and_prompt_lookup_sampling_emit_the_target_distribution(target, kind):
    """EAGLE-3 (q over a draft vocabulary of 16 of the 24 ids, top-p 0.9), prompt lookup (one-hot q, top-k 6) and
    DFlash2 (q over its selector's 8 candidates, each slot given the draft before it, top-p 0.9)."""
    if kind == "dflash2":
        from specring.shared.models.speculative import DFlash2Proposer
        params, prompt = SamplingParams(1.0, top_p=0.9), PROMPT
        make = lambda: DFlash2Proposer(dflash2_drafter(target))          # noqa: E731
    elif kind == "eagle3":
        params, prompt = SamplingParams(1.0, top_p=0.9), PROMPT
        make = lambda: Eagle3Proposer(eagle3_drafter(target), B - 1)   # noqa: E731
    else:
        params, prompt = SamplingParams(1.0, top_k=6), LOOKUP
        make = lambda: PromptLookupProposer(vocab_size=V)               # noqa: E731
    counts, accepted = continuation_counts(target, make, prompt, params, 500)
    assert 0.1 < accepted < 0.9
    stat, df = chi_square(counts, exact_joint(target, prompt, params))
    assert df >= 10 and stat < chi_square_bound(df), (stat, df, chi_square_bound(df))


def test_sampling_on_a_hybrid_target_emits_the_target_distribution():
    """A Qwen3.5-shaped target (Gated DeltaNet linear-attention layers before a full-attention one, issue 24): each
    partial acceptance restores the linear-attention states and re-runs the accepted tokens (``TargetCache``), and
    the emitted tokens are still distributed as the target's own."""
    from tests.support import tiny_target

    target = tiny_target("qwen3_5", vocab_size=V, num_layers=3, initializer_range=0.02)  # linear, linear, full
    with torch.no_grad():
        target.lm_head.weight.mul_(20.0)
    params = SamplingParams(1.0)
    counts, accepted = continuation_counts(target, lambda: DFlashProposer(dflash_drafter(target)), PROMPT, params,
                                           400)
    assert 0.2 < accepted < 0.9
    stat, df = chi_square(counts, exact_joint(target, PROMPT, params))
    assert df >= 10 and stat < chi_square_bound(df), (stat, df, chi_square_bound(df))
    res = speculative_generate(target, DFlashProposer(dflash_drafter(target)), PROMPT, 8, B, LAYERS, sampling=params,
                               generator=torch.Generator().manual_seed(0))
    assert res.cache_rollback == "replay"


# ------------------------------------------------------------------------------------------ evaluate_tau, CLI
def test_evaluate_tau_samples_reproducibly_and_reports_no_lossless_check(target):
    params = SamplingParams(0.9, top_k=8)
    drafter = dflash_drafter(target).train()
    kw = dict(block_size=B, check_lossless=True, sampling=params)
    a = evaluate_tau(target, drafter, [PROMPT, LOOKUP], 8, LAYERS, seed=3, **kw)
    assert drafter.training                                # mode restored
    b = evaluate_tau(target, drafter, [PROMPT, LOOKUP], 8, LAYERS, seed=3, **kw)
    assert a["lossless_mismatches"] is None and a["greedy_tokens_per_s"] > 0
    assert a["sampling"] == params.to_dict() and a["sampling_seed"] == 3
    assert a["accept_hist"] == b["accept_hist"] and a["tau_mean"] == b["tau_mean"]
    lookup = PromptLookupProposer()                        # no vocab_size: evaluate_tau sizes a copy
    out = evaluate_tau(target, lookup, [LOOKUP], 8, None, block_size=B, sampling=params)
    assert out["tau_mean"] >= 1.0 and lookup.vocab_size is None
    greedy = evaluate_tau(target, drafter, [PROMPT], 8, LAYERS, block_size=B, check_lossless=True,
                          sampling=SamplingParams(0))
    assert greedy["lossless_mismatches"] == 0 and "sampling" not in greedy


def test_cli_rejects_bad_sampling_flags_before_loading_anything(capsys):
    for flags, name in ((["--temperature", "-1"], "--temperature"), (["--temperature", "nan"], "--temperature"),
                        (["--temperature", "1", "--top-p", "0"], "--top-p"), (["--top-p", "1.2"], "--top-p"),
                        (["--top-k", "-2"], "--top-k"), (["--sampling-seed", "-1"], "--sampling-seed")):
        try:
            code = main(["--drafter", "/nonexistent", *flags])
        except SystemExit as e:  # nan: refused while parsing (EvalConfig's bounds refuse the others)
            code = e.code
        assert code == 2
        assert name in capsys.readouterr().err


def test_cli_sampled_rows_record_the_parameters(tmp_path, capsys):
    import numpy as np
    import pyarrow as pa
    import pyarrow.ipc as ipc

    rows = [list(range(10, 40)) * 2, list(range(50, 90))]
    table = pa.table({"input_ids": pa.array([np.asarray(r, np.int32) for r in rows], type=pa.list_(pa.int32())),
                      "loss_mask": pa.array([np.ones(len(r), np.uint8) for r in rows], type=pa.list_(pa.uint8()))})
    data = tmp_path / "heldout.arrow"
    with ipc.new_file(str(data), table.schema) as w:
        w.write_table(table)
    out = tmp_path / "tau.json"
    argv = ["--drafter", "none", "--data", str(data), "--num-prompts", "2", "--prompt-len", "24", "--max-new-tokens",
            "6", "--device", "cpu", "--block-size", "4", "--temperature", "0.8", "--top-p", "0.9", "--top-k", "50",
            "--sampling-seed", "4", "--output-json", str(out)]
    assert main(argv) == 0
    import json

    report = json.loads(out.read_text())
    assert report["sampling"] == {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 4}
    assert report["lossless_check"].startswith("not applicable")
    names = [r["drafter"] for r in report["rows"]]
    assert names[0] == "target greedy (speed baseline)" and len(names) == 3
    assert all(r["lossless_mismatches"] is None for r in report["rows"][1:])
    printed = capsys.readouterr().out
    assert "n/a" in printed and "T=0.8" in printed
    assert main(argv) == 0                                  # the seed reproduces every row
    again = json.loads(out.read_text())
    assert [r["accept_hist"] for r in again["rows"]] == [r["accept_hist"] for r in report["rows"]]
