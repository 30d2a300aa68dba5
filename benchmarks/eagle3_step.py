"""EAGLE-3 training step time: the batched training-time test against the unbatched one it replaced (issue 25).

Builds the EAGLE-3 ``Trainer`` on the fixture target (``assets/tiny-code-lm``: hidden 256, 4/2 heads of 64,
vocabulary 8192 = the draft vocabulary, 7 TTT steps) and times ``Trainer.step`` (forward, backward, optimizer)
on packed batches of ``--seqs`` sequences of ``--seq-len`` random tokens with random hidden states of the three
captured layers (``[T, 3*256]``, bf16 on CUDA), random ``target_ids`` and, with ``--topk K`` (default 32, the
EAGLE-3 default of ``--distill-topk``), random top-K target log-probabilities, as the producers send them.

Forms (``--forms``, the first reported, the others measured beside it in the same run):

* ``batched``: ``shared.drafters.eagle3_ttt.eagle3_loss`` (every sequence in one attention call per TTT step,
  the LM head and loss once over all steps, no host synchronisation);
* ``batched+compile``: the same with the layer step under ``torch.compile`` (``Trainer(compile_layers=True)``,
  the CUDA default; its compile time is printed and not timed);
* ``reference``: the implementation before issue 25 (``eagle3_ttt_reference.reference_eagle3_loss``: one
  attention call per sequence and step, one LM head and loss per step); ``reference`` is the baseline.

Timing interleaves the forms (``--rounds`` rounds of ``--steps`` steps each, the median round per form), so a
noisy machine slows every form alike. Printed per form ``form=NAME train_step_s=S`` (and ``steps_per_s``,
``tokens_per_s``, ``process_cpu_s_per_step``: this process's CPU seconds, steadier than the wall clock on a
shared CPU; the loss), then ``train_step_s=`` (first form), ``baseline_train_step_s=`` (the ``reference`` form,
else the last), ``eagle3_step_speedup=X`` (their ratio) and ``eagle3_step_speedup_process_cpu=X``.

``--check``: one forward+backward of every form on the same batch first, printing each loss and the largest
gradient difference relative to the largest gradient (float32 on CPU: ~1e-7; bf16 autocast on CUDA: ~1e-2).
``--profile N``: after timing, ``N`` steps of each form under ``torch.profiler``: the top operators by device
(else CPU) time, and per step, for the whole step and for the objective alone, the operators called at the top
of the dispatcher (``ops_per_step``), kernel launches (``kernels_per_step``, CUDA), reads of a tensor value on
the host (``aten::_local_scalar_dense``: ``.item()``, ``int()``), boolean-mask indexing (``aten::nonzero``)
and device synchronisations.

    python benchmarks/eagle3_step.py --device cpu --seqs 4 --seq-len 256 --steps 2 --rounds 3 --check
    python benchmarks/eagle3_step.py --device cuda --forms batched+compile batched reference --check --profile 3
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specring.consumer.trainer import Trainer  # noqa: E402
from specring.shared.config.run_config import DEFAULT_TARGET, TrainerConfig  # noqa: E402
from specring.shared.drafters.eagle3 import Eagle3Family  # noqa: E402
from specring.shared.drafters.eagle3_ttt_reference import reference_eagle3_loss  # noqa: E402
from specring.shared.models.eagle3 import Eagle3Config, build_draft_vocab  # noqa: E402
from specring.shared.transport.slot_batch import SlotBatch  # noqa: E402

FORMS = ("batched", "batched+compile", "reference")
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


class ReferenceEagle3Family(Eagle3Family):
    """EAGLE-3 with the unbatched TTT loss of before issue 25 (the baseline form)."""

    ttt_loss = staticmethod(reference_eagle3_loss)


def make_batch(dcfg: Eagle3Config, seqs: int, seq_len: int, topk: int, device, dtype, seed: int = 1) -> SlotBatch:
    """A packed batch of ``seqs`` sequences of ``seq_len`` random tokens: ``hidden [T, 3*Ht]`` (``dtype``),
    ``input_ids``/``target_ids [T] int32``, ``loss_mask [T] uint8`` (ones), ``cu_seqlens`` on the host and,
    with ``topk``, ``target_topk_ids [T, topk] int32`` / ``target_topk_logprobs [T, topk] float32``."""
    t = seqs * seq_len
    g = torch.Generator().manual_seed(seed)
    v = dcfg.vocab_size
    batch = SlotBatch(
        hidden=torch.randn(t, 3 * dcfg.target_hidden_size, generator=g).to(device=device, dtype=dtype),
        input_ids=torch.randint(4, v, (t,), generator=g, dtype=torch.int32).to(device),
        loss_mask=torch.ones(t, dtype=torch.uint8, device=device),
        cu_seqlens=torch.arange(0, t + 1, seq_len, dtype=torch.int32),
        target_ids=torch.randint(4, v, (t,), generator=g, dtype=torch.int32).to(device),
    )
    if topk:
        batch = dataclasses.replace(
            batch, target_topk_ids=torch.randint(4, v, (t, topk), generator=g, dtype=torch.int32).to(device),
            target_topk_logprobs=torch.log_softmax(torch.randn(t, topk, generator=g) * 3, -1).to(device))
    return batch


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def build_trainer(form: str, dcfg, vocab, device, run_dir, args) -> tuple[Trainer, float]:
    """The trainer of ``form`` and its compile/warm-up seconds (0 without compile)."""
    cfg = TrainerConfig(devices=[str(device)], drafter="eagle3", ttt_steps=dcfg.ttt_steps,
                        max_steps=args.rounds * args.steps * 2 + args.warmup + 10, warmup_steps=1)
    tr = Trainer(cfg, dcfg, DEFAULT_TARGET, device, run_dir, write_metrics=False, draft_vocab=vocab,
                 compile_layers=form.endswith("+compile"))
    if form == "reference":
        tr.family = ReferenceEagle3Family()
    warm = tr.warm_up() if tr.compiled else 0.0
    if form.endswith("+compile") and not tr.compiled:
        print(f"form={form} compile FAILED: the trainer fell back to eager layers (see the log)")
    return tr, warm


def check_forms(trainers: dict[str, Trainer], batch: dict) -> None:
    """One forward+backward of every form on the same batch: loss and gradient agreement with the first."""
    ref_name = next(iter(trainers))
    grads = {}
    for name, tr in trainers.items():
        stats = tr._forward_backward(batch, [123])
        grads[name] = torch.cat([p.grad.float().flatten() for p in tr.params if p.grad is not None])
        sums = stats.host()
        tr.optimizer.zero_grad(set_to_none=True)
        print(f"check form={name} loss={sums['loss_sum'] / sums['weight_sum']:.6f} "
              f"weight_sum={sums['weight_sum']:.3f} correct={[int(c) for c in sums['correct']]}")
    for name, g in grads.items():
        if name != ref_name:
            rel = float((g - grads[ref_name]).abs().max() / grads[ref_name].abs().max())
            print(f"check grad_max_rel_diff_{name}_vs_{ref_name}={rel:.2e}")


def _within(event, name: str) -> bool:
    while event is not None:
        if event.name == name:
            return True
        event = event.cpu_parent
    return False


def profile_steps(trainer: Trainer, batches: list[dict], steps: int, device, name: str) -> None:
    """``steps`` training steps under ``torch.profiler``: the top 25 operators, then per step the counts of the
    whole step and of the family objective alone (forward, and on CPU the backward, which runs on the calling
    thread there): operators called at the top of the dispatcher (``ops``), device kernels (CUDA), reads of a
    tensor value on the host (``aten::_local_scalar_dense``: ``.item()``, ``int()``, ``float()``), boolean-mask
    indexing (``aten::nonzero``) and device synchronisations (``cuda*Synchronize``)."""
    from torch.profiler import ProfilerActivity, profile, record_function
    cuda = torch.device(device).type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    objective = trainer.family.objective

    def traced(*a, **k):
        with record_function("eagle3_objective"):
            return objective(*a, **k)

    trainer.family = type(trainer.family)()      # a private instance: the wrapper must not reach other trainers
    trainer.family.objective = traced
    try:
        with profile(activities=acts) as prof:
            for i in range(steps):
                trainer.step(batches[i % 2], [3000 + (i % 2)])
            sync(device)
    finally:
        trainer.family = type(trainer.family)()
    events = prof.events()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(f"profile form={name} steps={steps}")
    print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))
    for scope in ("step", "objective"):
        sel = events if scope == "step" else [e for e in events if _within(e, "eagle3_objective")]
        top = sum(1 for e in sel if e.name.startswith("aten::")
                  and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))
        kernels = sum(1 for e in sel if "LaunchKernel" in e.name)        # the CUDA runtime's launch calls
        reads = sum(1 for e in sel if e.name == "aten::_local_scalar_dense")
        masks = sum(1 for e in sel if e.name == "aten::nonzero")
        syncs = sum(1 for e in sel if e.name in SYNC_EVENTS)
        print(f"profile form={name} scope={scope} ops_per_step={top / steps:.0f} "
              f"kernels_per_step={kernels / steps:.0f} host_reads_per_step={reads / steps:.1f} "
              f"bool_mask_index_per_step={masks / steps:.1f} device_syncs_per_step={syncs / steps:.1f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seqs", type=int, default=None, help="sequences per batch (default: 16 on CUDA, 4 on CPU)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: 512 on CUDA, 256 on "
                                                              "CPU; 16 x 512: the fixture recipe's batches)")
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=32000, help="capped at the target's vocabulary (8192)")
    ap.add_argument("--topk", type=int, default=32, help="target top-K soft labels (0: the greedy label only)")
    ap.add_argument("--forms", nargs="+", default=["batched", "reference"], choices=FORMS)
    ap.add_argument("--steps", type=int, default=5, help="steps per form per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the forms in turn (median round reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps of each form first")
    ap.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0: leave as is)")
    ap.add_argument("--check", action="store_true", help="compare loss and gradients of the forms first")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="profile N steps of each form after timing")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if args.threads:
        torch.set_num_threads(args.threads)
    seqs = args.seqs or (16 if cuda else 4)
    seq_len = args.seq_len or (512 if cuda else 256)
    dcfg = Eagle3Config.from_target(DEFAULT_TARGET, draft_vocab_size=args.draft_vocab, ttt_steps=args.ttt_steps)
    counts = torch.randint(0, 1000, (dcfg.vocab_size,), generator=torch.Generator().manual_seed(0))
    vocab = build_draft_vocab(counts, dcfg.draft_vocab_size)
    dtype = torch.bfloat16 if cuda else torch.float32
    batches = [make_batch(dcfg, seqs, seq_len, args.topk, device, dtype, seed=s) for s in (1, 2)]
    tokens = seqs * seq_len
    print(f"device={device} threads={torch.get_num_threads()} seqs={seqs} seq_len={seq_len} tokens={tokens} "
          f"ttt_steps={dcfg.ttt_steps} draft_vocab={dcfg.draft_vocab_size} topk={args.topk} "
          f"hidden={dcfg.hidden_size} heads={dcfg.num_attention_heads}/{dcfg.num_key_value_heads} "
          f"autocast={'bf16' if cuda else 'off'}")
    tmp = tempfile.TemporaryDirectory()
    trainers = {}
    for form in args.forms:
        trainers[form], warm = build_trainer(form, dcfg, vocab, device, tmp.name, args)
        if warm:
            print(f"form={form} compile_warm_up_s={warm:.1f}")
    if args.check:
        check_forms(trainers, batches[0])
    rounds: dict[str, list[float]] = {f: [] for f in args.forms}
    cpu_rounds: dict[str, list[float]] = {f: [] for f in args.forms}
    loss = {}
    for form, tr in trainers.items():
        for i in range(args.warmup):
            tr.step(batches[i % 2], [i])
    sync(device)
    for r in range(args.rounds):
        for form, tr in trainers.items():
            sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            for i in range(args.steps):
                m = tr.step(batches[i % 2], [1000 + i % 2])
            sync(device)
            rounds[form].append((time.perf_counter() - t0) / args.steps)
            cpu_rounds[form].append((time.process_time() - c0) / args.steps)
            loss[form] = m["loss"]
    step_s = {f: statistics.median(v) for f, v in rounds.items()}
    cpu_s = {f: statistics.median(v) for f, v in cpu_rounds.items()}
    for form in args.forms:
        s = step_s[form]
        print(f"form={form} train_step_s={s:.4f} steps_per_s={1 / s:.2f} tokens_per_s={tokens / s:,.0f} "
              f"process_cpu_s_per_step={cpu_s[form]:.4f} loss={loss[form]:.4f} "
              f"rounds_s={[round(x, 4) for x in rounds[form]]}")
    if args.profile:
        for form, tr in trainers.items():
            profile_steps(tr, batches, args.profile, device, form)
    first = args.forms[0]
    base = "reference" if "reference" in args.forms else args.forms[-1]
    print(f"train_step_s={step_s[first]:.4f} form={first}")
    if base != first:
        print(f"baseline_train_step_s={step_s[base]:.4f} form={base}")
        print(f"eagle3_step_speedup={step_s[base] / step_s[first]:.2f}")
        # CPU seconds of this process: steadier than the wall clock on a machine shared with other jobs
        print(f"eagle3_step_speedup_process_cpu={cpu_s[base] / cpu_s[first]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
