"""The pipeline against its limits: each stage alone, then the whole through ``launch.py``, in one run.

For a target (``--target``; the fixture by default, or a Qwen3-8B-shaped random one from
``benchmarks/random_target.py`` with ``--random-target-weights``) and the topology ``--producers``/``--consumers``:

1. **producer alone** (``producer_tokens_per_s``): the target on the first producer device runs the plan's first
   ``--batches`` batches exactly as a producer process does (forward, capture, target labels, slot write and
   publish, one batch in flight);
2. **consumer alone** (``consumer_tokens_per_s``): the drafter trainer on the first consumer device trains on the
   payloads of stage 1, already on the device (on CPU, each stage with the threads a process of its role gets,
   ``shared.machine.threads``: the producer 1, the consumer all of its cores);
3. **pipeline** (``pipeline_tokens_per_s``): ``launch.py train`` with that topology for ``--steps`` steps (its
   ``summary.json`` tokens/s, measured from the first optimizer step).

``bound`` = ``min(P * producer, C * consumer)`` when producers and consumers have GPUs of their own, and
``1 / (1/producer + 1/consumer)`` when one GPU holds them all (the stages then take turns; CPU processes run on
cores of their own, so a CPU topology uses the first form); printed:
``pipeline_efficiency=pipeline/bound`` (goal: >= 0.95 on own GPUs, >= 0.9 on one shared GPU), and the
pipeline run's producer duty cycle and consumer starvation (``summary.json`` ``balance``).

    python benchmarks/pipeline.py --producers cuda:0 --consumers cuda:1 --batches 40 --steps 200
    python benchmarks/pipeline.py --producers cpu --consumers cpu --batches 4 --steps 8 --max-tokens 1024
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.harness import (  # noqa: E402,I001
    DEFAULT_TARGET,
    ProducerStage,
    launch,
    make_trainer,
    pipeline_flags,
    plan_batches,
    run_config,
    sync,
)
from specring.shared.machine.threads import plan_threads  # noqa: E402


def stage_rates(args) -> tuple[float, float, int]:
    """``(producer tokens/s, consumer tokens/s, tokens)`` of stages 1 and 2."""
    cfg = run_config(args.target, args.producers, args.consumers, num_anchors=args.num_anchors,
                     num_draft_layers=args.num_draft_layers)
    batches = plan_batches(args.data, args.max_tokens, args.max_batch_size, args.batches)
    tokens = sum(int(b["lengths"].sum()) for b in batches)
    # the threads a process of that role gets (shared.machine.threads)
    def role_threads(role: str, device: str) -> None:
        kind = torch.device(device).type
        if kind == "cpu":
            torch.set_num_threads(plan_threads(role, kind, args.producers, args.consumers).intra)

    role_threads("producer", args.producers[0])
    stage = ProducerStage(cfg, args.producers[0], random_weights=args.random_target_weights)
    stage.open(batches)
    try:
        stage.run(batches[:2])                                        # warm-up
        prod_s, payloads = stage.run(batches, keep=True)
    finally:
        stage.close()
    dev = args.consumers[0]
    role_threads("consumer", dev)  # alone on the machine, the consumer's tuner keeps all of its cores
    on_dev = [p.to(dev) for p in payloads]  # cu_seqlens stays on the host
    with tempfile.TemporaryDirectory() as tmp:
        trainer = make_trainer(cfg, dev, tmp)
        trainer.warm_up()
        for i, b in enumerate(on_dev[:2]):
            trainer.step(b, [10**6 + i])
        sync(dev)
        t0 = time.perf_counter()
        for i, b in enumerate(on_dev):
            trainer.step(b, [i], checked=True)
        sync(dev)
        cons_s = time.perf_counter() - t0
    return tokens / prod_s, tokens / cons_s, tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=str(DEFAULT_TARGET))
    ap.add_argument("--random-target-weights", action="store_true")
    ap.add_argument("--data", default=None, help="Arrow file (default: the demo corpus)")
    ap.add_argument("--producers", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--consumers", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--num-anchors", type=int, default=512)
    ap.add_argument("--num-draft-layers", type=int, default=None)
    ap.add_argument("--batches", type=int, default=20, help="batches timed in stages 1 and 2")
    ap.add_argument("--steps", type=int, default=100, help="optimizer steps of the launch.py run")
    args = ap.parse_args(argv)
    args.producers, args.consumers = args.producers.split(","), args.consumers.split(",")
    prod, cons, tokens = stage_rates(args)
    flags = pipeline_flags(args, ",".join(args.producers), ",".join(args.consumers))
    summary = launch(flags)
    pipe = float(summary["tokens_per_s"])
    devices = set(args.producers) | set(args.consumers)
    shared = len(devices) == 1 and next(iter(devices)).startswith("cuda")  # CPU processes run on their own cores
    p, c = len(args.producers), len(args.consumers)
    bound = 1.0 / (1.0 / prod + 1.0 / cons) if shared else min(p * prod, c * cons)
    print(f"target={args.target} producers={args.producers} consumers={args.consumers} timed_tokens={tokens}")
    print(f"producer_tokens_per_s={prod:,.0f}")
    print(f"consumer_tokens_per_s={cons:,.0f}")
    print(f"pipeline_tokens_per_s={pipe:,.0f} (launch.py, {summary.get('trained_batches')} batches)")
    print(f"bound_tokens_per_s={bound:,.0f} ({'harmonic: one shared device' if shared else 'min of the sides'})")
    print(f"balance_producers_per_consumer={cons / prod:.2f} (producers that one consumer keeps busy)")
    bal = summary.get("balance") or {}
    print(f"pipeline_producer_duty_cycle={bal.get('producer_duty_cycle')} "
          f"pipeline_consumer_starvation={bal.get('consumer_starvation')} "
          f"pipeline_producer_tokens_per_busy_s={bal.get('producer_tokens_per_busy_s')} "
          f"pipeline_consumer_tokens_per_busy_s={bal.get('consumer_tokens_per_busy_s')} (launch.py run's summary.json)")
    print(f"pipeline_efficiency={pipe / bound:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
