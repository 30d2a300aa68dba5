"""Print a run's training curve (loss, slot accuracies, acceptance proxy) and its tau evaluations, against
wall-clock minutes since the first optimizer step; ``--best`` prints the run directory whose last tau is highest.

    python benchmarks/run_curves.py runs/regen_base
    python benchmarks/run_curves.py --best runs/a runs/b
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def curves(run: Path, rows: int = 8) -> str:
    """Lines ``NAME step=... t=...s loss=... acc1=... acc8=... proxy=...`` and ``NAME eval step=... tau=...``."""
    metrics, evals = read_jsonl(run / "metrics.jsonl"), read_jsonl(run / "eval.jsonl")
    if not metrics:
        return f"{run.name}: no metrics.jsonl"
    t0 = metrics[0]["time"]
    out = []
    for m in metrics[::max(1, len(metrics) // rows)] + metrics[-1:]:
        acc = m.get("per_slot_acc") or m.get("per_step_acc") or [float("nan")]  # EAGLE-3: per TTT step
        acc = [float("nan") if a is None else a for a in acc]
        out.append(f"{run.name} step={m['step']} t={m['time'] - t0:.0f}s loss={m['loss']:.3f} acc1={acc[0]:.3f} "
                   f"acc8={acc[min(7, len(acc) - 1)]:.3f} proxy={m['accept_proxy']:.2f}")
    for e in evals:
        if e.get("error"):  # a failed evaluation (consumer/tau.py record_failure)
            out.append(f"{run.name} eval step={e['step']} t={e['time'] - t0:.0f}s FAILED {e['error']}")
            continue
        out.append(f"{run.name} eval step={e['step']} t={e['time'] - t0:.0f}s tau={e['tau_mean']:.3f} "
                   f"prompts={e.get('prompts')} eval_s={e['eval_s']}")
    return "\n".join(out)


def best(runs: list[Path]) -> Path | None:
    """The run whose last measured tau (failed evaluations skipped) is highest (None when none has one)."""
    scored = []
    for r in runs:
        taus = [e["tau_mean"] for e in read_jsonl(r / "eval.jsonl") if e.get("tau_mean") is not None]
        if taus:
            scored.append((taus[-1], str(r)))
    return Path(max(scored)[1]) if scored else None


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--best", action="store_true")
    args = ap.parse_args()
    if args.best:
        b = best(args.runs)
        print(b if b else "")
    else:
        for r in args.runs:
            print(curves(r))
