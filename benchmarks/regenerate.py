"""Regeneration speed: ``launch.py regenerate``'s transformers backend with a static cache (CUDA graphs) against the
growing dynamic cache it used before, beside the target's plain forward rate (issue 23, item 1).

Prompts are ``--prefix-len``-token windows, one every ``--prefix-len`` tokens, of the interpreter's standard
library sources tokenized by the target's tokenizer (the kind of prompt the recipe of docs/evaluation.md
regenerates); every form continues the same ``--num-prompts`` prompts by ``--max-new-tokens`` tokens at
``--temperature`` through ``shared.data.regenerate.TransformersBackend.generate``, the code ``regenerate`` runs.

Forms (``--forms``, each ``CACHE[:BATCH]`` with ``CACHE`` ``dynamic`` or ``static`` and ``BATCH`` the batch size,
default ``--batch-size``; the first form is the baseline): each is warmed up first, not timed (``static`` on its
first batch: compile and graph capture; ``dynamic`` on 8 prompts; the seconds printed as ``warmup_s``), then timed
over all prompts. Printed per form ``form=NAME generated_tokens_per_s=X seconds=S tokens=N warmup_s=W``; then
``target_forward_tokens_per_s`` (one forward of ``--batch-size`` sequences of ``prefix-len + max-new-tokens``
tokens, the rate the target reads tokens at, median of 5: the ceiling of teacher-forced capture),
``regen_tokens_per_s`` (the fastest form), ``baseline_regen_tokens_per_s`` (the first form), ``regen_speedup=X``
(their ratio) and ``regen_vs_forward=X``.

    python benchmarks/regenerate.py --device cpu --num-prompts 8 --batch-size 4 --max-new-tokens 16 --prefix-len 64
    python benchmarks/regenerate.py --device cuda --num-prompts 2048 --forms dynamic:1024 static:1024 static:2048
"""

from __future__ import annotations

import argparse
import statistics
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specring.shared.data.regenerate import TransformersBackend, stop_and_pad_ids  # noqa: E402

TARGET = ROOT / "assets" / "tiny-code-lm"


def stdlib_windows(target: str, n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens: consecutive windows of the standard library's ``*.py`` files (sorted by
    path) tokenized by ``target``'s tokenizer. Raises ``SystemExit`` when the library is too small."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(target)
    out: list[list[int]] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        ids = tok(path.read_text(encoding="utf-8", errors="replace"))["input_ids"]
        out += [ids[s:s + length] for s in range(0, len(ids) - length + 1, length)]
        if len(out) >= n:
            return out[:n]
    raise SystemExit(f"only {len(out)} prompts of {length} tokens in the standard library, asked for {n}")


def forward_rate(model, batch: int, seq: int, vocab: int, device, torch) -> float:
    """Tokens/s of one plain forward of ``[batch, seq]`` random tokens (median of 5, after one warm-up)."""
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    times = []
    with torch.inference_mode():
        for i in range(6):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
    return batch * seq / statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=str(TARGET))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=2048)
    ap.add_argument("--prefix-len", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--forms", nargs="+", default=["dynamic", "static"])
    a = ap.parse_args(argv)
    import torch
    prompts = stdlib_windows(a.target, a.num_prompts, a.prefix_len)
    stop_ids, pad_id = stop_and_pad_ids(a.target)
    rates: dict[str, float] = {}
    backend = None
    for form in a.forms:
        cache, _, b = form.partition(":")
        batch = int(b) if b else a.batch_size
        if backend is None:
            backend = TransformersBackend(a.target, a.device, a.dtype, batch, cache=cache)
        backend.cache, backend.batch_size = cache, batch  # one loaded model serves every form
        t0 = time.perf_counter()  # static: the timed batches' shapes compiled; dynamic: CUDA and kernels loaded
        warm = prompts[:batch] if cache == "static" else prompts[:8]
        backend.generate(warm, a.max_new_tokens, a.temperature, stop_ids, pad_id, seed=0)
        warm = time.perf_counter() - t0
        if backend.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        gens = backend.generate(prompts, a.max_new_tokens, a.temperature, stop_ids, pad_id, seed=1)
        if backend.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        n = sum(len(g) for g in gens)
        rates[form] = n / dt
        print(f"form={form} generated_tokens_per_s={rates[form]:.0f} seconds={dt:.2f} tokens={n} "
              f"warmup_s={warm:.1f}", flush=True)
    fwd = forward_rate(backend.model, a.batch_size, a.prefix_len + a.max_new_tokens,
                       backend.model.config.vocab_size, backend.device, torch)
    best = max(rates.values())
    base = rates[a.forms[0]]
    print(f"target_forward_tokens_per_s={fwd:.0f}")
    print(f"regen_tokens_per_s={best:.0f}")
    print(f"baseline_regen_tokens_per_s={base:.0f}")
    print(f"regen_speedup={best / base:.2f}")
    print(f"regen_vs_forward={best / fwd:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
