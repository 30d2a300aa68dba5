"""The design specring replaces: target and drafter trainer driven from one Python process, a thread per model
(as the seed's trainer did), against ``launch.py`` with the same topology, in one run.

The producer thread runs the plan's batches through the target on ``--producers`` (forward, capture, target
labels; ``specring.producers.producer.Producer`` writing into a ring of its own, so the per-batch work is the
same as a producer process's), copies each payload to the consumer device and hands it over a bounded queue
(``--queue`` batches, the ring's depth); the trainer thread trains on it on ``--consumers``. Both threads share
one interpreter and its GIL. Printed: ``inprocess_tokens_per_s`` (from the first optimizer step),
``pipeline_tokens_per_s`` (``launch.py train``, separate processes over shared-memory rings) and
``pipeline_vs_inprocess=pipeline/inprocess`` (goal: >= 1.3).

    python benchmarks/inprocess_baseline.py --producers cuda:0 --consumers cuda:1 --steps 200
    python benchmarks/inprocess_baseline.py --producers cpu --consumers cpu --steps 8 --max-tokens 1024
"""

from __future__ import annotations

import argparse
import queue
import sys
import tempfile
import threading
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


def inprocess(args) -> float:
    """Tokens/s of the one-process, two-thread design over ``args.steps`` batches."""
    cfg = run_config(args.target, [args.producers], [args.consumers], num_anchors=args.num_anchors,
                     num_draft_layers=args.num_draft_layers, max_steps=args.steps)
    batches = plan_batches(args.data, args.max_tokens, args.max_batch_size, args.steps)
    stage = ProducerStage(cfg, args.producers, random_weights=args.random_target_weights)
    stage.open(batches)
    q: queue.Queue = queue.Queue(maxsize=args.queue)
    failed: list[BaseException] = []

    def produce():
        try:
            for b in batches:
                _, (payload,) = stage.run([b], keep=True)
                q.put(payload.to(args.consumers, non_blocking=True))  # cu_seqlens stays on the host
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            failed.append(e)
        finally:
            q.put(None)

    try:
        return _train(args, cfg, q, produce, failed)
    finally:
        stage.close()


def _train(args, cfg, q, produce, failed) -> float:
    """The trainer thread's side (the main thread): train on what arrives until the producer is done."""
    tokens, t0 = 0, None
    with tempfile.TemporaryDirectory() as tmp:
        trainer = make_trainer(cfg, args.consumers, tmp)
        trainer.warm_up()
        th = threading.Thread(target=produce, daemon=True)
        th.start()
        i = 0
        while (batch := q.get()) is not None:
            trainer.step(batch, [i])
            if t0 is None:
                sync(args.consumers)
                t0 = time.perf_counter()  # from the first optimizer step, as the supervisor counts
            else:
                tokens += batch.num_tokens
            i += 1
        sync(args.consumers)
        th.join()
    if failed:
        raise failed[0]
    return tokens / (time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=str(DEFAULT_TARGET))
    ap.add_argument("--random-target-weights", action="store_true")
    ap.add_argument("--data", default=None)
    ap.add_argument("--producers", default="cuda:0" if torch.cuda.is_available() else "cpu", help="one device")
    ap.add_argument("--consumers", default="cuda:0" if torch.cuda.is_available() else "cpu", help="one device")
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--num-anchors", type=int, default=512)
    ap.add_argument("--num-draft-layers", type=int, default=None)
    ap.add_argument("--queue", type=int, default=4)
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args(argv)
    base = inprocess(args)
    flags = pipeline_flags(args, args.producers, args.consumers)
    pipe = float(launch(flags)["tokens_per_s"])
    print(f"target={args.target} producers={args.producers} consumers={args.consumers} steps={args.steps}")
    print(f"inprocess_tokens_per_s={base:,.0f}")
    print(f"pipeline_tokens_per_s={pipe:,.0f}")
    print(f"pipeline_vs_inprocess={pipe / base:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
