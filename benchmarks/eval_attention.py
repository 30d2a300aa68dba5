"""``launch.py eval``'s rows with cuDNN attention allowed (the baseline, the code before 2026-12-03) against the
decode's own setting (``shared.models.batched_decode.decode_attention_backends``: cuDNN's SDPA backend off),
one after the other on the same machine, the same checkpoint and the same prompts.

Each form is one ``launch.py eval`` in its own process (a fresh CUDA context, so neither form inherits the
other's cuDNN plans or compiled kernels): ``cudnn`` replaces ``decode_attention_backends`` with a no-op scope before
the command runs; ``decode`` runs the code as it is. The forms alternate, ``--repeats`` rounds of ``cudnn decode`` then
``decode cudnn`` (so neither always runs first, on a cold disk cache or a cold GPU clock). Every argument
after ``--`` goes to ``launch.py eval`` (default: the standard setting, ``--baselines prompt-lookup``).
Printed per run and row ``form=F run=I row=R wall_s=S tau_mean=T speedup=X`` (``speedup=-`` where the eval
has none: ``--no-lossless-check``); per run ``form=F run=I rows_wall_s=S command_s=C``; per form
``form=F median_rows_wall_s=S``; then ``eval_rows_speedup=X``, the baseline's median rows' wall time over the
decode form's.

    python benchmarks/eval_attention.py --repeats 2 -- --drafter runs/recipe20 --baselines prompt-lookup
    python benchmarks/eval_attention.py --device cpu -- --drafter none --num-prompts 2 --max-new-tokens 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_RUN = """
import contextlib, runpy, sys
if sys.argv[1] == "cudnn":
    import specring.shared.commands.evaluation as ev
    import specring.shared.models.batched_decode as bd
    bd.decode_attention_backends = ev.decode_attention_backends = contextlib.nullcontext
sys.argv = ["launch.py", "eval", *sys.argv[2:]]
runpy.run_path("launch.py", run_name="__main__")
"""


def run_form(form: str, eval_args: list[str], out: Path) -> tuple[dict, float]:
    """One ``launch.py eval`` of ``form`` (``cudnn`` or ``decode``) writing ``out``; returns (its JSON, seconds of
    the whole command). Raises ``RuntimeError`` naming the form and the command's last output on a failure."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _RUN, form, *eval_args, "--output-json", str(out)], cwd=ROOT,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"form {form}: launch.py eval exited {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(out.read_text()), seconds


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, eval_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="passed to launch.py eval as --device (default: its own)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds of the pair: odd rounds cudnn first, even rounds decode first (default 1)")
    args = ap.parse_args(ours)
    if args.repeats < 1:
        ap.error(f"--repeats: must be >= 1, got {args.repeats}")
    eval_args = eval_args or ["--baselines", "prompt-lookup"]
    if args.device:
        eval_args += ["--device", args.device]
    walls: dict[str, list[float]] = {"cudnn": [], "decode": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for form in ("cudnn", "decode") if i % 2 == 0 else ("decode", "cudnn"):
                data, seconds = run_form(form, eval_args, Path(tmp) / f"{form}-{i}.json")
                for row in data["rows"]:
                    speedup = row.get("speedup")
                    print(f"form={form} run={i} row={row['drafter']!r} wall_s={row['wall_s']:.2f} "
                          f"tau_mean={row['tau_mean']:.3f} speedup={'-' if speedup is None else f'{speedup:.2f}'}")
                walls[form].append(sum(row["wall_s"] for row in data["rows"]))
                print(f"form={form} run={i} rows_wall_s={walls[form][-1]:.2f} command_s={seconds:.1f}")
    med = {form: statistics.median(w) for form, w in walls.items()}
    for form, m in med.items():
        print(f"form={form} median_rows_wall_s={m:.2f}")
    print(f"eval_rows_speedup={med['cudnn'] / med['decode']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
