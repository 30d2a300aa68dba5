"""The DFlash2 candidate selector's greedy walk: ``CandidateSelector.select`` (every slot scored against every
possible predecessor in one batched product, the walk on the host) against a per-slot loop (a few kernels per
slot, the first implementation), on the same inputs; asserts the same tokens and prints the ratio.

    python benchmarks/selector.py [--device cpu|cuda] [--hidden 256 --vocab 8192 --rank 256 --top-k 16 --slots 15]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specring.shared.models.dflash2 import CandidateSelector  # noqa: E402


def per_slot_walk(sel: CandidateSelector, hidden: torch.Tensor, logits: torch.Tensor, anchor: int) -> torch.Tensor:
    """The baseline: the greedy walk slot by slot, each slot's scores from ``pair_scores``."""
    n = logits.shape[0]
    unary, cand = torch.topk(logits.float(), sel.top_k, dim=-1, sorted=True)
    z = sel.project(hidden)
    path = torch.empty(n, dtype=torch.long, device=logits.device)
    pred = torch.tensor([anchor], device=logits.device)
    for i in range(n):
        sc = sel.pair_scores(z[i:i + 1], unary[i:i + 1], cand[i:i + 1], pred)[0]
        pred = cand[i, sc.argmax().view(1)]
        path[i] = pred[0]
    return path


def timed(fn, device: str, reps: int = 200) -> float:
    for _ in range(20):
        fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    del out
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rank", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--slots", type=int, default=15)
    a = ap.parse_args()
    torch.manual_seed(0)
    sel = CandidateSelector(a.hidden, a.vocab, a.rank, a.top_k).to(a.device).eval()
    with torch.no_grad():
        sel.hidden_projection.weight.normal_(0, 0.02)
        h = torch.randn(a.slots, a.hidden, device=a.device)
        lg = torch.randn(a.slots, a.vocab, device=a.device)
        assert torch.equal(per_slot_walk(sel, h, lg, 5), sel.select(h, lg, 5)[0]), "the two walks differ"
        base = timed(lambda: per_slot_walk(sel, h, lg, 5), a.device)
        new = timed(lambda: sel.select(h, lg, 5)[0], a.device)
    print(f"per_slot_walk_ms={base * 1e3:.3f} select_ms={new * 1e3:.3f} speedup={base / new:.2f} "
          f"(device {a.device}, H={a.hidden} V={a.vocab} R={a.rank} K={a.top_k} slots={a.slots})")


if __name__ == "__main__":
    main()
