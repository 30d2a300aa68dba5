"""Batched decoding (shared/models/batched_decode.py) equals the one-prompt loop, prompt by prompt, in float32.

On the fixture target (assets/tiny-code-lm), prompts of different lengths from held-out stdlib code, a stop token
that ends some prompts early: every prompt's tokens, acceptance lengths, drafted counts and target forwards from
``batched_speculative_generate`` / ``batched_greedy_generate`` are those of ``speculative_generate`` /
``greedy_generate``, for DFlash, DFlash2 and EAGLE-3 drafters (untrained, and with perturbed weights) and prompt
lookup; the eval CLI decodes batched by default and says when and why it does not.
"""


import pytest
import torch

from specring.shared.drafters import get_family
from specring.shared.drafters.tau import evaluate_tau
from specring.shared.models.batched_decode import (
    BatchedTargetCache,
    batch_support,
    batched_greedy_generate,
    batched_proposer,
    batched_speculative_generate,
    decode_prompts,
)
from specring.shared.models.dflash import DFlashConfig
from specring.shared.models.dflash2 import DFlash2Config, DFlash2Drafter
from specring.shared.models.eagle3 import Eagle3Config, build_draft_vocab
from specring.shared.models.ngram import PromptLookupProposer
from specring.shared.models.speculative import SamplingParams, greedy_generate, speculative_generate
from specring.shared.models.target import load_target
from tests.support import TARGET, NoDraftProposer, stdlib_prompts

LAYERS = [1, 3, 5]
NEW = 40
LENGTHS = (40, 64, 23, 51, 33)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def target():
    model, _ = load_target(TARGET, "cpu", "float32")
    return model


@pytest.fixture(scope="module")
def prompts():
    """Five prompts of 23..64 tokens from held-out stdlib files."""
    return stdlib_prompts(("copy.py", "base64.py", "gzip.py", "enum.py", "difflib.py"), 200, LENGTHS)


@pytest.fixture(scope="module")
def stop(target, prompts):
    """A stop token the greedy continuation of the second prompt emits early (so it, and maybe others, stop)."""
    return [greedy_generate(target, prompts[1], 12).tokens[8]]


def drafter(kind: str, perturbed: bool, seed: int = 0):
    """An untrained drafter of ``kind`` on the fixture target; ``perturbed``: every trainable weight moved by
    N(0, 0.05) (DFlash2's selector projection and convolutions away from their zero/identity start)."""
    fam = get_family(kind)
    if kind == "dflash":
        cfg = DFlashConfig.from_target(TARGET, LAYERS, block_size=6, mask_token_id=3, num_draft_layers=1)
    elif kind == "dflash2":
        cfg = DFlash2Config.from_target(TARGET, LAYERS, block_size=6, mask_token_id=3, num_draft_layers=2,
                                        selector_top_k=8, selector_rank=16)
    else:
        cfg = Eagle3Config.from_target(TARGET, LAYERS, draft_vocab_size=2048, ttt_steps=4)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vocab = None
        if kind == "eagle3":
            vocab = build_draft_vocab(torch.randint(0, 1000, (cfg.vocab_size,)), cfg.draft_vocab_size)
        model = fam.build(cfg, TARGET, draft_vocab=vocab).float().eval()
        if perturbed:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if p.requires_grad:
                        p.add_(torch.randn_like(p) * 0.05)
    return fam, model


def assert_same(batched, single):
    assert len(batched) == len(single)
    for i, (b, s) in enumerate(zip(batched, single)):
        assert b.tokens == s.tokens, (i, b.tokens, s.tokens)
        assert b.accept_lengths == s.accept_lengths, (i, b.accept_lengths, s.accept_lengths)
        assert b.drafted == s.drafted, i
        assert b.target_forwards == s.target_forwards, i
        assert b.stopped == s.stopped, i


def recording(proposer, log: dict, batched: bool):
    """``proposer`` with its ``propose`` recording ``log[sequence so far] = drafts`` (every row of a batch)."""
    inner = proposer.propose

    def propose(seqs, k):
        out = inner(seqs, k)
        for seq, d in zip(seqs if batched else [seqs], out if batched else [out]):
            log[tuple(seq)] = list(d)
        return out

    proposer.propose = propose
    return proposer


@pytest.fixture(scope="module")
def fitted(target, prompts):
    """A DFlash drafter fitted to the target's greedy continuations of the prompts (tests/unit/test_evaluate.py's
    few training steps), so that it accepts several drafts at some steps and one at others."""
    from tests.unit.test_evaluate import _mini_train
    cfg = DFlashConfig.from_target(TARGET, LAYERS, block_size=6, mask_token_id=3, num_draft_layers=1)
    seqs = [torch.tensor(p + greedy_generate(target, p, NEW).tokens) for p in prompts]
    return _mini_train(target, cfg, seqs, steps=60, lr=3e-3, first_anchor=min(LENGTHS) - 1)


def fitted_dflash2(fitted):
    """The fitted DFlash drafter as a DFlash2 one (identity convolutions, its weights), the selector's projection
    non-zero so its walk departs from the argmax."""
    cfg = DFlash2Config(**{**fitted.config.to_dict(), "selector_top_k": 8, "selector_rank": 16})
    model = DFlash2Drafter(cfg)
    model.load_frozen(fitted.embed_tokens.weight, None)
    with torch.no_grad():
        model.load_state_dict(fitted.state_dict(), strict=False)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            model.candidate_selector.hidden_projection.weight.normal_(0, 0.02)
    return model.float().eval()


def check_rows(target, prompts, stop, fam, model):
    bsz = fam.verify_block_size(model)
    one, many = {}, {}
    single = [speculative_generate(target, recording(fam.proposer(model, block_size=bsz), one, False), p, NEW, bsz,
                                   LAYERS, stop) for p in prompts]
    proposer = recording(batched_proposer(fam.proposer(model, block_size=bsz)), many, True)
    batched = batched_speculative_generate(target, proposer, prompts, NEW, bsz, LAYERS, stop)
    assert_same(batched, single)
    assert one == many                  # every draft of every step, accepted or not
    return single


def test_batched_greedy_equals_one_prompt_greedy(target, prompts, stop):
    single = [greedy_generate(target, p, NEW, stop) for p in prompts]
    assert any(r.stopped and len(r.tokens) < NEW for r in single)   # the stop token ends one early
    assert_same(batched_greedy_generate(target, prompts, NEW, stop), single)


@pytest.mark.parametrize("kind", ["dflash", "dflash2", "eagle3"])
@pytest.mark.parametrize("perturbed", [False, True], ids=["untrained", "perturbed"])
def test_batched_drafters_equal_the_one_prompt_loop(target, prompts, stop, kind, perturbed):
    fam, model = drafter(kind, perturbed)
    check_rows(target, prompts, stop, fam, model)


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_fitted_drafters_accepting_different_counts_equal_the_one_prompt_loop(target, prompts, stop, fitted, kind):
    model = fitted if kind == "dflash" else fitted_dflash2(fitted)
    single = check_rows(target, prompts, stop, get_family(kind), model)
    lengths = {a for r in single for a in r.accept_lengths}
    assert len(lengths) >= 3 and max(lengths) >= 3, lengths


def test_batched_prompt_lookup_equals_the_one_prompt_loop(target, prompts, stop):
    single = [speculative_generate(target, PromptLookupProposer(3), p, NEW, 8, None, stop) for p in prompts]
    assert max(a for r in single for a in r.accept_lengths) > 2        # rows accept different counts
    assert_same(batched_speculative_generate(target, PromptLookupProposer(3), prompts, NEW, 8, None, stop), single)


def test_rows_accepting_different_counts_share_one_compacted_cache(target, prompts):
    """Many steps of partial acceptance force compaction (columns of rejected drafts gathered out); a batch of
    two groups (decode_prompts) gives the same results as one group."""
    single = [speculative_generate(target, PromptLookupProposer(2), p, 96, 16, None) for p in prompts]
    res, info = decode_prompts(target, PromptLookupProposer(2), prompts, 96, 16, batch_size=3)
    assert info["batched"] and info["batch_size"] == 3 and info["batched_reason"] is None
    assert_same(res, single)
    cache = BatchedTargetCache(target)
    cache.prefill(prompts[:2], None)
    assert cache.mask.sum(1).tolist() == [LENGTHS[0], LENGTHS[1]]


def test_what_is_not_batched_falls_back_and_says_why(target, prompts):
    assert batch_support(target, None) is None
    assert "sampling" in batch_support(target, None, SamplingParams(0.7))
    assert "no batched form" in batch_support(target, NoDraftProposer())
    res, info = decode_prompts(target, NoDraftProposer(), prompts[:2], 8, 4, batch_size=8)
    assert not info["batched"] and "no batched form" in info["batched_reason"]
    assert [r.tokens for r in res] == [greedy_generate(target, p, 8).tokens for p in prompts[:2]]
    with pytest.raises(ValueError, match="batch_size"):
        decode_prompts(target, None, prompts, 8, 4, batch_size=0)


def test_a_moe_target_is_batched_and_hybrid_or_sliding_ones_are_not():
    """A mixture-of-experts target has plain attention caches: batched, equal; linear-attention (Qwen3-Next) and
    sliding-window layers are refused by name (``decode_prompts`` then decodes one prompt at a time)."""
    from tests.support import tiny_target
    moe = tiny_target("qwen3_moe", vocab_size=512)
    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(4, 512, (n,), generator=g).tolist() for n in (9, 14, 5)]
    assert batch_support(moe, PromptLookupProposer(2)) is None
    single = [speculative_generate(moe, PromptLookupProposer(2), p, 24, 6) for p in ps]
    assert_same(batched_speculative_generate(moe, PromptLookupProposer(2), ps, 24, 6), single)
    assert_same(batched_greedy_generate(moe, ps, 24), [greedy_generate(moe, p, 24) for p in ps])
    hybrid = tiny_target("qwen3_next", vocab_size=512)
    assert "linear-attention" in batch_support(hybrid, None)
    res, info = decode_prompts(hybrid, None, ps[:1], 4, 4, batch_size=4)
    assert not info["batched"] and "linear-attention" in info["batched_reason"]
    assert res[0].tokens == greedy_generate(hybrid, ps[0], 4).tokens
    sliding = tiny_target("qwen3_sliding", vocab_size=512)
    assert "Sliding" in batch_support(sliding, None)


def test_evaluate_tau_batched_reports_the_same_figures(target, prompts, stop):
    """``evaluate_tau(batch_size=N)``: the τ figures of one prompt at a time, the lossless check on the batched
    greedy reference, and the batching fields."""
    one = evaluate_tau(target, PromptLookupProposer(3), prompts, NEW, None, block_size=8, stop_token_ids=stop,
                       check_lossless=True)
    many = evaluate_tau(target, PromptLookupProposer(3), prompts, NEW, None, block_size=8, stop_token_ids=stop,
                        check_lossless=True, batch_size=4)
    for key in ("tau_mean", "tau_pooled", "accept_hist", "generated_tokens", "target_forwards", "verify_steps"):
        assert many[key] == one[key], key
    assert many["lossless_mismatches"] == 0 and many["batched"] and many["batch_size"] == 4
    assert "batched" not in one


@pytest.mark.parametrize("batch_size", [1, 3])
def test_every_decode_forward_runs_without_cudnn_attention(target, prompts, batch_size):
    """cuDNN's SDPA plans every new key/value length on the host (6.2 ms a call on the H200,
    ``decode_attention_backends``): every target forward of a decode sees it disabled, and the choice before the
    decode is back after it, also when the decode raises."""
    seen = []
    hook = target.register_forward_pre_hook(lambda *_: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        assert before, "the test needs cuDNN attention enabled outside the decode"
        decode_prompts(target, None, prompts[:3], 4, 16, batch_size=batch_size)
        decode_prompts(target, PromptLookupProposer(3, vocab_size=target.config.vocab_size), prompts[:3], 4, 16,
                       batch_size=batch_size)
        assert len(seen) >= 6 and not any(seen), seen
        assert torch.backends.cuda.cudnn_sdp_enabled() == before
        seen.clear()
        with pytest.raises(ValueError):
            decode_prompts(target, None, [[]], 4, 16, batch_size=batch_size)
        assert torch.backends.cuda.cudnn_sdp_enabled() == before
    finally:
        hook.remove()


def test_the_decode_scope_turns_cudnn_off_and_leaves_a_callers_narrower_choice_alone():
    """Inside a caller's ``sdpa_kernel([MATH])`` the decode scope only adds cuDNN's off: flash and the
    memory-efficient kernel stay off as the caller set them; each flag is back after the scope."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from specring.shared.models.batched_decode import decode_attention_backends
    cuda = torch.backends.cuda
    flags = lambda: (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled(),  # noqa: E731
                     cuda.cudnn_sdp_enabled())
    with sdpa_kernel([SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION]):
        outer = flags()
        assert outer == (False, False, True, True)
        with decode_attention_backends():
            assert flags() == (False, False, True, False)
        assert flags() == outer
