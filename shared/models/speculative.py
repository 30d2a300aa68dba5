"""Speculative decoding with the target (greedy, block verify) and its acceptance length τ.

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
4. The target cache is cropped to ``p + produced`` (anchor and accepted tokens kept); the verify forward's
   features of the anchor and the accepted tokens (rows ``0..produced-1``) become new drafter context;
   the last produced token is the next anchor. The drafter's cache holds verified context only
   (``DraftCache``), so it never needs a rollback.

Every emitted token is a target greedy choice given a prefix of target greedy choices, so the output
equals plain greedy decoding token for token (``greedy_generate``; a test asserts it).

Figures (as z-lab/dflash ``dflash/benchmark.py`` reports them, counted as ``dflash_generate`` counts):
the acceptance length of a verify step is ``a + 1`` (accepted drafts plus the bonus; the prefill's first
token is not a verify step), never cut at the generation limit or a stop token; verify steps go on while
no stop token was produced and at most ``max_new_tokens`` tokens exist (the reference's ``start <
max_length``, so a step also runs when exactly ``max_new_tokens`` are there). ``tau_mean`` is the mean over
prompts of each prompt's mean acceptance length, ``tau_pooled`` the mean over all steps,
``tau_p50``/``tau_p90`` percentiles over steps and ``accept_hist`` the count of steps per length.
``forwards_per_token`` = target forwards (prefill included) / generated tokens (1.0 for plain greedy
decoding). ``tokens_per_s`` = generated tokens / wall time of the generate calls (prefill included);
``speedup`` = a row's ``tokens_per_s`` over plain greedy decoding's in the same run (the reference's
"Decoding speedup": baseline time per output token over speculative time per output token).

A *proposer* is any object with ``name``, ``needs_features`` and the methods ``reset(prompt_ids)``,
``add_context(features [C, n*H] | None, positions [C])`` and ``propose(tokens, k) -> list[int]`` (``tokens``:
the whole sequence, its last entry the anchor). ``DFlashProposer`` wraps a drafter;
``consumer.ngram.PromptLookupProposer`` is the model-free baseline.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from specring.shared.models.dflash import (
    DFlashConfig,
    DFlashDrafter,
    DraftCache,
    build_drafter,
)
from specring.shared.models.eagle3 import Eagle3Drafter

logger = logging.getLogger(__name__)


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


    @torch.no_grad()
    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Greedy drafts (argmax of block rows ``1..k``) after the anchor ``tokens[-1]``."""
        k = min(int(k), self.block_size - 1)
        if k <= 0:
            return []
        dev = self.drafter.fc.weight.device
        if self._pending:
            feats = torch.cat([f for f, _ in self._pending]).to(dev)
            pos = torch.cat([p for _, p in self._pending]).to(dev)
        else:
            feats = torch.empty(0, self.drafter.fc.in_features, device=dev)
            pos = torch.empty(0, dtype=torch.long, device=dev)
        logits, self.cache = self.drafter.draft_block(feats, pos, int(tokens[-1]), len(tokens) - 1,
                                                      self.cache, block_size=k + 1)
        self._pending = []
        return logits[1:].argmax(dim=-1).tolist()


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


# ---------------------------------------------------------------------------------------------- decoding
@dataclass
class DecodeResult:
    """One generated continuation. ``tokens``: generated ids (prompt excluded); ``accept_lengths``: tokens
    produced by each verify forward; ``drafted``: tokens proposed at each step; ``target_forwards``:
    prefill included; ``wall_s``: seconds of the whole call; ``stopped``: ended on a stop token."""
    prompt_len: int
    tokens: list[int]
    accept_lengths: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    target_forwards: int = 0
    wall_s: float = 0.0
    stopped: bool = False


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _new_cache(target):
    from transformers import DynamicCache
    try:
        return DynamicCache(config=target.config)
    except TypeError:  # transformers 4.x: no config argument
        return DynamicCache()


def _cache_kwarg(target) -> str:
    """The forward's KV-cache argument: ``cache`` (transformers >= 5.2x) or ``past_key_values`` (older)."""
    name = getattr(target, "_specring_cache_kwarg", None)
    if name is None:
        params = inspect.signature(target.forward).parameters
        name = "cache" if "cache" in params else "past_key_values"
        target._specring_cache_kwarg = name
    return name


def crop_cache(cache, length: int) -> None:
    """Keep the first ``length`` positions of a ``DynamicCache`` (through ``crop(-n)``, the form every
    transformers version accepts; z-lab/dflash ``_crop_to`` does the same)."""
    remove = cache.get_seq_length() - int(length)
    if remove < 0:
        raise ValueError(f"crop_cache: cache holds {cache.get_seq_length()} positions, cannot keep {length}")
    if remove:
        cache.crop(-remove)


def _forward(target, ids: Sequence[int], start: int, cache, capture, last_only: bool = False):
    """One target forward of ``ids`` at positions ``start..`` over ``cache``. Returns ``(logits [S|1, V]
    float32, features [S, n*H] or None)``."""
    dev = _device_of(target)
    input_ids = torch.tensor([list(ids)], dtype=torch.long, device=dev)
    pos = torch.arange(start, start + len(ids), device=dev)[None]
    kw = {_cache_kwarg(target): cache}
    out = target(input_ids=input_ids, position_ids=pos, use_cache=True, logits_to_keep=1 if last_only else 0, **kw)
    feats = None
    if capture is not None:
        feats = torch.cat([o[0] for o in capture.outputs()], dim=-1)
        capture.clear()
    return out.logits[0].float(), feats


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
    cache = _new_cache(target)
    stop = set(int(t) for t in stop_token_ids)
    logits, _ = _forward(target, prompt_ids, 0, cache, None, last_only=True)
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
def speculative_generate(target, proposer, prompt_ids: Sequence[int], max_new_tokens: int, block_size: int,
                         layer_ids: Sequence[int] | None = None,
                         stop_token_ids: Sequence[int] = ()) -> DecodeResult:
    """Greedy block-verify speculative decoding (see the module docstring for the loop and its source).

    ``target``: Hugging Face causal LM in eval mode (batch 1); ``proposer``: see the module docstring;
    ``block_size``: ``B`` (at most ``B - 1`` drafts per step); ``layer_ids``: the captured target layers
    (DFlash convention, needed when ``proposer.needs_features``). The output equals
    ``greedy_generate(target, prompt_ids, max_new_tokens, stop_token_ids).tokens``.
    """
    from specring.shared.models.target import LayerCapture

    _check_args(prompt_ids, max_new_tokens)
    if block_size < 1:
        raise ValueError(f"block_size: must be >= 1, got {block_size}")
    if proposer.needs_features and not layer_ids:
        raise ValueError(f"layer_ids: proposer {proposer.name!r} needs target features; no layer ids given")
    t0 = time.perf_counter()
    stop = set(int(t) for t in stop_token_ids)
    cache = _new_cache(target)
    capture = LayerCapture(target, list(layer_ids)) if proposer.needs_features else None
    prompt = [int(t) for t in prompt_ids]
    res = DecodeResult(prompt_len=len(prompt), tokens=[])
    with capture if capture is not None else contextlib.nullcontext():
        logits, feats = _forward(target, prompt, 0, cache, capture, last_only=True)
        res.target_forwards = 1
        proposer.reset(prompt)
        if feats is not None:
            proposer.add_context(feats, torch.arange(len(prompt)))
        seq = prompt + [int(logits[-1].argmax())]
        res.tokens.append(seq[-1])
        res.stopped = seq[-1] in stop
        k = block_size - 1
        while not res.stopped and len(res.tokens) <= max_new_tokens:  # the reference's start < max_length
            draft = [int(t) for t in proposer.propose(seq, k)][:k]
            anchor_pos = len(seq) - 1
            logits, feats = _forward(target, [seq[-1]] + draft, anchor_pos, cache, capture)
            res.target_forwards += 1
            greedy = logits.argmax(dim=-1).tolist()
            a = 0
            while a < len(draft) and draft[a] == greedy[a]:
                a += 1
            new, res.stopped = _cut_at_stop(draft[:a] + [greedy[a]], stop)
            produced = len(new)
            crop_cache(cache, anchor_pos + produced)  # keep the anchor and the accepted drafts
            if feats is not None:
                proposer.add_context(feats[:produced], torch.arange(anchor_pos, anchor_pos + produced))
            seq += new
            res.tokens += new
            res.accept_lengths.append(a + 1)
            res.drafted.append(len(draft))
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
        "tokens_per_s": generated / wall if wall > 0 else None,
        "wall_s": wall,
    }


@torch.no_grad()
def evaluate_tau(target_model, drafter, prompts: list[list[int]], max_new_tokens: int,
                 layer_ids: Sequence[int] | None, *, block_size: int | None = None,
                 stop_token_ids: Sequence[int] = (), check_lossless: bool = False,
                 on_prompt: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """τ of ``drafter`` on ``prompts`` against an already-loaded target (for the trainer's checkpoints).

    ``target_model``: HF ``AutoModelForCausalLM`` in eval mode; ``drafter``: a live ``DFlashDrafter`` or
    ``Eagle3Drafter`` (put in eval mode for the call, its mode restored after; EAGLE-3 drafts a chain of
    ``block_size - 1`` tokens, by default ``ttt_steps``, with ``Eagle3Proposer``) or any proposer (e.g.
    ``PromptLookupProposer()``); ``layer_ids``: the target layers the drafter was trained on (must equal
    ``drafter.config.target_layer_ids``: ``ValueError`` otherwise). ``block_size`` defaults to the
    drafter's (16 for a proposer). With ``check_lossless`` also decodes greedily and adds
    ``lossless_mismatches`` (prompts whose outputs differ; must be 0). ``on_prompt(done, total)`` is
    called after each prompt (the consumer sends a heartbeat from it). Returns ``summarize``'s dict.
    """
    if isinstance(drafter, (DFlashDrafter, Eagle3Drafter)):
        if layer_ids is not None and list(layer_ids) != list(drafter.config.target_layer_ids):
            raise ValueError(f"layer_ids: {list(layer_ids)} differ from the drafter's target_layer_ids "
                             f"{drafter.config.target_layer_ids}")
        layer_ids = drafter.config.target_layer_ids
        if isinstance(drafter, DFlashDrafter):
            proposer = DFlashProposer(drafter, block_size)
            bsz = proposer.block_size
        else:  # chain drafting, as deep as training-time test unrolled it unless block_size says otherwise
            bsz = int(block_size or drafter.config.ttt_steps + 1)
            proposer = Eagle3Proposer(drafter, bsz - 1)
    else:
        proposer, bsz = drafter, int(block_size or 16)
    was_training = getattr(drafter, "training", False)
    if isinstance(drafter, torch.nn.Module):
        drafter.eval()
    try:
        results = []
        for p in prompts:
            results.append(speculative_generate(target_model, proposer, p, max_new_tokens, bsz, layer_ids,
                                                stop_token_ids))
            if on_prompt is not None:
                on_prompt(len(results), len(prompts))
        out = summarize(results, bsz)
        if check_lossless:
            ref = [greedy_generate(target_model, p, max_new_tokens, stop_token_ids) for p in prompts]
            out["lossless_mismatches"] = sum(r.tokens != g.tokens for r, g in zip(results, ref))
            out["greedy_tokens_per_s"] = summarize(ref, bsz)["tokens_per_s"]
    finally:
        if isinstance(drafter, torch.nn.Module):
            drafter.train(was_training)
    return out


def load_prompts(path: str | Path, num_prompts: int, prompt_len: int) -> list[list[int]]:
    """The first ``prompt_len`` tokens of ``num_prompts`` held-out samples, spread evenly over the file.

    Only samples with more than ``prompt_len`` tokens are used (a continuation exists). Raises
    ``ValueError`` naming the file when none is long enough; logs when fewer than asked are available.
    """
    from specring.shared.data.dataset import TokenDataset

    if num_prompts < 1 or prompt_len < 1:
        raise ValueError(f"num_prompts and prompt_len must be >= 1, got {num_prompts} and {prompt_len}")
    ds = TokenDataset(path)
    eligible = np.nonzero(ds.lengths > prompt_len)[0]
    if eligible.size == 0:
        raise ValueError(f"{path}: no sample is longer than --prompt-len {prompt_len}")
    if eligible.size < num_prompts:
        logger.warning("only %d samples of %s are longer than %d tokens (asked for %d prompts)",
                       eligible.size, path, prompt_len, num_prompts)
    n = min(num_prompts, int(eligible.size))
    picks = [int(eligible[(i * eligible.size) // n]) for i in range(n)]
    return [ds[i][0][:prompt_len].astype(np.int64).tolist() for i in picks]


def untrained_drafter(dcfg: DFlashConfig, target_dir: str | Path, device, dtype: torch.dtype,
                      seed: int = 0) -> DFlashDrafter:
    """A randomly initialised drafter (seeded, the global RNG untouched) with the target's frozen head."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_drafter(dcfg, target_dir, device="cpu", dtype=dtype)
    return model.to(device).eval()


def check_same_head(drafter: DFlashDrafter, target) -> None:
    """Raise ``ValueError`` unless the drafter's frozen embedding is the target's (same values)."""
    mine = drafter.embed_tokens.weight.detach().float().cpu()
    theirs = target.get_input_embeddings().weight.detach().float().cpu()
    if mine.shape != theirs.shape or not torch.equal(mine, theirs.to(mine.dtype)):
        raise ValueError("the drafter's embed_tokens differ from the target's: it was trained for another "
                         "target (pass the right --target)")
