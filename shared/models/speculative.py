"""Speculative decoding with the target (block verify; greedy, or lossless sampling) and its acceptance length τ.

Algorithm: DFlash block-verify decoding as in the public reference loop, z-lab/dflash ``dflash/model.py``
(``dflash_generate``, called by ``DFlashDraftModel.spec_generate``), greedy branch; written here, not
copied. One sequence at a time:

1. The target prefills the prompt (``P`` tokens) with a KV cache; its greedy choice is the first
   generated token, which becomes the *anchor* at position ``P``; the captured features of the prompt
   (positions ``0..P-1``) are the drafter's context: every token strictly before the anchor.
2. The drafter proposes ``k = B-1`` tokens after the anchor (``DFlashDrafter.draft_block`` on
   ``[anchor, MASK x k]``), also when fewer are still to generate, as the reference does.
3. The target verifies ``[anchor, d_1..d_k]`` in one forward at positions ``p..p+k``; with ``g_i`` its
   greedy choice after position ``p+i``, ``a`` is the number of leading ``d_{i+1} == g_i``, and the bonus
   token is ``g_a``. The step produces ``a + 1`` tokens (``d_1..d_a``, bonus); the output is cut at the
   generation limit and after a stop token, the step's acceptance length is not.
4. The target cache is rolled back to ``p + produced`` (anchor and accepted tokens kept; ``TargetCache``):
   attention KV caches are cropped; on a target with linear-attention layers (Qwen3.5 / Qwen3-Next Gated
   DeltaNet), whose recurrent and convolution states cannot be cropped, the states saved before the verify
   forward are restored and the anchor and accepted tokens re-run (one more target forward, counted in
   ``rollback_forwards``). The verify forward's features of the anchor and the accepted tokens (rows
   ``0..produced-1``) become new drafter context; the last produced token is the next anchor. The drafter's
   cache holds verified context only (``DraftCache``), so it never needs a rollback. ``launch.py eval``, τ
   during training (``shared.drafters.tau.evaluate_tau``), the EAGLE-3 chain and every other proposer decode
   through this one loop.

Every emitted token is a target greedy choice given a prefix of target greedy choices, so the output
equals plain greedy decoding token for token (``greedy_generate``; a test asserts it).

Figures (as z-lab/dflash ``dflash/benchmark.py`` reports them, counted as ``dflash_generate`` counts): the acceptance
length of a verify step is ``a + 1`` (accepted drafts plus the bonus; the prefill's first token is not a verify step),
never cut at the generation limit or a stop token; verify steps go on while no stop token was produced and at most
``max_new_tokens`` tokens exist (the reference's ``start < max_length``, so a step also runs when exactly
``max_new_tokens`` are there). ``tau_mean`` is the mean over prompts of each prompt's mean acceptance length,
``tau_pooled`` the mean over all steps, ``tau_p50``/``tau_p90`` percentiles over steps and ``accept_hist`` the count of
steps per length. ``forwards_per_token`` = target forwards (prefill and rollback re-runs included) / generated tokens
(1.0 for plain greedy decoding); ``rollback_forwards`` counts the re-runs alone. ``tokens_per_s`` = generated tokens /
wall time of the generate calls (prefill included); ``speedup`` = a row's ``tokens_per_s`` over plain greedy decoding's
in the same run (the reference's "Decoding speedup": baseline time per output token over speculative time per output
token).

Sampling (``SamplingParams`` with temperature > 0; temperature 0 is the greedy loop above, unchanged):
speculative sampling, Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding",
Algorithm 1) and Chen et al. 2023 ("Accelerating Large Language Model Decoding with Speculative Sampling"),
as z-lab/dflash ``dflash/model.py`` runs it in ``dflash_generate`` for temperature > 0
(``_sampling_probs``, ``_rejection_sample``); written here, not copied. The same loop, with three changes:
the prefill's token is drawn from ``p = params.probs(logits)``; the proposer's ``propose_sample`` returns the
drafts and ``q [k, V]``, the distribution each was drawn from given the drafts before it; and instead of
comparing with the argmax, ``rejection_sample`` accepts draft ``i`` with probability ``min(1, p_i(d_i) /
q_i(d_i))`` (``p_i``: the target's distribution after position ``p + i`` of the verify forward), draws the
step's last token at the first rejection from ``normalise(max(0, p_i - q_i))``, or, all accepted, the bonus
from ``p_k``. Each emitted token is then distributed exactly as plain sampling from the target
(``sample_generate``; a test compares the distributions), whatever the drafter. Cache cropping, context
and counting are those of the greedy loop (the acceptance length is still accepted + 1). Every random draw
(``torch.multinomial``, ``torch.rand``) uses the caller's CPU ``torch.Generator``, so a seed reproduces a run.

A *proposer* is any object with ``name``, ``needs_features`` and the methods ``reset(prompt_ids)``,
``add_context(features [C, n*H] | None, positions [C])`` and ``propose(tokens, k) -> list[int]`` (``tokens``:
the whole sequence, its last entry the anchor); to sample it also has ``propose_sample(tokens, k, params,
generator) -> (drafts, q [len(drafts), V] float32)``. ``DFlashProposer`` wraps a DFlash drafter (block slots
are parallel: each slot drawn from its own row), ``Eagle3Proposer`` an EAGLE-3 drafter (a chain: each draw
feeds the next step, ``eagle3_chain_pick``), ``shared.models.ngram.PromptLookupProposer`` is the model-free
baseline (one-hot ``q``). A drafting loop samples through a ``SamplePicker`` (``pick(logits [V]) -> id``, the
rows recorded as ``q``), called slot by slot, so a proposer whose slot ``j`` depends on slot ``j - 1``'s
choice, or offers only ``K`` candidates (``-inf`` elsewhere, so ``q`` is 0 there), fits the same interface.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from specring.shared.models.dflash import (
    DFlashDrafter,
    DraftCache,
)
from specring.shared.models.dflash2 import DFlash2Drafter
from specring.shared.models.eagle3 import Eagle3Drafter

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- sampling
@dataclass(frozen=True)
class SamplingParams:
    """How a token is drawn from a row of logits: ``temperature`` (``0`` = greedy), then ``top_k`` (``0`` = off:
    keep the ``top_k`` highest scores), then ``top_p`` (``1.0`` = off: nucleus, the smallest set of most likely
    tokens whose probability reaches ``top_p``), renormalised. The order and the nucleus rule (a token is kept
    while the mass before it is below ``top_p``, so the most likely one always is) are z-lab/dflash's
    ``dflash/model.py`` ``_sampling_probs``.

    Raises ``ValueError`` naming the field: ``temperature`` not a finite number ``>= 0``, ``top_p`` outside
    ``(0, 1]``, ``top_k`` not an integer ``>= 0``.
    """
    temperature: float
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        t, p, k = self.temperature, self.top_p, self.top_k
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature: must be a finite number >= 0 (0 = greedy), got {t!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p: must be in (0, 1] (1 = off), got {p!r}")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise ValueError(f"top_k: must be an integer >= 0 (0 = off), got {k!r}")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))
        object.__setattr__(self, "top_k", int(k))

    @property
    def greedy(self) -> bool:
        """True at ``temperature == 0``: decoding takes the greedy path (argmax, no random draw)."""
        return self.temperature == 0

    def to_dict(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits [N, V]`` (any float dtype and device; any leading shape works) -> ``[N, V]`` float32
        probabilities on the same device, each row summing to 1: ``softmax(logits / temperature)``
        restricted to the ``top_k`` highest logits (exactly ``top_k``: ties broken by ``torch.topk``) and then
        to the nucleus of mass ``top_p``, renormalised. At ``temperature == 0``: the one-hot of the argmax
        (the limit, what greedy decoding picks). Entries at ``-inf`` logits get probability 0."""
        scores = logits.float()
        if self.greedy:
            return torch.zeros_like(scores).scatter_(-1, scores.argmax(dim=-1, keepdim=True), 1.0)
        scores = scores / self.temperature
        vocab = scores.shape[-1]
        if 0 < self.top_k < vocab:
            keep = torch.zeros_like(scores, dtype=torch.bool)
            keep.scatter_(-1, torch.topk(scores, self.top_k, dim=-1).indices, True)
            scores = scores.masked_fill(~keep, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if self.top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            sorted_probs = sorted_probs * ((sorted_probs.cumsum(dim=-1) - sorted_probs) < self.top_p)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One id drawn from ``probs [V]`` (non-negative, positive sum; moved to the CPU as float32) with
    ``torch.multinomial`` and ``generator`` (a CPU generator; None: torch's global CPU generator)."""
    return int(torch.multinomial(probs.detach().float().cpu(), 1, generator=generator))


class SamplePicker:
    """The ``pick`` callback of a sampling proposer: ``pick(logits [V]) -> int`` draws a token from
    ``params.probs(logits)`` and records the row; ``tokens`` are the drawn ids, ``q()`` the rows ``[n, V]``
    float32 on the CPU (``[0, vocab_size]`` when nothing was drawn).

    A drafting loop calls it once per slot, in order; when a slot's logits depend on the earlier slots'
    choices (a chain, a candidate selector), the loop computes them after the earlier ``pick`` returned,
    so each recorded row is the distribution of its draft given the drafts before it, which is the ``q``
    speculative sampling needs. A proposer whose slot offers only some ids (EAGLE-3's draft vocabulary,
    ``K`` candidates) passes ``-inf`` elsewhere: ``q`` is 0 there.
    """

    def __init__(self, params: SamplingParams, generator: torch.Generator | None, vocab_size: int):
        self.params, self.generator, self.vocab_size = params, generator, int(vocab_size)
        self.tokens: list[int] = []
        self._rows: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor) -> int:
        q = self.params.probs(logits.reshape(1, -1))[0].cpu()
        token = draw(q, self.generator)
        self.tokens.append(token)
        self._rows.append(q)
        return token

    def q(self) -> torch.Tensor:
        if not self._rows:
            return torch.zeros(0, self.vocab_size, dtype=torch.float32)
        return torch.stack(self._rows)


def rejection_sample(drafts: Sequence[int], q: torch.Tensor, p: torch.Tensor,
                     generator: torch.Generator | None) -> tuple[int, int]:
    """The speculative sampling rule of one verify step: ``(a, token)``, ``a`` the accepted drafts, ``token``
    the one the step adds after them.

    ``drafts``: ``n`` ids; ``q [n, V]``: the distribution each draft was drawn from (given the drafts before
    it); ``p [n+1, V]``: the target's distributions after the anchor and after each draft (float32, CPU).
    Draft ``i`` is accepted with probability ``min(1, p_i(d_i) / q_i(d_i))`` (``u * q < p``, ``u ~ U[0, 1)``,
    all ``n`` uniforms drawn at once), up to the first rejection; there ``token`` is drawn from
    ``normalise(max(0, p_a - q_a))`` (from ``p_a`` when that is all zero, which exact arithmetic never
    reaches), and when all ``n`` are accepted from ``p_n`` (the bonus). Every emitted token is then
    distributed as under ``p`` alone. Source: Leviathan et al. 2023, "Fast Inference from Transformers via
    Speculative Decoding" (Algorithm 1); Chen et al. 2023, "Accelerating Large Language Model Decoding with
    Speculative Sampling"; z-lab/dflash ``dflash/model.py`` ``_rejection_sample`` (read, not copied).
    """
    n = len(drafts)
    a = 0
    if n:
        idx = torch.as_tensor(list(drafts), dtype=torch.long)
        rows = torch.arange(n)
        p_d, q_d = p[rows, idx], q[rows, idx]
        ok = torch.rand(n, generator=generator) * q_d < p_d
        a = int(ok.to(torch.int64).cumprod(0).sum())
    if a == n:
        return a, draw(p[n], generator)
    residual = (p[a] - q[a]).clamp_min(0)
    total = float(residual.sum())
    return a, draw(residual / total if total > 0 else p[a], generator)


# ---------------------------------------------------------------------------------------------- proposers
class FeatureProposer:
    """What the drafters' proposers share: the drafter's cache of verified context, and the verified context
    (target features and positions) queued until the next ``propose`` feeds it to the drafter."""

    needs_features = True
    cache = None

    def reset(self, prompt_ids: list[int]) -> None:
        """Forget the previous prompt's cache and queued context."""
        self.cache = None
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def add_context(self, features: torch.Tensor | None, positions: torch.Tensor) -> None:
        """Queue verified context: ``features [C, F]`` (the drafter's target features: DFlash ``n*H``, EAGLE-3
        ``3*H``) of the tokens at ``positions [C] long``. Raises ``ValueError`` when ``features`` is None."""
        if features is None:
            raise ValueError(f"{type(self).__name__}.add_context: the drafter needs target features (got None)")
        self._pending.append((features, positions))

    def _take_context(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The queued context on the drafter's device, emptied: ``(features [C, F], positions [C] long)``, both
        empty (``C = 0``, ``F`` the drafter's ``fc`` input width) when nothing was queued."""
        dev = self.drafter.fc.weight.device
        if self._pending:
            feats = torch.cat([f for f, _ in self._pending]).to(dev)
            pos = torch.cat([q for _, q in self._pending]).to(dev)
        else:
            feats = torch.empty(0, self.drafter.fc.in_features, device=dev)
            pos = torch.empty(0, dtype=torch.long, device=dev)
        self._pending = []
        return feats, pos


class DFlashProposer(FeatureProposer):
    """Proposer over a ``DFlashDrafter``: keeps its ``DraftCache`` and the context not yet fed to it.

    ``block_size`` (default: the drafter's) bounds the tokens drafted per step to ``block_size - 1``.
    The drafter is used as it is (device, dtype, mode); features are moved to its device.
    """

    needs_features = True

    def __init__(self, drafter: DFlashDrafter, block_size: int | None = None, name: str = "dflash"):
        self.drafter = drafter
        self.block_size = int(block_size or drafter.config.block_size)
        self.name = name
        self.cache: DraftCache | None = None
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _block_logits(self, tokens: list[int], k: int) -> torch.Tensor:
        """Feed the queued context and draft one block of ``k + 1`` after the anchor ``tokens[-1]``: the
        drafter's ``[k, V]`` float32 logits of block rows ``1..k`` (``k >= 1``)."""
        feats, pos = self._take_context()
        logits, self.cache = self.drafter.draft_block(feats, pos, int(tokens[-1]), len(tokens) - 1,
                                                      self.cache, block_size=k + 1)
        return logits[1:]

    @torch.no_grad()
    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Greedy drafts (argmax of block rows ``1..k``) after the anchor ``tokens[-1]``."""
        k = min(int(k), self.block_size - 1)
        if k <= 0:
            return []
        return self._block_logits(tokens, k).argmax(dim=-1).tolist()

    @torch.no_grad()
    def propose_sample(self, tokens: list[int], k: int, params: "SamplingParams",
                       generator: torch.Generator | None) -> tuple[list[int], torch.Tensor]:
        """Sampled drafts after the anchor ``tokens[-1]``: the block's slots are parallel (each row sees the
        anchor and mask tokens only), so slot ``j`` is drawn from ``params.probs(logits row j)`` whatever
        the earlier slots drew. Returns ``(drafts, q [len(drafts), V] float32 on the CPU)``."""
        k = min(int(k), self.block_size - 1)
        pick = SamplePicker(params, generator, self.drafter.config.vocab_size)
        if k > 0:
            for row in self._block_logits(tokens, k):
                pick(row)
        return pick.tokens, pick.q()


class DFlash2Proposer(FeatureProposer):
    """Proposer over a ``DFlash2Drafter`` (the interface of ``shared.models.speculative``): the block's unary
    logits and hidden states, then the candidate selector's walk from the anchor. ``block_size`` (default: the
    drafter's) bounds the drafts per step to ``block_size - 1``."""

    needs_features = True

    def __init__(self, drafter: DFlash2Drafter, block_size: int | None = None, name: str = "dflash2"):
        self.drafter = drafter
        self.block_size = int(block_size or drafter.config.block_size)
        self.name = name
        self.cache = None
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _walk(self, tokens: list[int], k: int, temperature: float, generator, probs=None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        feats, pos = self._take_context()
        path, cand, q, self.cache = self.drafter.propose_block(feats, pos, int(tokens[-1]), len(tokens) - 1,
                                                               self.cache, block_size=k + 1,
                                                               temperature=temperature, generator=generator,
                                                               probs=probs)
        return path, cand, q

    @torch.no_grad()
    def propose(self, tokens: list[int], k: int) -> list[int]:
        """The selector's greedy walk over ``k <= block_size - 1`` slots after the anchor ``tokens[-1]``."""
        k = min(int(k), self.block_size - 1)
        if k <= 0:
            return []
        path, _, _ = self._walk(tokens, k, 0.0, None)
        return [int(t) for t in path.tolist()]

    @torch.no_grad()
    def propose_sample(self, tokens: list[int], k: int, params, generator) -> tuple[list[int], torch.Tensor]:
        """Drafts sampled by the selector's walk and ``q [k, V]`` float32 on the CPU: each slot's ``params.probs``
        of its K candidates' scores (temperature, then top-k, then top-p, as the target's side; given the drafts
        before it), 0 elsewhere. The reference applies the temperature alone; filtering the same way as the target
        keeps the draws where the target can accept them (lossless either way)."""
        k = min(int(k), self.block_size - 1)
        vocab = self.drafter.config.vocab_size
        if k <= 0:
            return [], torch.zeros(0, vocab)
        if params.greedy:
            drafts = self.propose(tokens, k)
            return drafts, F.one_hot(torch.tensor(drafts, dtype=torch.long), vocab).float()
        # the same temperature, top-k and top-p as the target's side, over the K candidates' scores
        path, cand, q = self._walk(tokens, k, params.temperature, generator,
                                   probs=lambda sc: params.probs(sc[None])[0])
        full = torch.zeros(len(path), vocab, dtype=torch.float32)
        full.scatter_add_(1, cand.cpu().long(), q.float().cpu())
        return [int(t) for t in path.tolist()], full


class Eagle3Proposer(FeatureProposer):
    """Proposer over an ``Eagle3Drafter``: chain drafting (``eagle3_extend`` over the newly verified context, then
    ``eagle3_chain``), keeping the step-0 cache of the verified context between verify steps.

    ``num_draft_tokens`` bounds the tokens drafted per step (the verify block is ``num_draft_tokens + 1``).
    Features of position ``p`` pair with the token at ``p + 1``, which is known once that token is verified, so
    queued context is fed at the next ``propose``.
    """

    needs_features = True

    def __init__(self, drafter, num_draft_tokens: int, name: str = "eagle3"):
        self.drafter = drafter
        self.num_draft_tokens = int(num_draft_tokens)
        self.name = name
        self.cache = None
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []


    @torch.no_grad()
    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` chained drafts after ``tokens`` (whose last entry is the anchor)."""
        from specring.shared.models.eagle3 import eagle3_chain, eagle3_extend
        k = min(int(k), self.num_draft_tokens)
        if k <= 0 or not self._pending:
            return []
        feats = torch.cat([f for f, _ in self._pending])
        pos = torch.cat([p for _, p in self._pending]).long()
        self._pending = []
        nxt = torch.tensor([tokens[int(i) + 1] for i in pos.tolist()], dtype=torch.long)
        self.cache, out = eagle3_extend(self.drafter, self.cache, feats, nxt, pos)
        drafts, _ = eagle3_chain(self.drafter, self.cache, out[-1], int(pos[-1]), k)
        return drafts

    @torch.no_grad()
    def propose_sample(self, tokens: list[int], k: int, params: "SamplingParams",
                       generator: torch.Generator | None) -> tuple[list[int], torch.Tensor]:
        """Up to ``k`` sampled chain drafts: step ``j`` draws from ``params.probs`` of its draft-vocabulary
        logits mapped to target ids (``-inf``, so probability 0, outside the draft vocabulary), and the drawn
        token feeds step ``j + 1`` (``eagle3_chain_pick``). Returns ``(drafts, q [len(drafts), V] float32 on
        the CPU)``, row ``j`` the distribution draft ``j`` was drawn from given drafts ``0..j-1``."""
        from specring.shared.models.eagle3 import eagle3_extend
        k = min(int(k), self.num_draft_tokens)
        pick = SamplePicker(params, generator, self.drafter.config.vocab_size)
        if k <= 0 or not self._pending:
            return pick.tokens, pick.q()
        feats = torch.cat([f for f, _ in self._pending])
        pos = torch.cat([p for _, p in self._pending]).long()
        self._pending = []
        nxt = torch.tensor([tokens[int(i) + 1] for i in pos.tolist()], dtype=torch.long)
        self.cache, out = eagle3_extend(self.drafter, self.cache, feats, nxt, pos)
        eagle3_chain_pick(self.drafter, self.cache, out[-1], int(pos[-1]), k, pick)
        return pick.tokens, pick.q()


@torch.no_grad()
def eagle3_chain_pick(drafter: Eagle3Drafter, cache, h_last: torch.Tensor, position: int, k: int,
                      pick: Callable[[torch.Tensor], int]) -> list[int]:
    """``shared.models.eagle3.eagle3_chain`` with the choice of each token left to ``pick``.

    The same chain (``h_last [H]`` of the last context position ``position`` first, step ``j`` at position
    ``position + j`` attending to ``cache`` and to the chain's own keys), but each step's token is
    ``pick(logits [V] float32)``, the step's draft-vocabulary logits placed at their target ids (``d2t``) and
    ``-inf`` at every other id; ``pick`` returns a target id, which feeds the next step. With an argmax
    ``pick`` the tokens equal ``eagle3_chain``'s (greedy drafting keeps using that one). Returns the ``k``
    tokens.
    """
    from specring.shared.models.eagle3 import draft_to_target, eagle3_attention
    dev = drafter.fc.weight.device
    d2t_full = draft_to_target(drafter.d2t)
    vocab = int(drafter.config.vocab_size)

    def choose(h: torch.Tensor) -> int:
        draft_logits = drafter.logits(h)[0].float()
        full = torch.full((vocab,), float("-inf"), dtype=torch.float32, device=draft_logits.device)
        full[d2t_full.to(draft_logits.device)] = draft_logits
        return int(pick(full))

    h = h_last[None]
    token = choose(h)
    out = [token]
    dk: list[torch.Tensor] = []
    dv: list[torch.Tensor] = []
    full_mask = torch.ones(1, cache.length, dtype=torch.bool, device=dev)
    for j in range(1, k):
        cos, sin = drafter.rope(torch.tensor([position + j], device=dev))
        q, kk, vv = drafter.midlayer.qkv(drafter.embed(torch.tensor([token], device=dev)), h, cos, sin)
        dk.append(kk)
        dv.append(vv)
        h = drafter.midlayer.finish(h, eagle3_attention(q, cache.keys, cache.values, full_mask, dk, dv))
        token = choose(h)
        out.append(token)
    return out


# ---------------------------------------------------------------------------------------------- decoding
@dataclass
class DecodeResult:
    """One generated continuation. ``tokens``: generated ids (prompt excluded); ``accept_lengths``: tokens
    produced by each verify forward; ``drafted``: tokens proposed at each step; ``target_forwards``:
    prefill included, and the rollback forwards; ``rollback_forwards``: forwards that re-ran accepted
    tokens after a partial acceptance (``TargetCache``, mode ``replay``; 0 on an attention-only target);
    ``cache_rollback``: how the target's cache was rolled back (``crop`` or ``replay``; ``""`` when no verify
    step ran); ``wall_s``: seconds of the whole call; ``stopped``: ended on a stop token."""
    prompt_len: int
    tokens: list[int]
    accept_lengths: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    target_forwards: int = 0
    rollback_forwards: int = 0
    cache_rollback: str = ""
    wall_s: float = 0.0
    stopped: bool = False


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _prefill(target, ids: Sequence[int], capture, record_past: bool = False):
    """The prompt's forward (positions ``0..P-1``, logits of the last position only) with no cache given: the model
    builds the cache its layers need and returns it (transformers 5.x: ``DynamicCache(config)``, a cache layer per
    layer kind: attention KV, sliding window, linear-attention conv/recurrent states; 4.x: a model's own class,
    e.g. ``Qwen3NextDynamicCache``, which a plain ``DynamicCache`` passed in would break). ``record_past``: then
    switch on transformers' past-state recording where the installed version has it (``_activate_recording``).
    Returns ``(logits [1, V] float32, features [P, n*H] or None, cache)``; raises ``RuntimeError`` when the model
    returns no cache."""
    out, feats = _run(target, ids, 0, None, capture, last_only=True)
    cache = getattr(out, "cache", None)
    if cache is None:
        cache = getattr(out, "past_key_values", None)
    if cache is None:
        raise RuntimeError(f"{type(target).__name__} returned no cache from a forward with use_cache=True")
    if record_past:
        _activate_recording(cache)
    return out.logits[0].float(), feats, cache


def _activate_recording(cache) -> bool:
    """Switch on transformers' past-state recording (``Cache.activate_past_recording``, transformers >= 5.17) where
    the installed version has it, so that ``crop`` can undo a forward on the layers that support it (sliding
    windows, convolution windows; recording after the prefill is enough: the windows it kept are whole). Returns
    whether it did."""
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()
        return True
    return False


def _cache_kwarg(target) -> str:
    """The forward's KV-cache argument: ``cache`` (transformers >= 5.2x) or ``past_key_values`` (older)."""
    name = getattr(target, "_specring_cache_kwarg", None)
    if name is None:
        params = inspect.signature(target.forward).parameters
        name = "cache" if "cache" in params else "past_key_values"
        target._specring_cache_kwarg = name
    return name


def crop_cache(cache, length: int) -> None:
    """Keep the first ``length`` positions of an attention ``DynamicCache`` (through ``crop(-n)``, the form
    every transformers version accepts; z-lab/dflash ``_crop_to`` does the same). With past-state recording
    on (``_activate_recording``) ``crop(0)`` also runs when nothing is removed: it trims the recorded
    sliding and convolution windows back to their working size. Exact only for caches whose every layer can
    be cropped (``TargetCache`` decides; a linear-attention layer's recurrent state cannot). Raises
    ``ValueError`` when the cache holds fewer than ``length`` positions."""
    remove = cache.get_seq_length() - int(length)
    if remove < 0:
        raise ValueError(f"crop_cache: cache holds {cache.get_seq_length()} positions, cannot keep {length}")
    if remove or _recording(cache):
        cache.crop(-remove)


# ---------------------------------------------------------------------------------------------- rollback
# Cache attributes that a forward replaces (``torch.cat``) rather than updates in place: a snapshot keeps a
# reference to them (no copy; O(1) whatever the context), every other tensor it clones.
_REPLACED_ON_UPDATE = frozenset({"keys", "values", "key_cache", "value_cache"})
# Attributes of the caches of linear-attention / SSM / short-convolution layers, in transformers 5.x
# (``LinearAttentionCacheLayerMixin``) and 4.x (per-model caches such as ``Qwen3NextDynamicCache``).
_STATE_ATTRS = ("conv_states", "recurrent_states", "ssm_states")


def _cache_parts(cache) -> list:
    """The objects that hold a cache's state: its ``layers`` (transformers >= 4.56), else the cache itself."""
    layers = getattr(cache, "layers", None)
    return list(layers) if isinstance(layers, (list, tuple)) and len(layers) else [cache]


def _recording(cache) -> bool:
    return any(getattr(part, "record_past", False) for part in _cache_parts(cache))


def exactly_croppable(cache) -> bool:
    """Whether ``crop`` puts ``cache`` back exactly as it was before the rejected tokens (decided after the
    prefill, once every layer is initialised).

    transformers >= 5.17 says so itself (``Cache.is_croppable``: true for attention and dummy layers, for
    sliding windows and convolution windows under past-state recording, false as soon as a layer holds a
    recurrent state, e.g. Gated DeltaNet, Mamba); a sliding-window layer also needs the recording on. Older
    versions: croppable when no part holds linear-attention/SSM state (``conv_states``, ``recurrent_states``,
    ``ssm_states``) and no layer is a sliding window (their crop raises once the window is full)."""
    parts = _cache_parts(cache)
    for part in parts:
        sliding = bool(getattr(part, "is_sliding", False)) or getattr(part, "sliding_window", None) is not None
        if sliding and not getattr(part, "record_past", False):
            return False
    verdict = getattr(cache, "is_croppable", None)
    if isinstance(verdict, bool):
        return verdict
    return not holds_linear_state(cache)


def holds_linear_state(cache) -> bool:
    """Whether some part of ``cache`` holds linear-attention / SSM / convolution state (``_STATE_ATTRS``)."""
    return any(_holds_tensor(getattr(part, a, None)) for part in _cache_parts(cache) for a in _STATE_ATTRS)


def check_linear_attention_support(cache) -> None:
    """Raise ``RuntimeError`` when ``cache`` holds linear-attention state but the installed transformers predates
    its cache layers for them (``cache_utils.LinearAttentionCacheLayerMixin``, there in 5.17 and 5.24): the
    modelling code of those versions (4.57's Qwen3-Next, for one) starts every forward of more than one token
    from an empty linear-attention state, so a verify forward over a cache is wrong and no rollback can make
    speculative decoding exact. The message names the version and what to install."""
    if not holds_linear_state(cache):
        return
    import transformers
    if not _linear_attention_cache_layers():
        raise RuntimeError(f"this target has linear-attention layers, and transformers {transformers.__version__} "
                           "restarts their state on every forward of more than one token, so block-verify "
                           "speculative decoding cannot be exact; install transformers >= 5.17")


def _linear_attention_cache_layers() -> bool:
    """Whether the installed transformers has cache layers for linear attention (the exact multi-token forward)."""
    from transformers import cache_utils
    return hasattr(cache_utils, "LinearAttentionCacheLayerMixin")


def _holds_tensor(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        value = list(value.values())
    return isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value)


def _save(value, clone: bool):
    if isinstance(value, torch.Tensor):
        return ("t", value, value._version, value.clone() if clone else None)
    if isinstance(value, dict):
        return ("d", {k: _save(v, clone) for k, v in value.items()})
    if isinstance(value, list):
        return ("l", [_save(v, clone) for v in value])
    return ("v", value)


def _load(entry, where: str):
    kind = entry[0]
    if kind == "d":
        return {k: _load(v, where) for k, v in entry[1].items()}
    if kind == "l":
        return [_load(v, where) for v in entry[1]]
    if kind == "v":
        return entry[1]
    _, ref, version, saved = entry
    if saved is None:  # kept by reference: the forward must have replaced it, not written into it
        if ref._version != version:
            raise RuntimeError(f"cache rollback: {where} was updated in place by the forward, so its state before "
                               "the verify step is lost (a cache layer kind specring does not know)")
        return ref
    if ref._version != version and ref.shape == saved.shape:  # updated in place: write the saved state back
        ref.copy_(saved)
        return ref
    return saved if ref._version != version else ref


def snapshot_cache(cache) -> list:
    """What ``restore_cache`` needs to put ``cache`` back as it is now: for every part (``_cache_parts``) its
    attributes, with attention keys/values kept by reference (a forward replaces them; restoring the
    reference is exact and costs nothing) and every other tensor cloned (linear-attention conv and recurrent
    states, ``[1, C, K]`` and ``[1, heads, d_k, d_v]`` per layer, which a forward updates in place)."""
    return [(part, {name: _save(v, clone=name not in _REPLACED_ON_UPDATE) for name, v in vars(part).items()})
            for part in _cache_parts(cache)]


def restore_cache(snapshot: list) -> None:
    """Put every part of a cache back as ``snapshot_cache`` saw it (in-place-updated tensors are written back
    into the same storage, so their addresses stay). Raises ``RuntimeError`` naming the attribute when a
    tensor kept by reference was written into in place (its earlier content is gone)."""
    for part, saved in snapshot:
        attrs = vars(part)
        for name, entry in saved.items():
            attrs[name] = _load(entry, f"{type(part).__name__}.{name}")


class TargetCache:
    """The target's cache during one speculative decode, rolled back exactly after a partial acceptance.

    A verify forward feeds ``[anchor, d_1..d_k]``; when only ``a < k`` drafts are accepted the cache must
    forget ``d_{a+1}..d_k``. Attention KV caches are cut (``crop_cache``). The recurrent and convolution
    states of linear-attention layers (Qwen3.5 / Qwen3-Next Gated DeltaNet, Mamba-style layers) have already
    absorbed the rejected tokens and cannot be cut, so the cache takes one of two modes, chosen after the
    prefill (``mode``):

    * ``crop``: every layer is exactly croppable (``exactly_croppable``: attention, sliding windows under
      transformers' past-state recording, convolution-only windows under it); ``keep(n)`` crops.
    * ``replay``: some layer is not (a recurrent state, or a sliding window on a transformers without
      recording). ``before_verify()`` snapshots the cache (``snapshot_cache``: states cloned, KV by
      reference); on a partial acceptance ``keep(n, tokens)`` restores it and re-runs the anchor and the
      accepted drafts (one more target forward, ``rollback_forwards``), which leaves the states exactly as
      if only the accepted tokens had been fed. A full acceptance needs nothing.

    The model builds the cache at the prefill (``_prefill``: the class its layers need, whatever the transformers
    version), and past-state recording is switched on where the installed transformers has it; the recorded windows are
    trimmed back after each step (``crop(0)``). transformers 5.24's recording covers convolution and sliding windows but
    no recurrent state (``is_croppable`` is false as soon as one exists, and its own assisted generation refuses such
    caches), hence the replay.
    """

    def __init__(self, target):
        self.target = target
        self.cache = None                # the model builds it at the prefill (_prefill)
        self.mode: str = ""
        self.length = 0                  # positions fed so far
        self.rollback_forwards = 0
        self._snapshot: list | None = None
        self._verify_start = 0

    def prefill(self, ids: Sequence[int], capture) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The prompt's forward (``_prefill``: the model builds the cache, recording on); decides ``mode``."""
        logits, feats, self.cache = _prefill(self.target, ids, capture, record_past=True)
        self.length = self._verify_start = len(ids)  # nothing to keep() before a verify forward
        self.mode = "crop" if exactly_croppable(self.cache) else "replay"
        check_linear_attention_support(self.cache)
        if _recording(self.cache):
            self.cache.crop(0)  # the prompt's recorded windows back to their working size
        return logits, feats

    def before_verify(self) -> None:
        """Call before each verify forward: in ``replay`` mode, snapshot the cache."""
        self._snapshot = snapshot_cache(self.cache) if self.mode == "replay" else None

    def verify(self, ids: Sequence[int], start: int, capture) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The verify forward of ``ids`` at positions ``start..`` (``before_verify`` first)."""
        self.before_verify()
        logits, feats = _forward(self.target, ids, start, self.cache, capture)
        self._verify_start, self.length = int(start), int(start) + len(ids)
        if self.mode == "replay" and _recording(self.cache):
            self.cache.crop(0)  # recorded conv windows back to kernel size (the snapshot holds the earlier ones)
        return logits, feats

    def keep(self, length: int, tokens: Sequence[int], capture=None) -> None:
        """Keep the first ``length`` positions (the anchor and the accepted drafts of the last verify forward).
        ``tokens``: the sequence so far (prompt and generated), at least ``length`` long, from which ``replay``
        re-runs positions ``verify start .. length - 1``; ``capture``: the decode's ``LayerCapture`` (cleared
        after a replay; the verify forward's features are the ones used). Raises ``ValueError`` for a
        ``length`` outside the last verify forward, ``RuntimeError`` from ``restore_cache``."""
        length = int(length)
        if not self._verify_start < length <= self.length:
            raise ValueError(f"TargetCache.keep: {length} positions asked, the last verify forward covered "
                             f"{self._verify_start + 1}..{self.length}")
        if self.mode == "crop":  # by the positions fed (a cache of convolution layers only has no seq length)
            remove = self.length - length
            if remove or _recording(self.cache):
                self.cache.crop(-remove)
        elif length < self.length:
            restore_cache(self._snapshot)
            _forward(self.target, list(tokens[self._verify_start:length]), self._verify_start, self.cache, None,
                     last_only=True)
            if capture is not None:
                capture.clear()
            if _recording(self.cache):
                self.cache.crop(0)
            self.rollback_forwards += 1
        self._snapshot = None
        self.length = self._verify_start = length


def _forward(target, ids: Sequence[int], start: int, cache, capture, last_only: bool = False):
    """One target forward of ``ids`` at positions ``start..`` over ``cache``. Returns ``(logits [S|1, V]
    float32, features [S, n*H] or None)``."""
    out, feats = _run(target, ids, start, cache, capture, last_only)
    return out.logits[0].float(), feats


def _run(target, ids: Sequence[int], start: int, cache, capture, last_only: bool):
    """``_forward``'s forward: the model's output and the captured features (``capture`` cleared after)."""
    dev = _device_of(target)
    input_ids = torch.tensor([list(ids)], dtype=torch.long, device=dev)
    pos = torch.arange(start, start + len(ids), device=dev)[None]
    kw = {_cache_kwarg(target): cache}
    out = target(input_ids=input_ids, position_ids=pos, use_cache=True, logits_to_keep=1 if last_only else 0, **kw)
    feats = None
    if capture is not None:
        feats = torch.cat([o[0] for o in capture.outputs()], dim=-1)
        capture.clear()
    return out, feats


def _cut_at_stop(tokens: list[int], stop: set[int]) -> tuple[list[int], bool]:
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[:i + 1], True
    return tokens, False


@torch.no_grad()
def greedy_generate(target, prompt_ids: Sequence[int], max_new_tokens: int,
                    stop_token_ids: Sequence[int] = ()) -> DecodeResult:
    """Plain greedy decoding with a KV cache, one token per forward: the reference for losslessness.

    ``target``: a Hugging Face causal LM in eval mode. Stops after ``max_new_tokens`` tokens or after the
    first stop token (included in ``tokens``). Raises ``ValueError`` for an empty prompt or
    ``max_new_tokens < 1``.
    """
    _check_args(prompt_ids, max_new_tokens)
    t0 = time.perf_counter()
    stop = set(int(t) for t in stop_token_ids)
    logits, _, cache = _prefill(target, prompt_ids, None)
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < max_new_tokens and tokens[-1] not in stop:
        logits, _ = _forward(target, tokens[-1:], len(prompt_ids) + len(tokens) - 1, cache, None)
        tokens.append(int(logits[-1].argmax()))
    return DecodeResult(prompt_len=len(prompt_ids), tokens=tokens, accept_lengths=[1] * (len(tokens) - 1),
                        drafted=[0] * (len(tokens) - 1), target_forwards=len(tokens),
                        wall_s=time.perf_counter() - t0, stopped=tokens[-1] in stop)


def _check_args(prompt_ids: Sequence[int], max_new_tokens: int) -> None:
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids: empty prompt")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")


@torch.no_grad()
def sample_generate(target, prompt_ids: Sequence[int], max_new_tokens: int, params: SamplingParams,
                    generator: torch.Generator | None = None,
                    stop_token_ids: Sequence[int] = ()) -> DecodeResult:
    """Plain autoregressive sampling with a KV cache, one token per forward: each token drawn (``draw``,
    with ``generator``; None: torch's global CPU generator) from ``params.probs`` of the target's logits.
    The reference distribution of speculative sampling. ``params.temperature == 0`` is
    ``greedy_generate``. Stops as ``greedy_generate`` does; raises ``ValueError`` for an empty prompt or
    ``max_new_tokens < 1``."""
    if params.greedy:
        return greedy_generate(target, prompt_ids, max_new_tokens, stop_token_ids)
    _check_args(prompt_ids, max_new_tokens)
    t0 = time.perf_counter()
    stop = set(int(t) for t in stop_token_ids)
    logits, _, cache = _prefill(target, prompt_ids, None)
    tokens = [draw(params.probs(logits[-1:])[0], generator)]
    while len(tokens) < max_new_tokens and tokens[-1] not in stop:
        logits, _ = _forward(target, tokens[-1:], len(prompt_ids) + len(tokens) - 1, cache, None)
        tokens.append(draw(params.probs(logits[-1:])[0], generator))
    return DecodeResult(prompt_len=len(prompt_ids), tokens=tokens, accept_lengths=[1] * (len(tokens) - 1),
                        drafted=[0] * (len(tokens) - 1), target_forwards=len(tokens),
                        wall_s=time.perf_counter() - t0, stopped=tokens[-1] in stop)


def _sampled_drafts(proposer, seq: list[int], k: int, params: SamplingParams,
                    generator: torch.Generator | None) -> tuple[list[int], torch.Tensor]:
    """``proposer.propose_sample`` cut to ``k`` drafts, ``q`` as float32 on the CPU; ``ValueError`` naming the
    proposer when ``q`` is not ``[len(drafts), V]``-shaped (``V`` checked against the target later)."""
    if not hasattr(proposer, "propose_sample"):
        raise ValueError(f"proposer {proposer.name!r} has no propose_sample: it cannot draft at temperature > 0")
    draft, q = proposer.propose_sample(seq, k, params, generator)
    draft = [int(t) for t in draft][:k]
    q = torch.as_tensor(q).float().cpu()
    if q.dim() != 2 or q.shape[0] < len(draft):
        raise ValueError(f"proposer {proposer.name!r}: q has shape {tuple(q.shape)}, expected "
                         f"[{len(draft)}, V] for {len(draft)} drafts")
    return draft, q[:len(draft)]


@torch.no_grad()
def speculative_generate(target, proposer, prompt_ids: Sequence[int], max_new_tokens: int, block_size: int,
                         layer_ids: Sequence[int] | None = None,
                         stop_token_ids: Sequence[int] = (), sampling: SamplingParams | None = None,
                         generator: torch.Generator | None = None) -> DecodeResult:
    """Block-verify speculative decoding, greedy or sampled (see the module docstring for the loop and its
    source).

    ``target``: Hugging Face causal LM in eval mode (batch 1); ``proposer``: see the module docstring;
    ``block_size``: ``B`` (at most ``B - 1`` drafts per step); ``layer_ids``: the captured target layers
    (DFlash convention, needed when ``proposer.needs_features``).

    ``sampling`` None or at temperature 0: greedy, and the output equals
    ``greedy_generate(target, prompt_ids, max_new_tokens, stop_token_ids).tokens``. At temperature > 0:
    speculative sampling (``rejection_sample``) with ``proposer.propose_sample``; every random draw uses
    ``generator`` (a CPU ``torch.Generator``; None: torch's global CPU generator), so a seeded generator
    reproduces the run, and the output is distributed as ``sample_generate``'s.

    The target's cache is rolled back after each partial acceptance by ``TargetCache`` (cropped, or restored and
    the accepted tokens re-run on linear-attention layers); ``DecodeResult.cache_rollback`` says which and
    ``rollback_forwards`` counts the re-runs (included in ``target_forwards``). Raises ``ValueError`` for bad
    arguments, a proposer without ``propose_sample`` at temperature > 0, or a ``q`` whose vocabulary differs from
    the target's logits; ``RuntimeError`` for a target with linear-attention layers on a transformers without
    their cache layers (``check_linear_attention_support``).
    """
    from specring.shared.models.target import LayerCapture

    _check_args(prompt_ids, max_new_tokens)
    if block_size < 1:
        raise ValueError(f"block_size: must be >= 1, got {block_size}")
    if proposer.needs_features and not layer_ids:
        raise ValueError(f"layer_ids: proposer {proposer.name!r} needs target features; no layer ids given")
    sampled = sampling is not None and not sampling.greedy
    t0 = time.perf_counter()
    stop = set(int(t) for t in stop_token_ids)
    cache = TargetCache(target)
    capture = LayerCapture(target, list(layer_ids)) if proposer.needs_features else None
    prompt = [int(t) for t in prompt_ids]
    res = DecodeResult(prompt_len=len(prompt), tokens=[])
    with capture if capture is not None else contextlib.nullcontext():
        logits, feats = cache.prefill(prompt, capture)
        res.target_forwards = 1
        res.cache_rollback = cache.mode
        proposer.reset(prompt)
        if feats is not None:
            proposer.add_context(feats, torch.arange(len(prompt)))
        first = draw(sampling.probs(logits[-1:])[0], generator) if sampled else int(logits[-1].argmax())
        seq = prompt + [first]
        res.tokens.append(seq[-1])
        res.stopped = seq[-1] in stop
        k = block_size - 1
        while not res.stopped and len(res.tokens) <= max_new_tokens:  # the reference's start < max_length
            if sampled:
                draft, q = _sampled_drafts(proposer, seq, k, sampling, generator)
            else:
                draft = [int(t) for t in proposer.propose(seq, k)][:k]
            anchor_pos = len(seq) - 1
            logits, feats = cache.verify([seq[-1]] + draft, anchor_pos, capture)
            res.target_forwards += 1
            if sampled:
                if draft and q.shape[1] != logits.shape[-1]:
                    raise ValueError(f"proposer {proposer.name!r}: q covers {q.shape[1]} ids, the target's "
                                     f"logits {logits.shape[-1]}")
                a, bonus = rejection_sample(draft, q, sampling.probs(logits).cpu(), generator)
            else:
                greedy = logits.argmax(dim=-1).tolist()
                a = 0
                while a < len(draft) and draft[a] == greedy[a]:
                    a += 1
                bonus = greedy[a]
            new, res.stopped = _cut_at_stop(draft[:a] + [bonus], stop)
            produced = len(new)
            if feats is not None:
                proposer.add_context(feats[:produced], torch.arange(anchor_pos, anchor_pos + produced))
            seq += new
            res.tokens += new
            res.accept_lengths.append(a + 1)
            res.drafted.append(len(draft))
            if not res.stopped and len(res.tokens) <= max_new_tokens:  # another step follows: roll back
                cache.keep(anchor_pos + produced, seq, capture)      # the anchor and the accepted drafts
    res.rollback_forwards = cache.rollback_forwards
    res.target_forwards += cache.rollback_forwards
    res.tokens = res.tokens[:max_new_tokens]
    res.stopped = bool(res.tokens) and res.tokens[-1] in stop
    res.wall_s = time.perf_counter() - t0
    return res


# ---------------------------------------------------------------------------------------------- figures
def summarize(results: list[DecodeResult], block_size: int) -> dict[str, Any]:
    """Figures of a set of decodes (see the module docstring); τ fields are None when no verify step ran."""
    steps = [a for r in results for a in r.accept_lengths]
    per_prompt = [float(np.mean(r.accept_lengths)) for r in results if r.accept_lengths]
    generated = sum(len(r.tokens) for r in results)
    forwards = sum(r.target_forwards for r in results)
    wall = sum(r.wall_s for r in results)
    hist = {str(b): steps.count(b) for b in range(1, block_size + 1)}
    return {
        "num_prompts": len(results),
        "generated_tokens": generated,
        "target_forwards": forwards,
        "verify_steps": len(steps),
        "tau_mean": float(np.mean(per_prompt)) if per_prompt else None,
        "tau_pooled": float(np.mean(steps)) if steps else None,
        "tau_p50": float(np.percentile(steps, 50)) if steps else None,
        "tau_p90": float(np.percentile(steps, 90)) if steps else None,
        "accept_hist": hist,
        "mean_drafted": float(np.mean([d for r in results for d in r.drafted])) if steps else None,
        "forwards_per_token": forwards / generated if generated else None,
        "rollback_forwards": sum(r.rollback_forwards for r in results),
        "cache_rollback": "+".join(sorted({r.cache_rollback for r in results if r.cache_rollback})) or None,
        "tokens_per_s": generated / wall if wall > 0 else None,
        "wall_s": wall,
    }


def target_vocab_size(target) -> int:
    """The width ``V`` of the target's logits: its output embedding's rows (``config.vocab_size`` when it
    has none)."""
    head = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
    if head is not None and getattr(head, "weight", None) is not None:
        return int(head.weight.shape[0])
    return int(target.config.vocab_size)


def with_vocab_size(proposer, vocab_size: int):
    """``proposer``, or, for a ``PromptLookupProposer`` built without ``vocab_size``, a copy of it with
    ``vocab_size`` set (its one-hot ``q`` needs the width); the given object is left as it is."""
    from specring.shared.models.ngram import PromptLookupProposer
    if isinstance(proposer, PromptLookupProposer) and proposer.vocab_size is None:
        proposer = copy.copy(proposer)
        proposer.vocab_size = int(vocab_size)
    return proposer


def check_same_head(drafter: torch.nn.Module, target) -> None:
    """Raise ``ValueError`` unless the drafter's frozen embedding is the target's (same values)."""
    mine = drafter.embed_tokens.weight.detach().float().cpu()
    theirs = target.get_input_embeddings().weight.detach().float().cpu()
    if mine.shape != theirs.shape or not torch.equal(mine, theirs.to(mine.dtype)):
        raise ValueError("the drafter's embed_tokens differ from the target's: it was trained for another "
                         "target (pass the right --target)")
