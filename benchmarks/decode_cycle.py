"""Where a speculative decoding cycle of ``launch.py eval`` goes: the drafter's ``propose`` against the target's
``verify``, for a trained drafter and for prompt lookup, on the same prompts (issue 23 item 3).

In the batched decode (``shared.models.batched_decode.batched_speculative_generate``) one cycle is a ``propose`` of
every row and one ``verify`` forward of the target over every row's block. On a small target both are bound by
kernel launches, not by the GPU's arithmetic, so the number of operators each call dispatches says what a cycle
costs on any device: a drafter needs a pooled τ (tokens per verify step) as many times prompt lookup's as its
cycle (``verify`` + ``propose``) dispatches operators more than prompt lookup's (whose ``propose`` is a short
n-gram search) to decode faster than it. Printed, per proposer: ``proposer=P verify_ops=N propose_ops=M
verify_ms=A propose_ms=B cycles=C tau_pooled=T wall_s=W``; then ``propose_ops_vs_verify=r`` and
``break_even_tau_pooled_ratio`` (the drafter's cycle operators over prompt lookup's), and
``tau_pooled_ratio=X`` (drafter over prompt lookup, this run). Operators are the top-level ``aten::`` calls of
``torch.profiler`` (CPU activity) in one profiled decode;
the times come from a second, unprofiled decode (with ``torch.cuda.synchronize`` around each call on a GPU, which
adds a sync per call: compare the two proposers within one run). On CUDA a DFlash drafter's ``propose`` is the
CUDA-graph form (``shared.models.batched_dflash_graphs``): a graph replay is no ``aten::`` call, so its operators
are what stays on the host; ``SPECRING_DECODE_GRAPHS=0`` measures the eager form.

    python benchmarks/decode_cycle.py --drafter runs/recipe20 --num-prompts 24 --max-new-tokens 256
    python benchmarks/decode_cycle.py --drafter runs/latest --device cpu --num-prompts 4 --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's specring, installed or not

from specring.shared.data.demo import ensure_demo  # noqa: E402
from specring.shared.data.prompts import load_prompts  # noqa: E402
from specring.shared.drafters import checkpoint as ckpt  # noqa: E402
from specring.shared.drafters import get_family  # noqa: E402
from specring.shared.models import batched_decode as bd  # noqa: E402
from specring.shared.models.ngram import PromptLookupProposer  # noqa: E402
from specring.shared.models.speculative import target_vocab_size  # noqa: E402
from specring.shared.models.target import load_target  # noqa: E402


@contextlib.contextmanager
def _counted(cls, name: str, key: str, tally: collections.Counter, profiled: bool, sync):
    """Wrap ``cls.name`` for the scope: its calls, seconds and (``profiled``) top-level aten operators into
    ``tally[key + "_calls" | "_s" | "_ops"]``."""
    orig = getattr(cls, name)

    def wrapped(*a, **k):
        sync()
        t0 = time.perf_counter()
        if profiled:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                out = orig(*a, **k)
            tally[key + "_ops"] += sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)
        else:
            out = orig(*a, **k)
        sync()
        tally[key + "_s"] += time.perf_counter() - t0
        tally[key + "_calls"] += 1
        return out

    setattr(cls, name, wrapped)
    try:
        yield
    finally:
        setattr(cls, name, orig)


def measure(target, proposer, prompts, max_new_tokens: int, block_size: int, layer_ids, device: str) -> dict:
    """One profiled and one timed ``batched_speculative_generate`` of ``prompts``; returns operators and
    milliseconds per call of ``verify`` and ``propose``, cycles, pooled τ and the timed decode's wall seconds."""
    sync = (lambda: torch.cuda.synchronize()) if device.startswith("cuda") else (lambda: None)
    batched_cls = type(bd.batched_proposer(proposer))
    out = {}
    for profiled in (True, False):
        tally: collections.Counter = collections.Counter()
        with _counted(bd.BatchedTargetCache, "verify", "verify", tally, profiled, sync), \
                _counted(batched_cls, "propose", "propose", tally, profiled, sync), bd.decode_attention_backends():
            t0 = time.perf_counter()
            res = bd.batched_speculative_generate(target, proposer, prompts, max_new_tokens, block_size, layer_ids)
            sync()
            wall = time.perf_counter() - t0
        n = max(1, tally["verify_calls"])
        if profiled:
            out["verify_ops"] = tally["verify_ops"] / n
            out["propose_ops"] = tally["propose_ops"] / max(1, tally["propose_calls"])
        else:
            out["verify_ms"] = 1e3 * tally["verify_s"] / n
            out["propose_ms"] = 1e3 * tally["propose_s"] / max(1, tally["propose_calls"])
            out["cycles"] = tally["verify_calls"]
            out["wall_s"] = wall
            steps = sum(len(r.accept_lengths) for r in res)
            out["tau_pooled"] = sum(sum(r.accept_lengths) for r in res) / max(1, steps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", required=True, help="a run directory or checkpoint of a DFlash/DFlash2 drafter")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--data", default=None, help="prompts (default: the demo corpus' held-out file)")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--ngram-max", type=int, default=3)
    args = ap.parse_args()
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    step = ckpt.resolve_checkpoint(args.drafter)
    target, _ = load_target(ckpt.target_of_checkpoint(step), args.device, dtype)
    drafter = ckpt.load_drafter(step, device=args.device, dtype=next(target.parameters()).dtype)
    family = get_family(ckpt.drafter_kind(step))
    prompts = load_prompts(args.data or ensure_demo()[1], args.num_prompts, args.prompt_len)
    rows = {
        "drafter": (family.proposer(drafter, block_size=args.block_size, num_draft_tokens=args.block_size - 1),
                    list(drafter.config.target_layer_ids)),
        "prompt_lookup": (PromptLookupProposer(args.ngram_max, vocab_size=target_vocab_size(target)), None),
    }
    with bd.decode_attention_backends():
        bd.batched_greedy_generate(target, [[0, 1, 2, 3], [0, 1]], 4)  # warm-up: one-time costs out of the times
    got = {}
    for name, (proposer, layer_ids) in rows.items():
        got[name] = m = measure(target, proposer, prompts, args.max_new_tokens, args.block_size, layer_ids,
                                args.device)
        print(f"proposer={name} " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                             for k, v in m.items()), flush=True)
    d, p = got["drafter"], got["prompt_lookup"]
    print(f"propose_ops_vs_verify={d['propose_ops'] / d['verify_ops']:.3f}")
    cycle_ratio = (d["verify_ops"] + d["propose_ops"]) / (p["verify_ops"] + p["propose_ops"])
    print(f"break_even_tau_pooled_ratio={cycle_ratio:.3f}")
    print(f"tau_pooled_ratio={d['tau_pooled'] / p['tau_pooled']:.3f}")


if __name__ == "__main__":
    main()
