"""Resolving a run before anything starts: data, batch order, target shape, layer ids, ring sizes.

``resolve_run(cfg)`` validates everything that can be checked without starting a process (devices exist,
layer ids fit the target, ``/dev/shm`` has room for the rings) and raises ``ConfigError`` naming the flag;
it returns a ``RunPlan`` that ``launch.py train --plan`` prints and the supervisor executes.

Batch order: epochs of the deterministic ``BatchPlan`` concatenated; with ``--epochs E`` all batches of E
epochs, else the first ``max_steps · consumers · grad_accum`` batches. The order is truncated to a multiple
of ``consumers · grad_accum`` so every data-parallel rank takes the same number of optimizer steps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specring.shared.config.run_config import RunConfig
from specring.shared.data.dataset import Batch, BatchPlan, TokenDataset
from specring.shared.drafters import get_family
from specring.shared.errors import ConfigError
from specring.shared.machine.devices import DTYPE_NAMES, resolve_device, resolve_device_group, resolve_dtype
from specring.shared.models.layer_ids import describe_capture, layer_kinds
from specring.shared.models.target_config import read_target_config, text_config
from specring.shared.transport import layout
from specring.shared.transport.ring import PAGE, segment_bytes, shm_free_bytes
from specring.shared.transport.slot_batch import SlotBatch

log = logging.getLogger(__name__)

MAX_PLANNED_BATCHES = 10**7   # batches of one run's order (each a Batch in the coordinator's ledger)


@dataclass
class RunPlan:
    """The resolved run: what ``--plan`` prints and the supervisor executes."""
    order: list[Batch]
    total_steps: int
    batches_per_epoch: int
    slot_bytes: int
    ring_bytes: int
    target_layer_ids: list[int]
    hidden_size: int
    num_layers: int
    dtype_per_producer: list[str]
    plan_summary: str
    notes: list[str] = field(default_factory=list)
    data_digest: str = ""       # TokenDataset.content_digest() of --data: what the run trains on
    data_samples: int = 0
    data_tokens: int = 0
    batch_plan: Any = None      # the BatchPlan whose epochs, concatenated, ``order`` is the start of
    vocab_size: int = 0         # the target's vocabulary (config.json), 0 when it does not say
    draft_vocab_size: int = 0   # eagle3: the draft vocabulary size, --draft-vocab capped at the target's vocabulary
    layer_kinds: list[str] | None = None  # each decoder layer's token mixer (shared.models.layer_ids.layer_kinds)

    def first_batches(self, n: int) -> list[Batch]:
        """The first ``n`` batches of the batch plan's epochs concatenated: the order of a run of ``n``
        batches with the same data and plan settings, whatever its ``max_steps``/``epochs`` (``order`` is the
        first ``len(order)`` of them). A resume that changes the run length compares its data record on these."""
        if n <= len(self.order) or self.batch_plan is None:
            return self.order[:n]
        out: list[Batch] = []
        e = 0
        while len(out) < n:
            out.extend(self.batch_plan.epoch(e))
            e += 1
        return out[:n]

    def describe(self, cfg: RunConfig) -> str:
        """Human-readable topology, sizes and shared memory, as printed by ``train --plan``."""
        n = len(cfg.producer.devices)
        lines = [
            f"run_dir: {cfg.run_dir}",
            f"target: {cfg.producer.target}  ({self.num_layers} layers, hidden {self.hidden_size})",
            f"target layers captured: {self.target_layer_ids}",
            *([f"target layer kinds: {line}"] if (line := describe_capture(self.layer_kinds, self.target_layer_ids))
              else []),
            f"data: {cfg.data.data}  ({self.data_samples} samples, {self.data_tokens} tokens, {self.data_digest[:19]})",
            f"producers: {n}  devices {cfg.producer.devices}  dtype {self.dtype_per_producer}",
            f"consumers: {len(cfg.trainer.devices)}  devices {cfg.trainer.devices}  "
            + get_family(cfg.trainer.drafter).plan_line(cfg, self),
            *([f"nodes: {cfg.nodes.nnodes} (this is node {cfg.nodes.node_rank}; they meet at "
               f"{cfg.nodes.master_addr}:{cfg.nodes.master_port}); every node runs the producers and consumers above"]
              if cfg.nodes.nnodes > 1 else []),
            f"batches: {len(self.order)} planned ({self.batches_per_epoch} per epoch), "
            f"optimizer steps: {self.total_steps}",
            f"rings: {n} x {cfg.ring.num_slots} slots x {self.slot_bytes / 2**20:.2f} MiB = "
            f"{n * self.ring_bytes / 2**20:.1f} MiB of /dev/shm ({shm_free_bytes() / 2**20:.0f} MiB free)",
            "batch plan (epoch 0):",
            "  " + self.plan_summary.replace("\n", "\n  "),
        ]
        lines += [f"note: {x}" for x in self.notes]
        return "\n".join(lines)


def check_device(spec: str, flag: str) -> torch.device:
    """``spec`` as a device of this machine (``shared.machine.devices.resolve_device``); ``ConfigError`` naming ``flag``
    if it is not one."""
    try:
        return resolve_device(spec)
    except ConfigError as e:
        raise ConfigError(f"{flag}: {e}") from None


def check_device_group(spec: str, flag: str) -> list[torch.device]:
    """``spec`` as a producer's device group of this machine (``shared.machine.devices.resolve_device_group``);
    ``ConfigError`` naming ``flag`` if it is not one."""
    try:
        return resolve_device_group(spec)
    except ConfigError as e:
        raise ConfigError(f"{flag}: {e}") from None


def target_shape(target: str) -> dict:
    """``hidden_size``, ``num_hidden_layers`` (and the rest of ``config.json``) of a local target checkpoint."""
    d = text_config(read_target_config(target))
    for key in ("hidden_size", "num_hidden_layers"):
        if key not in d:
            raise ConfigError(f"--target: {Path(target) / 'config.json'} has no {key!r}")
    return d


def slot_bytes_for(max_real_tokens: int, max_batch_size: int, num_layers: int, hidden: int, dtype: torch.dtype,
                   label_source: str = "data", topk: int = 0) -> int:
    """Bytes of the largest payload (``shared.transport.slot_batch.SlotBatch.specs``) with ``hidden`` in ``dtype``,
    rounded up to 4 KiB."""
    specs = SlotBatch.specs(max_real_tokens, max_batch_size, num_layers, hidden, dtype, label_source, topk)
    need = layout.payload_bytes(specs)
    return (need + PAGE - 1) // PAGE * PAGE


def check_token_ids(path: str, vocab_size: int | None, flag: str = "--data") -> None:
    """Raise ``ConfigError`` naming ``flag`` and the first sample (row) whose token ids fall outside
    ``[0, vocab_size)``.

    One vectorised pass over the memory-mapped ``input_ids`` values (no Python objects per token).
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.ipc as ipc

    if not vocab_size:
        return
    row0 = 0
    with pa.memory_map(str(path)) as src:
        reader = ipc.open_file(src)
        for i in range(reader.num_record_batches):
            col = reader.get_batch(i).column("input_ids")
            values = col.flatten().to_numpy(zero_copy_only=False)
            bad = np.flatnonzero((values < 0) | (values >= vocab_size))
            if bad.size:
                offsets = col.offsets.to_numpy(zero_copy_only=False) - col.offsets[0].as_py()
                row = int(np.searchsorted(offsets, bad[0], side="right")) - 1
                raise ConfigError(f"{flag}: sample {row0 + row} of {path} has token id {int(values[bad[0]])}, "
                                  f"outside the target's vocabulary of {vocab_size} ({bad.size} such tokens in "
                                  f"record batch {i}); was it prepared with another tokenizer?")
            row0 += len(col)


def open_dataset(path: str, flag: str, shape: dict):
    """The ``TokenDataset`` at ``path``, checked against the target ``shape`` (its ``config.json``): it
    exists, is an Arrow file from ``launch.py prepare``, has samples, and its token ids fit the vocabulary.
    Raises ``ConfigError`` naming ``flag``."""
    if not Path(path).is_file():
        what = "is a directory, not a dataset file" if Path(path).is_dir() else "does not exist"
        raise ConfigError(f"{flag}: {path} {what} (build one with `launch.py prepare`)")
    try:
        ds = TokenDataset(path)
    except (OSError, ValueError, KeyError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise ConfigError(f"{flag}: {path} is not a dataset written by `launch.py prepare`: "
                          f"{type(e).__name__}: {e}") from None
    if len(ds) == 0:
        raise ConfigError(f"{flag}: {path} has no samples")
    check_token_ids(path, int(shape.get("vocab_size", 0)) or None, flag)
    if ds.vocab_size is not None and ds.vocab_size > int(shape.get("vocab_size", ds.vocab_size)):
        raise ConfigError(f"{flag}: tokenized with a vocabulary of {ds.vocab_size}, larger than the target's "
                          f"{shape.get('vocab_size')}")
    return ds


def check_anchors(ds, flag: str = "--data") -> list[str]:
    """Refuse a dataset none of whose samples can give a DFlash anchor (two adjacent loss-carrying tokens,
    ``shared.data.dataset.has_anchor``): every step would be skipped and the run would train nothing. Raises
    ``ConfigError`` naming ``flag`` and the first sample (with its source row when recorded); returns a
    note when only some samples lack an anchor."""
    bad = ds.samples_without_anchor()
    if not len(bad):
        return []
    first = int(bad[0])
    fi, row = ds.source(first)
    where = f"sample {first}" + (f" (input file {fi}, row/line {row})" if fi >= 0 else "")
    if len(bad) == len(ds):
        raise ConfigError(f"{flag}: none of the {len(ds)} samples of {ds.path} has two adjacent tokens that carry "
                          f"loss (loss_mask[p] == loss_mask[p+1] == 1), which a DFlash anchor needs: every step "
                          f"would train nothing (e.g. {where}); prepare it again with `launch.py prepare`, which "
                          f"names such rows (no_anchor)", key="data.data")
    return [f"{len(bad)} of {len(ds)} samples have no two adjacent loss tokens (no DFlash anchor) and train "
            f"nothing, e.g. {where}"]


def drafter_layer_ids(cfg: RunConfig, num_layers: int) -> list[int]:
    """The target layers the run's drafter captures: its family's rule (``shared.models.layer_ids``) over
    ``--target-layers``/``--num-target-layers``. Raises ``ConfigError`` naming the flag (where it came from) at
    fault."""
    asked_ids, asked_n = cfg.producer.target_layer_ids, cfg.producer.num_target_layers
    try:
        return get_family(cfg.trainer.drafter).resolve_layer_ids(num_layers, asked_ids, asked_n)
    except (ConfigError, ValueError) as e:
        key = getattr(e, "key", None) or ("target_layer_ids" if asked_ids is not None else "num_target_layers")
        key = key if key.startswith("producer.") else f"producer.{key}"
        detail = e.detail if isinstance(e, ConfigError) else str(e)
        raise ConfigError(f"{cfg.origin(key)}: {detail}", key=key, detail=detail) from None


def resolve_run(cfg: RunConfig) -> RunPlan:
    """Validate ``cfg`` and compute the ``RunPlan``; raises ``ConfigError`` naming the flag at fault.

    Checks that every tracker of ``--report-to`` is installed (``supervisor.reporting.check_backends``) and
    resolves ``--target`` once, a hub id to its directory in the local Hugging Face cache
    (``shared.models.hub.resolve_model_dir``): the children and the run's ``config.json`` get the directory.
    Fills in ``cfg.data.data``/``cfg.data.heldout`` (demo corpus, prepared on first use),
    ``cfg.producer.target_layer_ids`` (the drafter family's rule, ``drafter_layer_ids``),
    ``cfg.trainer.distill_topk`` when none, ``cfg.ring.slot_bytes`` when 0 and ``cfg.trainer.max_steps`` when
    ``--epochs`` is given, so that children read fully resolved values.
    """
    from specring.shared.models.hub import resolve_model_dir
    from specring.supervisor.reporting import check_backends

    check_backends(cfg.report_to)
    cfg.producer.target = str(resolve_model_dir(cfg.producer.target, cfg.origin("producer.target")))
    producer_devices = [check_device_group(d, "--producers")[0] for d in cfg.producer.devices]
    for d in cfg.trainer.devices:
        check_device(d, "--consumers")
    shape = target_shape(cfg.producer.target)
    L, H = int(shape["num_hidden_layers"]), int(shape["hidden_size"])
    vocab = int(shape.get("vocab_size") or 0)  # 0: config.json does not say
    family = get_family(cfg.trainer.drafter)
    ids = drafter_layer_ids(cfg, L)
    notes = family.plan_notes(cfg, L, vocab, ids)
    cfg.producer.target_layer_ids = list(ids)
    cfg.trainer.distill_topk = cfg.trainer.resolved_distill_topk()
    family.check_run(cfg)
    if not cfg.data.data:
        from specring.shared.data.demo import ensure_demo
        train, heldout = ensure_demo()
        cfg.data.data, cfg.data.heldout = str(train), cfg.data.heldout or str(heldout)
    ds = open_dataset(cfg.data.data, "--data", shape)
    if family.needs_anchors:  # an EAGLE-3 position needs no anchor: any loss-carrying token after the second trains
        notes.extend(check_anchors(ds, cfg.origin("data.data")))
    if cfg.data.heldout and cfg.trainer.eval_prompts > 0:  # tau during training reads it in the consumer
        held = open_dataset(cfg.data.heldout, "--heldout", shape)
        if not (held.lengths > cfg.trainer.eval_prompt_len).any():
            raise ConfigError(f"--heldout: no sample of {cfg.data.heldout} is longer than the "
                              f"{cfg.trainer.eval_prompt_len}-token prompts of tau during training (eval_prompt_len); "
                              f"use longer samples or --eval-prompts 0")
    dc = cfg.data
    plan = BatchPlan(ds.lengths, max_tokens=dc.max_tokens, max_batch_size=dc.max_batch_size,
                     bucket_edges=dc.bucket_edges, num_buckets=dc.num_buckets, seed=dc.seed,
                     fingerprint=ds.fingerprint)
    per_epoch = plan.num_batches()
    # every node runs len(trainer.devices) consumers (checked at the rendezvous): all are one data-parallel group
    world, accum = len(cfg.trainer.devices) * cfg.nodes.nnodes, cfg.trainer.grad_accum
    per_step = world * accum
    need = cfg.trainer.epochs * per_epoch if cfg.trainer.epochs else cfg.trainer.max_steps * per_step
    if need > MAX_PLANNED_BATCHES:
        key = "trainer.epochs" if cfg.trainer.epochs else "trainer.max_steps"
        raise ConfigError(f"{cfg.origin(key)}: the run would plan {need:,} batches ({per_epoch:,} per epoch); at "
                          f"most {MAX_PLANNED_BATCHES:,} are planned at once (the batch ledger is held in memory)",
                          key=key)
    order: list[Batch] = []
    if cfg.trainer.epochs:
        for e in range(cfg.trainer.epochs):
            order.extend(plan.epoch(e))
    else:
        need, e = cfg.trainer.max_steps * per_step, 0
        while len(order) < need:
            order.extend(plan.epoch(e))
            e += 1
        order = order[:need]
    usable = len(order) // per_step * per_step
    if usable == 0:
        raise ConfigError(f"--epochs/--max-steps: {len(order)} batches cannot feed {world} consumer(s) x "
                          f"grad_accum {accum}")
    if usable < len(order):
        notes.append(f"{len(order) - usable} trailing batch(es) dropped so every consumer takes the same steps")
        order = order[:usable]
    cfg.trainer.max_steps = usable // per_step
    dtypes = [resolve_dtype(cfg.producer.dtype, d) for d in producer_devices]
    widest = max(dtypes, key=lambda d: d.itemsize)
    max_real = max(dc.max_tokens, int(ds.lengths.max()))
    need_slot = slot_bytes_for(max_real, dc.max_batch_size, len(ids), H, widest, cfg.trainer.label_source,
                               cfg.trainer.distill_topk)
    if cfg.ring.slot_bytes == 0:
        cfg.ring.slot_bytes = need_slot
    elif cfg.ring.slot_bytes < need_slot:
        raise ConfigError(f"--slot-mb: slots of {cfg.ring.slot_bytes / 2**20:.2f} MiB are too small for a batch of "
                          f"{max_real} tokens x {len(ids)} layers x hidden {H}: need {need_slot / 2**20:.2f} MiB")
    ring_bytes = segment_bytes(cfg.ring.num_slots, cfg.ring.slot_bytes)
    total = ring_bytes * len(cfg.producer.devices)
    free = shm_free_bytes()
    if total > free:
        raise ConfigError(f"--num-slots/--slot-mb: the rings need {total / 2**20:.1f} MiB of /dev/shm but only "
                          f"{free / 2**20:.1f} MiB is free")
    return RunPlan(order=order, total_steps=cfg.trainer.max_steps, batches_per_epoch=per_epoch,
                   slot_bytes=cfg.ring.slot_bytes, ring_bytes=ring_bytes, target_layer_ids=list(ids),
                   hidden_size=H, num_layers=L, dtype_per_producer=[DTYPE_NAMES[d] for d in dtypes],
                   plan_summary=plan.summary(), notes=notes, data_digest=ds.content_digest(), data_samples=len(ds),
                   data_tokens=ds.num_tokens, batch_plan=plan, vocab_size=vocab,
                   draft_vocab_size=(min(cfg.trainer.draft_vocab, vocab or cfg.trainer.draft_vocab)
                                     if family.needs_draft_vocab else 0),
                   layer_kinds=layer_kinds(shape, L))
