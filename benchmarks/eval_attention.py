"""``launch.py eval``'s rows with cuDNN attention allowed (the baseline, the code before 2026-12-03) against the
decode's own backends (``shared.models.batched_decode.decode_attention_backends``: every SDPA backend but cuDNN's),
one after the other on the same machine, the same checkpoint and the same prompts.

Each form is one ``launch.py eval`` in its own process (a fresh CUDA context, so neither form inherits the
other's cuDNN plans or compiled kernels): ``cudnn`` replaces ``decode_attention_backends`` with a no-op scope before
the command runs; ``decode`` runs the code as it is. Every argument after ``--`` goes to ``launch.py eval``
(default: the standard setting, ``--baselines prompt-lookup``). Printed per form and row
``form=F row=R wall_s=S tau_mean=T speedup=X``; then ``form=F rows_wall_s=S command_s=C``, and
``eval_rows_speedup=X`` (the baseline's rows' wall time over the decode form's).

    python benchmarks/eval_attention.py -- --drafter runs/recipe20 --baselines prompt-lookup
    python benchmarks/eval_attention.py --device cpu -- --drafter none --num-prompts 2 --max-new-tokens 8
"""

from __future__ import annotations

import argparse
import json
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
    args = ap.parse_args(ours)
    eval_args = eval_args or ["--baselines", "prompt-lookup"]
    if args.device:
        eval_args += ["--device", args.device]
    walls = {}
    with tempfile.TemporaryDirectory() as tmp:
        for form in ("cudnn", "decode"):
            data, seconds = run_form(form, eval_args, Path(tmp) / f"{form}.json")
            for row in data["rows"]:
                print(f"form={form} row={row['drafter']!r} wall_s={row['wall_s']:.2f} tau_mean={row['tau_mean']:.3f} "
                      f"speedup={row['speedup']:.2f}")
            walls[form] = sum(row["wall_s"] for row in data["rows"])
            print(f"form={form} rows_wall_s={walls[form]:.2f} command_s={seconds:.1f}")
    print(f"eval_rows_speedup={walls['cudnn'] / walls['decode']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
