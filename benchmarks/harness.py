"""What the pipeline benchmarks share: the plan's first batches, a producer over a ring of its own, a trainer,
and a ``launch.py train`` run read back from its ``summary.json``.

Used by ``benchmarks/pipeline.py`` (each stage alone against the pipeline) and ``benchmarks/inprocess_baseline.py``
(the one-process design specring replaces).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from specring.consumer.trainer import CPU_MAX_MASK_ELEMS, Trainer, drafter_config_from_run  # noqa: E402
from specring.producers.producer import Producer  # noqa: E402
from specring.shared.config.run_config import DataConfig, ProducerConfig, RunConfig, TrainerConfig  # noqa: E402
from specring.shared.data.dataset import BatchPlan, TokenDataset, collate  # noqa: E402
from specring.shared.data.demo import ensure_demo  # noqa: E402
from specring.shared.models.layer_ids import resolve_layer_ids  # noqa: E402
from specring.shared.models.target import load_target  # noqa: E402
from specring.shared.paths import DEFAULT_TARGET  # noqa: E402
from specring.shared.transport import layout, ring  # noqa: E402
from specring.shared.transport.slot_batch import SlotBatch  # noqa: E402


def plan_batches(data: str | None, max_tokens: int, max_batch_size: int, count: int, pad_id: int = 0) -> list[dict]:
    """The first ``count`` batches of epoch 0 of the run's plan over ``data`` (default: the demo corpus), collated
    as a producer receives them (``input_ids``, ``attention_mask``, ``loss_mask``, ``lengths``, ``batch_id``)."""
    path = data or str(ensure_demo()[0])
    ds = TokenDataset(path)
    plan = BatchPlan(ds.lengths, max_tokens=max_tokens, max_batch_size=max_batch_size, seed=0,
                     fingerprint=ds.fingerprint)
    out = []
    for b in plan.epoch(0)[:count]:
        ids, am, lm, lengths = collate(ds, b.sample_ids, b.pad_to, pad_id)
        out.append({"input_ids": ids, "attention_mask": am, "loss_mask": lm, "lengths": lengths,
                    "batch_id": b.batch_id})
    return out


def run_config(target: str, producers: list[str], consumers: list[str], **trainer) -> RunConfig:
    """A ``RunConfig`` for the benchmark's topology (the trainer fields given, the rest defaults). When every
    device is CPU, a trainer field not given (or given as None) takes its declared CPU default, as
    ``launch.py train`` does (e.g. 2 draft layers): the stages alone then train the drafter the run trains."""
    trainer = {k: v for k, v in trainer.items() if v is not None}
    if all(torch.device(d).type == "cpu" for d in [*producers, *consumers]):
        for f in dataclasses.fields(TrainerConfig):
            if "cpu_default" in f.metadata and f.name not in trainer and f.name != "max_steps":
                trainer[f.name] = f.metadata["cpu_default"]
    return RunConfig(producer=ProducerConfig(target=target, devices=producers),
                     trainer=TrainerConfig(devices=consumers, **trainer), data=DataConfig())


class ProducerStage:
    """The target on ``device`` and a ring of its own: ``run(batches)`` -> the payloads (forward, capture, slot
    write and publish, as ``producers/main.py`` does with one batch in flight) and the seconds it took."""

    def __init__(self, cfg: RunConfig, device: str, random_weights: bool = False):
        self.model, hf = load_target(cfg.producer.target, device, cfg.producer.dtype, random_weights=random_weights,
                                   trust_remote_code=cfg.producer.trust_remote_code)
        self.device = torch.device(device)
        layers = resolve_layer_ids(hf.num_hidden_layers, cfg.producer.target_layer_ids, cfg.producer.num_target_layers)
        self.layer_ids = layers
        self.cfg = cfg

    def open(self, batches: list[dict]) -> None:
        """Create the stage's ring (two slots, sized for the largest of ``batches``) and its producer."""
        t = self.cfg.trainer
        probe = Producer(self.model, self.layer_ids, ring=None, generation=1, device=self.device,
                         label_source=t.label_source, topk=t.resolved_distill_topk())
        need = max(probe.payload_bytes(int(b["lengths"].sum()), len(b["lengths"])) for b in batches)
        self.ring = ring.Ring.create(ring.segment_name(ring.new_run_id(), "bench"), num_slots=2, slot_bytes=need)
        if self.device.type == "cuda":
            self.ring.pin()
        self.producer = Producer(self.model, self.layer_ids, self.ring, 1, self.device, label_source=t.label_source,
                                 topk=t.resolved_distill_topk())
        self.seq = 0

    def run(self, batches: list[dict], keep: bool = False) -> tuple[float, list[SlotBatch]]:
        """Seconds to produce ``batches`` (and their payloads, copied out of the ring, with ``keep``)."""
        prod, r = self.producer, self.ring
        kept = []
        sync(self.device)
        t0 = _now()
        pending = None
        for b in batches:
            nxt = prod.submit(b, slot=self.seq % 2, seq=self.seq)
            self.seq += 1
            if pending is not None:
                kept += self._publish(prod, r, pending, keep)
            pending = nxt
        kept += self._publish(prod, r, pending, keep)
        sync(self.device)
        return _now() - t0, kept

    @staticmethod
    def _publish(prod, r, pending, keep: bool) -> list[SlotBatch]:
        msg = prod.complete(pending)
        out = []
        if keep:
            views = SlotBatch.from_tensors(layout.read_tensors(r.payload(msg.slot), msg.descriptor))
            out.append(views.to("cpu", copy=True))
        r.mark_empty(msg.slot)
        return out

    def close(self) -> None:
        """Remove the ring and free the target."""
        self.ring.close()
        self.ring.unlink()
        del self.model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def make_trainer(cfg: RunConfig, device: str, run_dir: str) -> Trainer:
    """A trainer of ``cfg``'s drafter on ``device``, built as a consumer process builds it (on CPU: its small
    attention groups, ``CPU_MAX_MASK_ELEMS``; without them a CPU stage measured 48 tokens/s where the consumer
    process trained 114)."""
    cpu = {} if torch.device(device).type == "cuda" else {"max_mask_elems": CPU_MAX_MASK_ELEMS}
    return Trainer(cfg.trainer, drafter_config_from_run(cfg), cfg.producer.target, device, run_dir, write_metrics=False,
                   **cpu)


def launch(flags: list[str], timeout_s: float = 1800) -> dict:
    """Run ``launch.py train FLAGS`` in a temporary run directory; returns its ``summary.json`` (raises
    ``RuntimeError`` with the log's tail when the run fails)."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), "train", "--run-dir", str(run_dir), *flags],
                              capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
        summary = run_dir / "summary.json"
        if proc.returncode != 0 or not summary.is_file():
            raise RuntimeError(f"launch.py train failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
        return json.loads(summary.read_text())


def pipeline_flags(args, producers: str, consumers: str) -> list[str]:
    """The ``launch.py train`` flags of a benchmark's pipeline run, from its parsed arguments (target, batch
    shape, anchors, steps, draft layers, data, random weights): no evaluation, no checkpoint. ``producers`` and
    ``consumers`` are comma lists of devices."""
    flags = ["--target", args.target, "--producers", producers, "--consumers", consumers,
             "--max-tokens", str(args.max_tokens), "--max-batch-size", str(args.max_batch_size), "--num-anchors",
             str(args.num_anchors), "--max-steps", str(args.steps), "--eval-prompts", "0",
             "--checkpoint-every", str(10**6)]
    if args.num_draft_layers:
        flags += ["--num-draft-layers", str(args.num_draft_layers)]
    if args.data:
        flags += ["--data", args.data]
    if args.random_target_weights:
        flags += ["--random-target-weights"]
    return flags


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _now() -> float:
    import time
    return time.perf_counter()


__all__ = ["DEFAULT_TARGET", "ProducerStage", "launch", "make_trainer", "pipeline_flags", "plan_batches", "run_config",
           "sync"]
