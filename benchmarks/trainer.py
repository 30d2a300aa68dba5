"""Drafter training throughput: draft positions per second and model FLOPs utilisation of ``Trainer.step``.

Each form of the trainer (``--attention``, default ``flex dense``; ``+compile`` and ``+fused`` options, see the
flag's help) trains on the same packed
batches in the same run; the first form listed is the one reported, the others are the baselines measured
beside it (``dense`` is the form CUDA used before flex attention: groups of sequences, a dense ``[Q, C+Q]``
mask into SDPA). Printed per form: ``positions_per_s`` (draft positions ``A * B`` trained per second),
``tokens_per_s`` (target tokens), ``tflops`` and ``mfu``, and ``positions_per_s_vs_<baseline>=X``.

Shapes: ``--shape tiny`` (the fixture target: 8.4 M parameters, hidden 256, vocab 8192) or ``--shape qwen3-8b``
(a Qwen3-8B-shaped drafter: hidden 4096, MLP 12288, 32/8 heads of 128, vocab 151,936; the embedding and LM
head are random and written to a temporary checkpoint directory, since the trainer reads them from the
target's safetensors). A batch packs ``--seqs`` sequences of ``--seq-len`` tokens with random hidden states
of the captured layers (``[T, n*H]``, bf16 on GPU) and random tokens; every position may be an anchor.

Model FLOPs of one step (what ``mfu`` counts; ``P = A*B`` draft positions, ``R = A*(B-1)`` rows through the
LM head, ``T`` context tokens, ``L`` draft layers, ``H`` hidden, ``I`` MLP width, ``Dq = heads*head_dim``,
``Dkv = kv_heads*head_dim``, ``n`` captured layers, ``V`` vocabulary, ``K`` = mean attended keys per
position = mean(anchor - sequence start) + ``B``)::

    per draft layer, forward:  2*P*H*(2*Dq + 2*Dkv + 3*I)      q, k, v, o projections and the SwiGLU MLP
                               + 2*T*H*2*Dkv                    k, v of the context tokens
                               + 4*P*K*Dq                       scores and weighted values (attended keys only)
    fc, forward:               2*T*(n*H)*H
    LM head, forward:          2*R*H*V
    step = 3 * L * layer + 2 * fc + 2 * LM head

Backward costs twice the forward for the trainable layers (gradients of inputs and weights), once for
``fc`` (its input, the target's hidden states, needs no gradient) and once for the frozen LM head (input
gradient only). ``mfu`` = step FLOPs / step time / ``--peak-tflops`` (default 989.4, the dense bf16 peak of
an H100/H200 SXM from NVIDIA's datasheet). The optimizer and norms are not counted.

``--check`` (CUDA): before timing, one forward+backward of each form on the same batch and anchors; prints
the loss and the largest relative gradient difference against the first form (bf16 autocast: expect ~1e-2).

    python benchmarks/trainer.py --device cuda --shape tiny --seqs 8 --seq-len 1024 --num-anchors 512
    python benchmarks/trainer.py --device cuda --shape qwen3-8b --seq-len 2048 --num-anchors 512
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.random_target import QWEN3_8B, write_random_target  # noqa: E402
from specring.consumer.trainer import Trainer  # noqa: E402
from specring.shared.config.run_config import DEFAULT_TARGET, TrainerConfig  # noqa: E402
from specring.shared.drafters.dflash import anchor_seed  # noqa: E402
from specring.shared.drafters.dflash_blocks import sample_anchors  # noqa: E402
from specring.shared.models.dflash import DFlashConfig  # noqa: E402
from specring.shared.transport.slot_batch import SlotBatch  # noqa: E402

H200_BF16_DENSE_TFLOPS = 989.4
REPO_ROOT = str(Path(__file__).resolve().parent.parent)  # sync_sites names the frames under it (any checkout path)

# the fastest flex attention configurations of inductor's autotune for the Qwen3-8B shape on the H200
# (2026-12-03, docs/performance.md): forward 128 x 64 tiles with 8 warps, backward 32/64/64/32 with 4 warps
TUNED_FLEX = {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_stages": 3, "fwd_num_warps": 8,
              "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
              "bwd_num_stages": 3, "bwd_num_warps": 4}


def make_batch(dcfg: DFlashConfig, seqs: int, seq_len: int, device, dtype, seed: int = 1) -> SlotBatch:
    """A packed batch of ``seqs`` sequences of ``seq_len`` random tokens with random hidden states (and random
    ``target_ids``, the labels of the default ``label_source=target``)."""
    t = seqs * seq_len
    n, h = dcfg.num_target_layers, dcfg.hidden_size
    g = torch.Generator().manual_seed(seed)
    return SlotBatch(
        hidden=torch.randn(t, n * h, generator=g).to(device=device, dtype=dtype),
        input_ids=torch.randint(4, dcfg.vocab_size, (t,), generator=g, dtype=torch.int32).to(device),
        loss_mask=torch.ones(t, dtype=torch.uint8, device=device),
        cu_seqlens=torch.arange(0, t + 1, seq_len, dtype=torch.int32),
        target_ids=torch.randint(4, dcfg.vocab_size, (t,), generator=g, dtype=torch.int32).to(device),
    )


def step_flops(dcfg: DFlashConfig, batch: SlotBatch, num_anchors: int, seed: int,
               batch_ids: list[int]) -> tuple[float, int]:
    """Model FLOPs of one step on ``batch`` (module docstring) and its draft positions ``A*B``."""
    b = dcfg.block_size
    gen = torch.Generator().manual_seed(anchor_seed(seed, batch_ids))
    lm, cu = batch.loss_mask.cpu(), batch.cu_seqlens.cpu().long()
    anchors = sample_anchors(lm, cu, num_anchors, b, gen)
    starts = cu[torch.searchsorted(cu[1:], anchors, right=True)]
    a = anchors.numel()
    p, r, t = a * b, a * (b - 1), int(cu[-1])
    keys = float((anchors - starts).float().mean()) + b if a else 0.0
    h, i, v = dcfg.hidden_size, dcfg.intermediate_size, dcfg.vocab_size
    dq, dkv = dcfg.num_attention_heads * dcfg.head_dim, dcfg.num_key_value_heads * dcfg.head_dim
    layer = 2 * p * h * (2 * dq + 2 * dkv + 3 * i) + 2 * t * h * 2 * dkv + 4 * p * keys * dq
    fc = 2 * t * dcfg.num_target_layers * h * h
    head = 2 * r * h * v
    return 3 * dcfg.num_hidden_layers * layer + 2 * fc + 2 * head, p


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def build_trainer(form: str, dcfg, target, device, run_dir, args) -> Trainer:
    """The trainer of ``form``: an attention form, then ``+compile`` (decoder layers under torch.compile) and/or
    ``+fused`` (``--trainer.fused-ce liger``; without it the chunked float32 loss, ``off``)."""
    attention, *extras = form.split("+")
    unknown = set(extras) - {"compile", "fused", "autotune", "tuned"}
    if unknown:
        raise SystemExit(f"--attention {form}: unknown option(s) {sorted(unknown)} (compile, fused, autotune, tuned)")
    if "autotune" in extras and "compile" not in extras:
        raise SystemExit(f"--attention {form}: autotune needs compile")
    cfg = TrainerConfig(devices=[str(device)], block_size=args.block_size, num_anchors=args.num_anchors,
                        max_steps=args.steps + args.warmup + 5, warmup_steps=1,
                        fused_ce="liger" if "fused" in extras else "off")
    trainer = Trainer(cfg, dcfg, target, device, run_dir, write_metrics=False, attention=attention,
                      compile_layers="compile" in extras)
    if "autotune" in extras:  # inductor tries its flex attention kernel configurations (matmuls stay cuBLAS)
        for layer in trainer.family.compiled_modules(trainer.model):
            layer.compile(dynamic=True, options={"max_autotune": True, "max_autotune_gemm_backends": "ATEN"})
    return trainer


def use_form_kernels(form: str) -> None:
    """The flex kernel configuration of ``form``: ``TUNED_FLEX`` for a ``+tuned`` form, else inductor's defaults."""
    from specring.shared.models import draft_attention
    draft_attention.FLEX_KERNEL_OPTIONS = dict(TUNED_FLEX) if "tuned" in form.split("+") else None


def check_forms(trainers: dict[str, Trainer], batch: dict) -> None:
    """One forward+backward of every form on the same batch and anchors: loss and gradient agreement."""
    ref_name = next(iter(trainers))
    grads = {}
    for name, tr in trainers.items():
        use_form_kernels(name)
        stats = tr._forward_backward(batch, [123])
        grads[name] = torch.cat([p.grad.float().flatten() for p in tr.params if p.grad is not None])
        sums = stats.host()
        loss = sums["loss_sum"] / sums["weight_sum"]
        tr.optimizer.zero_grad(set_to_none=True)
        print(f"check form={name} loss={loss:.5f}")
    for name, g in grads.items():
        if name != ref_name:
            rel = float((g - grads[ref_name]).abs().max() / grads[ref_name].abs().max())
            print(f"check grad_max_rel_diff_{name}_vs_{ref_name}={rel:.2e}")


def profile_steps(trainer: Trainer, batches: list[dict], steps: int, device, name: str, trace: str = "") -> None:
    """``steps`` training steps under ``torch.profiler``; prints the operators that take the most device time and
    those that take the most host time; with ``trace``, writes the Chrome trace (``{trace}.{form}.json.gz``)."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == "cuda" else [])
    with profile(activities=acts) as prof:
        for i in range(steps):
            trainer.step(batches[i % 2], [2000 + (i % 2)])
        sync(device)
    print(f"profile form={name} steps={steps}")
    keys = (["self_cuda_time_total"] if torch.device(device).type == "cuda" else []) + ["self_cpu_time_total"]
    for key in keys:
        print(f"sorted by {key}")
        print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))
    if trace:
        import gzip
        import os
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            raw = os.path.join(d, "trace.json")
            prof.export_chrome_trace(raw)
            out = f"{trace}.{name.replace('+', '_')}.json.gz"
            with open(raw, "rb") as src, gzip.open(out, "wb") as dst:
                dst.write(src.read())
        print(f"trace form={name} written {out}")


def sync_sites(trainer: Trainer, batches: list[dict], device) -> None:
    """One training step under ``torch.cuda.set_sync_debug_mode("warn")``: prints every distinct place in the
    step that makes the host wait for the device (the Python stack of each synchronising call, innermost
    specring frames), with its count; a step with none prints ``sync_sites=0``."""
    import traceback
    import warnings
    if torch.device(device).type != "cuda":
        print("sync_sites skipped: not a CUDA device")
        return
    sites: dict[str, int] = {}
    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return shown(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(REPO_ROOT)]  # the project's own
        key = " <- ".join(f"{Path(f.filename).relative_to(REPO_ROOT)}:{f.lineno}" for f in reversed(frames[-4:]))
        sites[key] = sites.get(key, 0) + 1

    sync(device)
    warnings.showwarning = record
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                trainer.step(batches[0], [3000])
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        warnings.showwarning = shown
    print(f"sync_sites={len(sites)} syncs={sum(sites.values())}")
    for key, n in sorted(sites.items(), key=lambda kv: -kv[1]):
        print(f"  sync x{n}: {key}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", choices=["tiny", "qwen3-8b"], default="tiny")
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--num-anchors", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-layers", type=int, default=5, help="captured target layers = drafter layers")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--attention", nargs="+", default=["flex", "dense"],
                    help="forms to measure, the first reported, the others as baselines (flex, dense, structured; "
                         "+compile: the decoder layers under torch.compile; +fused: Liger Kernel's fused linear + "
                         "cross-entropy over the head; +autotune (with +compile): inductor's max-autotune of the "
                         "flex attention kernels, matmuls left to cuBLAS; +tuned: the flex kernel configuration "
                         "that autotune chose on the H200 (TUNED_FLEX); e.g. flex+compile+fused)")
    ap.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS)
    ap.add_argument("--check", action="store_true", help="compare loss and gradients of the forms first")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after timing, profile N steps of each form with torch.profiler and print the top 25 "
                         "operators by device (else CPU) time")
    ap.add_argument("--trace", default="", metavar="PREFIX",
                    help="with --profile: also write each form's Chrome trace to PREFIX.FORM.json.gz")
    ap.add_argument("--sync-debug", action="store_true",
                    help="after timing, one step with torch.cuda.set_sync_debug_mode: where the step waits for the GPU")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    tmp = tempfile.TemporaryDirectory()
    if args.shape == "tiny":
        target, layers = DEFAULT_TARGET, 8
    else:
        target, layers = write_random_target(Path(tmp.name) / "qwen3-8b"), QWEN3_8B["num_hidden_layers"]
    from specring.shared.models.layer_ids import default_target_layer_ids
    ids = default_target_layer_ids(layers, args.num_layers)
    dcfg = DFlashConfig.from_target(target, ids, args.block_size, mask_token_id=None)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batches = [make_batch(dcfg, args.seqs, args.seq_len, device, dtype, seed=s) for s in (1, 2)]
    tokens = args.seqs * args.seq_len
    flops, positions = step_flops(dcfg, batches[0], args.num_anchors, 0, [1000])
    print(f"shape={args.shape} device={device} layers_captured={ids} draft_layers={dcfg.num_hidden_layers} "
          f"block_size={args.block_size} anchors={args.num_anchors} seqs={args.seqs} seq_len={args.seq_len} "
          f"positions_per_step={positions} step_tflop={flops / 1e12:.3f}")
    forms = {}
    for form in args.attention:
        forms[form] = build_trainer(form, dcfg, target, device, tmp.name, args)
    if args.check:
        check_forms(forms, batches[0])
    rate = {}
    for name, trainer in forms.items():
        use_form_kernels(name)
        try:
            for i in range(args.warmup):
                trainer.step(batches[i % 2], [i])
            sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            for i in range(args.steps):
                r = trainer.step(batches[i % 2], [1000 + (i % 2)])
            sync(device)
        except Exception as e:  # one form failing (e.g. a compile error) must not hide the others
            print(f"form={name} FAILED {type(e).__name__}: {str(e)[:400]}")
            continue
        step_s = (time.perf_counter() - t0) / args.steps
        if args.profile:
            profile_steps(trainer, batches, args.profile, device, name, args.trace)
        if args.sync_debug:
            sync_sites(trainer, batches, device)
        mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
        rate[name] = positions / step_s
        print(f"form={name} train_step_s={step_s:.4f} loss={r['loss']:.3f} peak_gpu_mem_gib={mem:.1f} "
              f"positions_per_s={positions / step_s:,.0f} tokens_per_s={tokens / step_s:,.0f} "
              f"tflops={flops / step_s / 1e12:.1f} mfu={flops / step_s / 1e12 / args.peak_tflops:.3f}")
        del trainer
        forms[name] = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    first = args.attention[0]
    for name in args.attention[1:]:
        if first in rate and name in rate:
            print(f"positions_per_s_vs_{name}={rate[first] / rate[name]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
