"""Acceptance length τ by real speculative decoding (greedy, block verify), and ``launch.py eval``.

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

import argparse
import contextlib
import inspect
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from consumer.dflash import DFlashConfig, DFlashDrafter, DraftCache, build_drafter
from consumer.ngram import PromptLookupProposer

logger = logging.getLogger(__name__)

SLOW_EVAL_ENV = "SPECRING_SLOW_EVAL_S"  # tests and drills: seconds slept after each prompt of a checkpoint eval


# ---------------------------------------------------------------------------------------------- proposers
class DFlashProposer:
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

    def reset(self, prompt_ids: list[int]) -> None:
        self.cache = None
        self._pending = []

    def add_context(self, features: torch.Tensor | None, positions: torch.Tensor) -> None:
        """Queue verified context: ``features [C, n*H]`` of the tokens at ``positions [C] long``."""
        if features is None:
            raise ValueError("DFlashProposer.add_context: the drafter needs target features (got None)")
        self._pending.append((features, positions))

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


class NoDraftProposer:
    """Proposes nothing: speculative decoding degenerates to one token per target forward (τ = 1)."""

    name = "no-draft"
    needs_features = False

    def reset(self, prompt_ids: list[int]) -> None:
        pass

    def add_context(self, features, positions) -> None:
        pass

    def propose(self, tokens: list[int], k: int) -> list[int]:
        return []


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
    from producers.target import LayerCapture

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

    ``target_model``: HF ``AutoModelForCausalLM`` in eval mode; ``drafter``: a live ``DFlashDrafter``
    (put in eval mode for the call, its mode restored after) or any proposer (e.g.
    ``PromptLookupProposer()``); ``layer_ids``: the target layers the drafter was trained on (must equal
    ``drafter.config.target_layer_ids``: ``ValueError`` otherwise). ``block_size`` defaults to the
    drafter's (16 for a proposer). With ``check_lossless`` also decodes greedily and adds
    ``lossless_mismatches`` (prompts whose outputs differ; must be 0). ``on_prompt(done, total)`` is
    called after each prompt (the consumer sends a heartbeat from it). Returns ``summarize``'s dict.
    """
    if isinstance(drafter, DFlashDrafter):
        if layer_ids is not None and list(layer_ids) != list(drafter.config.target_layer_ids):
            raise ValueError(f"layer_ids: {list(layer_ids)} differ from the drafter's target_layer_ids "
                             f"{drafter.config.target_layer_ids}")
        layer_ids = drafter.config.target_layer_ids
        proposer = DFlashProposer(drafter, block_size)
        bsz = proposer.block_size
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


# ---------------------------------------------------------------------------------------------- inputs
class CheckpointEvaluator:
    """τ of the live drafter at training checkpoints (``train --eval-prompts N``), rank 0 of the consumers.

    The target is loaded into the consumer process by ``load()`` (the consumer calls it at start-up, so a
    long load is not mistaken for a hang mid-run; ``__call__`` loads it if nobody did) on the consumer's
    device in the producers' dtype (``random_weights`` honoured) and kept; prompts are the first ``prompt_len`` tokens of
    ``num_prompts`` held-out samples. Each evaluation appends ``{"step", "tau_mean", "tau_p50", "tau_p90",
    "forwards_per_token", "loss", "time"}`` to ``RUN_DIR/eval.jsonl`` and logs ``tau step=... tau=...``.
    Costs one extra copy of the target's weights on the consumer's device.

    ``$SPECRING_SLOW_EVAL_S`` (tests and drills only) sleeps that many seconds after each prompt.
    """

    def __init__(self, run_cfg, device: torch.device, run_dir: str | Path, prompt_len: int = 64):
        self.cfg = run_cfg
        self.device = device
        self.path = Path(run_dir) / "eval.jsonl"
        self.prompt_len = prompt_len
        self.target = None
        self.prompts: list[list[int]] = []

    def load(self) -> None:
        """Load the target and the prompts (once); raises ``ConfigError`` if the target does not load."""
        from producers.target import load_target
        tc, pc = self.cfg.trainer, self.cfg.producer
        if self.target is None:
            self.target, _ = load_target(pc.target, self.device, pc.dtype, random_weights=pc.random_weights)
            self.prompts = load_prompts(self.cfg.data.heldout, tc.eval_prompts, self.prompt_len)

    def __call__(self, drafter: DFlashDrafter, step: int, loss: float | None,
                 on_prompt: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        """Evaluate ``drafter`` at optimizer step ``step``; returns the record appended to ``eval.jsonl``.
        ``on_prompt(done, total)`` is called after each prompt."""
        tc, pc = self.cfg.trainer, self.cfg.producer
        self.load()
        slow_s = float(os.environ.get(SLOW_EVAL_ENV) or 0)

        def after_prompt(done: int, total: int) -> None:
            if slow_s > 0:
                time.sleep(slow_s)
            if on_prompt is not None:
                on_prompt(done, total)

        t0 = time.perf_counter()
        # decoding shapes differ from training's: run the compiled draft layers eagerly instead of compiling
        # new graphs in the middle of a run
        stance = getattr(torch.compiler, "set_stance", None)
        with stance("force_eager") if stance is not None else contextlib.nullcontext():
            r = evaluate_tau(self.target, drafter, self.prompts, tc.eval_max_new_tokens, pc.target_layer_ids,
                             on_prompt=after_prompt)
        rec = {"step": int(step), "tau_mean": r["tau_mean"], "tau_p50": r["tau_p50"], "tau_p90": r["tau_p90"],
               "forwards_per_token": r["forwards_per_token"], "loss": loss, "prompts": len(self.prompts),
               "eval_s": round(time.perf_counter() - t0, 2), "time": time.time()}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        logger.info("tau step=%d tau=%.3f p50=%s p90=%s forwards_per_token=%.3f loss=%s prompts=%d eval_s=%.1f",
                    step, rec["tau_mean"], rec["tau_p50"], rec["tau_p90"], rec["forwards_per_token"],
                    "-" if loss is None else f"{loss:.3f}", len(self.prompts), rec["eval_s"])
        return rec


def load_prompts(path: str | Path, num_prompts: int, prompt_len: int) -> list[list[int]]:
    """The first ``prompt_len`` tokens of ``num_prompts`` held-out samples, spread evenly over the file.

    Only samples with more than ``prompt_len`` tokens are used (a continuation exists). Raises
    ``ValueError`` naming the file when none is long enough; logs when fewer than asked are available.
    """
    from shared.data import TokenDataset

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


def target_of_checkpoint(step_dir: str | Path) -> Path | None:
    """The target a checkpoint was trained against, from ``run_dir/config.json`` (``producer.target``) of
    the run that holds ``run_dir/checkpoints/step-*/``; None when it is not recorded."""
    run_dir = Path(step_dir).resolve().parent.parent
    cfg_path = run_dir / "config.json"
    try:
        target = json.loads(cfg_path.read_text())["producer"]["target"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return Path(target) if target else None


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


# ---------------------------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launch.py eval", description=(
        "Acceptance length tau by real greedy block-verify speculative decoding with the target, next to "
        "the baselines (untrained drafter, prompt lookup) and checked lossless against greedy decoding."))
    p.add_argument("--target", help="target checkpoint directory (default: the run's target, else "
                                    "assets/tiny-code-lm)")
    p.add_argument("--drafter", default="none", help="checkpoint step directory or run directory (its latest "
                                                     "checkpoint); 'none' = baselines only")
    p.add_argument("--data", nargs="+", help="held-out Arrow file(s) from `launch.py prepare` "
                                             "(default: data/demo/heldout.arrow, built when missing)")
    p.add_argument("--num-prompts", type=int, default=24, help="prompts per dataset (default 24)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens generated per prompt (default 256)")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt = first N tokens of a sample (default 256)")
    p.add_argument("--block-size", type=int, help="verify block size B (default: the drafter's, else 16)")
    p.add_argument("--baselines-only", action="store_true", help="evaluate only the baselines")
    p.add_argument("--no-baselines", action="store_true", help="skip the untrained-drafter and prompt-lookup rows")
    p.add_argument("--baselines", default="untrained,prompt-lookup",
                   help="comma list of baseline rows: untrained, prompt-lookup (default both)")
    p.add_argument("--no-lossless-check", action="store_true", help="skip the greedy reference decode")
    p.add_argument("--ngram-max", type=int, default=3, help="longest n-gram of the prompt-lookup baseline")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the target's EOS token")
    p.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU), bfloat16, float32")
    p.add_argument("--seed", type=int, default=0, help="initialisation seed of the untrained drafter")
    p.add_argument("--output-json", help="write every figure to this JSON file")
    return p


def configure_cli_logging(prefix: str) -> None:
    """The project's log format for a command that starts no children (``shared.procs.configure_logging``
    when importable; it pulls in pyzmq, which a machine that only evaluates may lack)."""
    try:
        from shared.procs import configure_logging
    except ImportError:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True, datefmt="%H:%M:%S",
                            format=f"%(asctime)s {prefix} %(levelname)s %(name)s: %(message)s")
        return
    configure_logging(prefix)


def _stop_ids(hf_config) -> list[int]:
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def run_eval(args: argparse.Namespace) -> dict[str, Any]:
    """Everything ``main`` computes, as the JSON it writes (``rows``: one dict per dataset x drafter)."""
    from consumer import checkpoint as ckpt
    from producers.target import load_target
    from shared.config import DEFAULT_TARGET
    from shared.errors import ConfigError

    for flag, v in (("--num-prompts", args.num_prompts), ("--max-new-tokens", args.max_new_tokens),
                    ("--prompt-len", args.prompt_len)):
        if v < 1:
            raise ConfigError(f"{flag}: must be >= 1, got {v}")
    use_drafter = not args.baselines_only and str(args.drafter).lower() not in ("none", "")
    step_dir = ckpt.resolve_checkpoint(args.drafter) if use_drafter else None
    target_dir = Path(args.target or (step_dir and target_of_checkpoint(step_dir)) or DEFAULT_TARGET)
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else (
        "cpu" if args.device == "auto" else args.device)
    target, hf_config = load_target(target_dir, device, args.dtype)
    dtype = next(target.parameters()).dtype
    if step_dir is not None:
        drafter = ckpt.load_drafter(step_dir, device=device, dtype=dtype)
        check_same_head(drafter, target)
        dcfg = drafter.config
    else:
        drafter = None
        dcfg = DFlashConfig.from_target(target_dir, None, block_size=args.block_size or 16)
    bsz = int(args.block_size or dcfg.block_size)
    if bsz < 2:
        raise ConfigError(f"--block-size: must be >= 2, got {bsz}")
    rows_spec: list[tuple[str, Any]] = []
    if drafter is not None:
        rows_spec.append((f"dflash {step_dir.name}", DFlashProposer(drafter, bsz)))
    baselines = {b.strip() for b in args.baselines.split(",") if b.strip()}
    if baselines - {"untrained", "prompt-lookup"}:
        raise ConfigError(f"--baselines: unknown {sorted(baselines - {'untrained', 'prompt-lookup'})} "
                          "(known: untrained, prompt-lookup)")
    if not args.no_baselines or drafter is None:
        if "untrained" in baselines:
            rows_spec.append(("dflash untrained", DFlashProposer(untrained_drafter(dcfg, target_dir, device, dtype,
                                                                                   args.seed), bsz)))
        if "prompt-lookup" in baselines:
            rows_spec.append((f"prompt-lookup (n<={args.ngram_max})", PromptLookupProposer(args.ngram_max)))
    stop = [] if args.ignore_eos else _stop_ids(hf_config)
    data = [Path(d) for d in args.data] if args.data else None
    if data is None:
        from shared.prepare import ensure_demo
        data = [ensure_demo()[1]]
    greedy_generate(target, [0, 1, 2, 3], 4)  # warm-up: keep one-time costs out of tokens/s
    rows = []
    for path in data:
        prompts = load_prompts(path, args.num_prompts, args.prompt_len)
        ref, greedy_rate = None, None
        if not args.no_lossless_check:
            ref = [greedy_generate(target, p, args.max_new_tokens, stop)
                   for p in _progress(prompts, f"{path.stem}: target greedy")]
            rows.append({"dataset": path.stem, "drafter": "target greedy (reference)", **summarize(ref, bsz),
                         "speedup": 1.0})
            greedy_rate = rows[-1]["tokens_per_s"]
        for name, proposer in rows_spec:
            res = [speculative_generate(target, proposer, p, args.max_new_tokens, bsz, dcfg.target_layer_ids, stop)
                   for p in _progress(prompts, f"{path.stem}: {name}")]
            row = {"dataset": path.stem, "drafter": name, **summarize(res, bsz)}
            if ref is not None:
                row["lossless_mismatches"] = sum(r.tokens != g.tokens for r, g in zip(res, ref))
                row["speedup"] = row["tokens_per_s"] / greedy_rate if greedy_rate and row["tokens_per_s"] else None
            rows.append(row)
            logger.info("eval dataset=%s drafter=%r tau_mean=%s", path.stem, name, row["tau_mean"])
    return {"target": str(target_dir), "drafter": str(step_dir) if step_dir else None, "device": device,
            "dtype": str(dtype).replace("torch.", ""), "block_size": bsz, "num_prompts": args.num_prompts,
            "prompt_len": args.prompt_len, "max_new_tokens": args.max_new_tokens, "stop_token_ids": stop,
            "target_layer_ids": dcfg.target_layer_ids, "rows": rows}


def _progress(items: list, desc: str):
    """A tqdm bar over ``items`` (one tick per prompt) on stderr."""
    from tqdm import tqdm
    return tqdm(items, desc=desc, unit="prompt", file=sys.stderr, leave=False, dynamic_ncols=True)


def format_table(report: dict[str, Any]) -> str:
    """The report's rows as a fixed-width table."""
    def f(v, spec):
        return "-" if v is None else format(v, spec)

    head = (f"{'dataset':<12} {'drafter':<30} {'prompts':>7} {'tau mean':>8} {'p50':>5} {'p90':>5} "
            f"{'fwd/tok':>7} {'tok/s':>8} {'speedup':>7} {'lossless':>8}")
    lines = [head, "-" * len(head)]
    for r in report["rows"]:
        mism = r.get("lossless_mismatches")
        lossless = "-" if mism is None else ("yes" if mism == 0 else f"NO ({mism})")
        lines.append(f"{r['dataset'][:12]:<12} {r['drafter'][:30]:<30} {r['num_prompts']:>7} "
                     f"{f(r['tau_mean'], '.3f'):>8} {f(r['tau_p50'], '.1f'):>5} {f(r['tau_p90'], '.1f'):>5} "
                     f"{f(r['forwards_per_token'], '.3f'):>7} {f(r['tokens_per_s'], '.1f'):>8} "
                     f"{f(r.get('speedup'), '.2f'):>7} {lossless:>8}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``launch.py eval``: print the τ table (and write ``--output-json``). Exit code 0; 2 for a bad flag
    or input; 1 when, in float32, a speculative output differed from greedy decoding (a bug: decoding is
    lossless). In bfloat16/float16 that is only a warning: the verify forward over ``k + 1`` tokens and the
    one-token greedy step round differently, so a near-tie of the two best logits can flip."""
    from shared.errors import ConfigError

    args = build_parser().parse_args(argv)
    configure_cli_logging("eval")
    try:
        report = run_eval(args)
    except (ConfigError, ValueError, FileNotFoundError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"target {report['target']}  drafter {report['drafter'] or 'none'}  B={report['block_size']}  "
          f"prompt {report['prompt_len']} tokens, {report['max_new_tokens']} new, {report['device']} "
          f"{report['dtype']}")
    print(format_table(report))
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(report, indent=1) + "\n")
    bad = [r["drafter"] for r in report["rows"] if r.get("lossless_mismatches")]
    if bad and report["dtype"] == "float32":
        print(f"error: speculative output differs from greedy decoding for {bad}", file=sys.stderr)
        return 1
    if bad:  # 16-bit: a (k+1)-token verify and a 1-token step round differently; a near-tie can flip
        print(f"warning: speculative output differs from greedy decoding for {bad} in {report['dtype']}; "
              "rerun with --dtype float32 to tell a numerical near-tie from a bug", file=sys.stderr)
    return 0
