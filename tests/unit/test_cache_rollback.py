"""Exact rollback of the target's cache after a partial acceptance, for every layer kind (issue 24), CPU.

Speculative decoding feeds ``[anchor, d_1..d_k]`` to the target and keeps only the accepted prefix. Attention KV
caches are cut; the recurrent and convolution states of linear-attention layers (Qwen3.5 / Qwen3-Next Gated
DeltaNet) cannot be, so ``shared.models.speculative.TargetCache`` restores them and re-runs the accepted tokens.
Tiny random targets of every kind (``tests.support.tiny_target``) decode with an oracle proposer that knows the
greedy continuation and gets a random prefix of each block right, so every acceptance length occurs: the output
must equal plain greedy decoding token for token. The same check with the restore switched off fails (it has
power), and the portable fallback (snapshot and re-run, for a transformers whose ``crop`` cannot undo a sliding
window) is lossless on attention caches too.
"""

from __future__ import annotations

import random

import pytest
import torch

from specring.shared.drafters.tau import evaluate_tau
from specring.shared.models import speculative as spec
from specring.shared.models.dflash import DFlashConfig, DFlashDrafter
from specring.shared.models.eagle3 import Eagle3Config, Eagle3Drafter, build_draft_vocab, draft_to_target
from specring.shared.models.ngram import PromptLookupProposer
from specring.shared.models.speculative import (
    DFlashProposer,
    Eagle3Proposer,
    TargetCache,
    greedy_generate,
    restore_cache,
    snapshot_cache,
    speculative_generate,
)
from tests.support import TINY_TARGETS, tiny_target

V = 512                  # the tiny targets' vocabulary here (the system tests use the fixture tokenizer's 8192)
NEW = 24
B = 5                    # verify block: 4 drafts per step
MODE = {"qwen3_5": "replay", "qwen3_next": "replay", "qwen3_5_moe": "replay", "qwen3_moe": "crop",
        "qwen3_sliding": "crop"}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def targets():
    return {kind: tiny_target(kind, vocab_size=V) for kind in TINY_TARGETS}


def prompts(n=3, length=14, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, V, (length,), generator=g).tolist() for _ in range(n)]


class Oracle:
    """Knows the greedy continuation; proposes the first ``j`` tokens of each block right (``j`` random, all
    of them sometimes) and wrong ones after, so every acceptance length occurs."""

    name, needs_features = "oracle", False

    def __init__(self, prompt_len, truth, seed=0):
        self.prompt_len, self.truth, self.rng = prompt_len, truth, random.Random(seed)

    def reset(self, prompt_ids):
        pass

    def add_context(self, features, positions):
        pass

    def propose(self, tokens, k):
        done = len(tokens) - self.prompt_len
        future = self.truth[done:done + k]
        j = self.rng.choice([0, 1, len(future) // 2, len(future) - 1, len(future)])
        return list(future[:j]) + [(t + 1) % V for t in future[j:]]


def oracle_decode(target, prompt, seed=0):
    truth = greedy_generate(target, prompt, NEW + B).tokens       # the last step may look past NEW
    return speculative_generate(target, Oracle(len(prompt), truth, seed), prompt, NEW, B), truth[:NEW]


@pytest.mark.parametrize("kind", TINY_TARGETS)
def test_every_layer_kind_rolls_back_exactly_after_a_partial_acceptance(targets, kind):
    target = targets[kind]
    lengths = set()
    for i, p in enumerate(prompts()):
        res, truth = oracle_decode(target, p, seed=i)
        assert res.tokens == truth, kind
        assert res.cache_rollback == MODE[kind], (kind, res.cache_rollback)
        assert res.target_forwards == 1 + len(res.accept_lengths) + res.rollback_forwards
        if MODE[kind] == "crop":
            assert res.rollback_forwards == 0
        lengths.update(res.accept_lengths)
    assert {1, B} <= lengths and len(lengths) >= 3, lengths   # rejections, full and partial acceptances


def test_a_decode_without_the_restore_is_not_lossless(targets, monkeypatch):
    """The check above has power: forgetting to restore the linear-attention states changes the output."""
    monkeypatch.setattr(spec, "restore_cache", lambda snapshot: None)
    res, truth = oracle_decode(targets["qwen3_5"], prompts()[0])
    assert res.tokens != truth


@pytest.mark.parametrize("kind", ["qwen3_sliding", "qwen3_moe"])
def test_the_portable_fallback_is_exact_on_attention_caches(targets, kind, monkeypatch):
    """Without transformers' past-state recording (as on versions before it) a full sliding window cannot be
    cropped; snapshot, restore and re-run is then the path, and it is as exact as the crop."""
    monkeypatch.setattr(spec, "_activate_recording", lambda cache: False)
    target = targets[kind]
    for i, p in enumerate(prompts(2, length=20)):      # prompts longer than the 6-token windows
        res, truth = oracle_decode(target, p, seed=i)
        assert res.tokens == truth and res.cache_rollback == ("replay" if kind == "qwen3_sliding" else "crop")


def test_the_replay_path_is_exact_whatever_the_cache_could_crop(targets, monkeypatch):
    monkeypatch.setattr(spec, "exactly_croppable", lambda cache: False)
    for kind in ("qwen3_moe", "qwen3_sliding"):
        res, truth = oracle_decode(targets[kind], prompts()[1], seed=5)
        assert res.tokens == truth and res.cache_rollback == "replay" and res.rollback_forwards > 0


def test_a_snapshot_refuses_to_restore_a_tensor_written_in_place(targets):
    cache = TargetCache(targets["qwen3_5"])
    cache.prefill(prompts()[0], None)
    snap = snapshot_cache(cache.cache)
    attention = next(layer for layer in cache.cache.layers if getattr(layer, "keys", None) is not None
                     and not hasattr(layer, "recurrent_states"))
    recurrent = next(layer for layer in cache.cache.layers if hasattr(layer, "recurrent_states"))
    saved = recurrent.recurrent_states[0].clone()
    recurrent.recurrent_states[0].add_(1.0)               # a forward updates these in place: restored exactly
    restore_cache(snap)
    assert torch.equal(recurrent.recurrent_states[0], saved)
    attention.keys.mul_(2.0)                              # kept by reference, never written in place by transformers
    with pytest.raises(RuntimeError, match="keys was updated in place"):
        restore_cache(snap)
    with pytest.raises(ValueError, match="last verify forward"):
        cache.keep(3, prompts()[0])


def test_a_transformers_without_linear_attention_cache_layers_is_refused_by_name(targets, monkeypatch):
    """transformers before its linear-attention cache layers (4.57's Qwen3-Next) restarts the linear-attention state
    on each multi-token forward: a verify forward is wrong there, so decoding stops with a message, not a τ."""
    monkeypatch.setattr(spec, "_linear_attention_cache_layers", lambda: False)
    with pytest.raises(RuntimeError, match=r"linear-attention layers.*install transformers >= 5\.17"):
        oracle_decode(targets["qwen3_5"], prompts()[0])
    res, truth = oracle_decode(targets["qwen3_moe"], prompts()[0])     # attention-only targets are unaffected
    assert res.tokens == truth


# ------------------------------------------------------------------------------------------ real proposers
def dflash_drafter(target, layers, seed=1):
    cfg = DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=V,
                       max_position_embeddings=512, target_layer_ids=layers, num_target_layers=len(layers),
                       block_size=B, mask_token_id=3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DFlashDrafter(cfg).eval()
    model.load_frozen(target.model.embed_tokens.weight, target.lm_head.weight)
    return model


def eagle3_drafter(target, layers, seed=2):
    cfg = Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                       rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=V, draft_vocab_size=V // 2,
                       target_hidden_size=32, max_position_embeddings=512, target_layer_ids=layers, ttt_steps=B - 1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Eagle3Drafter(cfg).eval()
        model.set_draft_vocab(*build_draft_vocab(torch.randint(0, 100, (V,)), V // 2))
    model.load_frozen(target.model.embed_tokens.weight)
    with torch.no_grad():
        model.lm_head.weight.copy_(target.lm_head.weight[draft_to_target(model.d2t)])
    return model


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_drafters_decode_hybrid_targets_losslessly_through_one_loop(targets, kind):
    """DFlash blocks, EAGLE-3 chains and prompt lookup, with the target's features captured from linear- and
    full-attention layers alike (the re-runs must not leak into the captured features): lossless, via
    ``evaluate_tau`` as ``launch.py eval`` and τ during training use it."""
    target = targets[kind]
    layers = [1, 2, 4]                                    # linear, full, linear
    ps = prompts(2)
    for drafter in (dflash_drafter(target, layers), eagle3_drafter(target, [1, 2, 4]),
                    PromptLookupProposer()):
        out = evaluate_tau(target, drafter, ps, 12, None if isinstance(drafter, PromptLookupProposer) else layers,
                           block_size=B, check_lossless=True)
        assert out["lossless_mismatches"] == 0, type(drafter).__name__
        assert out["cache_rollback"] == "replay" and out["tau_mean"] >= 1.0
    # the drafter's context is the verify forward's features of the accepted tokens, as on an attention target
    prop = DFlashProposer(dflash_drafter(target, layers))
    fed = []
    add = prop.add_context
    prop.add_context = lambda f, pos: (fed.append(pos.tolist()), add(f, pos))[1]
    res = speculative_generate(target, prop, ps[0], 10, B, layers)
    flat = [q for chunk in fed for q in chunk]
    assert flat == list(range(len(flat))) and len(flat) == len(ps[0]) + sum(res.accept_lengths)
    chain = Eagle3Proposer(eagle3_drafter(target, layers), B - 1)
    assert speculative_generate(target, chain, ps[1], 10, B, layers).tokens == greedy_generate(target, ps[1], 10).tokens
