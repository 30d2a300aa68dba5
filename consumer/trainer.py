"""The drafter training logic (DFlash, and EAGLE-3 through ``consumer/eagle3_ttt.py``), steppable in-process:
``Trainer.step(batch, batch_ids)``; no sockets.

``consumer/main.py`` (the process) copies a slot's tensors to the device, releases the slot and calls
``step``; tests call it directly. One ``Trainer`` per data-parallel rank.

What a DFlash step does (DFlash paper, training section; SpecForge ``specforge/core/dflash.py`` for the same
loss): sample anchors (``consumer/blocks.py``), build blocks and labels (the data's tokens, or with
``label_source="target"`` the target's own greedy next tokens that the producer put in the slot), run the
drafter (on CUDA one forward over the whole batch with block-sparse flex attention; on CPU over groups of
sequences whose attention scores stay under ``max_mask_elems``), and back-propagate the *unnormalised*
weighted cross-entropy ``sum_k w_k * CE_k`` (plus, with ``distill_topk``, the KL divergence to the target's
top-K distribution). Every ``grad_accum`` micro-batches the optimizer step
divides the gradients by the sum of weights of the whole window over the whole data-parallel group
(``all_reduce``), so the update is exactly that of one process on the union of the batches, however they
fall on ranks and micro-batches.

Guarantees:

* Anchors are drawn from a generator seeded by ``(seed, batch_ids)``: a batch always gets the same
  anchors, on any rank, after any resume.
* Initial weights come from ``torch.manual_seed(seed)`` on the CPU, identical on every rank and device.
* Gradients are all-reduced as one flat float32 buffer, statistics as one float64 vector; every rank
  takes the same decision (step or skip) from the reduced values and ends with identical weights.
* A window whose loss or gradient norm is not finite is skipped on every rank (no optimizer update; the
  step counter and the schedule still advance, the batch ids are recorded as skipped and logged);
  ``max_nonfinite_in_row`` such windows in a row raise ``BadBatch``.
* ``state_dict()`` holds everything a resume needs; resuming from a checkpoint reproduces the loss
  trajectory and weights of an uninterrupted run (CPU, same thread count).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from specring.consumer.blocks import (
    block_loss,
    build_block_batch,
    loss_weights,
    sample_anchors,
    split_sequences,
    to_device,
)
from specring.consumer.eagle3_ttt import eagle3_loss
from specring.shared import checkpoint as ckpt
from specring.shared.config import RunConfig, TrainerConfig
from specring.shared.errors import BadBatch
from specring.shared.models.dflash import (
    DFlashConfig,
    DFlashDrafter,
)
from specring.shared.models.draft_attention import (
    build_attention_mask,
    build_context_mask,
    build_flex_mask,
)
from specring.shared.models.eagle3 import Eagle3Config, Eagle3Drafter

logger = logging.getLogger(__name__)

BATCH_KEYS = ("hidden", "input_ids", "loss_mask", "cu_seqlens")
TARGET_LABEL_KEYS = ("target_ids", "target_topk_ids", "target_topk_logprobs")
CPU_MAX_MASK_ELEMS = 2 ** 20  # a CPU consumer's max_mask_elems: small groups, no work on other sequences' context


def dflash_config_from_run(run: RunConfig) -> DFlashConfig:
    """The drafter config of a run: target and captured layers from ``run.producer``, block size, mask
    token and draft depth from ``run.trainer``."""
    p, t = run.producer, run.trainer
    return DFlashConfig.from_target(p.target, p.target_layer_ids, block_size=t.block_size,
                                    mask_token_id=t.mask_token_id, num_draft_layers=t.num_draft_layers,
                                    num_target_layers=p.num_target_layers,
                                    trust_remote_code=p.trust_remote_code)


def eagle3_config_from_run(run: RunConfig) -> Eagle3Config:
    """The EAGLE-3 drafter config of a run: target and its three captured layers from ``run.producer``, draft
    vocabulary size (capped at the target's vocabulary) and TTT steps from ``run.trainer``."""
    p, t = run.producer, run.trainer
    return Eagle3Config.from_target(p.target, p.target_layer_ids, draft_vocab_size=t.draft_vocab,
                                    ttt_steps=t.ttt_steps)


def drafter_config_from_run(run: RunConfig) -> DFlashConfig | Eagle3Config:
    """``eagle3_config_from_run`` or ``dflash_config_from_run``, as ``run.trainer.drafter`` says."""
    return eagle3_config_from_run(run) if run.trainer.drafter == "eagle3" else dflash_config_from_run(run)


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Linear warm-up over ``warmup_steps`` (from ``1/warmup``), then cosine from 1 to ``min_lr_ratio``
    at ``total_steps``; constant ``min_lr_ratio`` after it."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def anchor_seed(seed: int, batch_ids: list[int]) -> int:
    """63-bit generator seed from the run seed and the batch ids (stable across processes and versions)."""
    h = hashlib.sha256(f"{int(seed)}:{','.join(str(int(b)) for b in batch_ids)}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def check_batch(batch: dict[str, torch.Tensor], dcfg: DFlashConfig | Eagle3Config, label_source: str = "data") -> int:
    """Validate a packed batch; return its token count ``T``. Raises ``BadBatch`` naming the field.

    The checks read ``cu_seqlens`` and ``input_ids`` on the host: free for the CPU tensors a consumer hands
    over before its copy lands, one synchronisation for device tensors. ``label_source="target"`` also needs
    ``target_ids [T]`` (the producer's greedy next tokens).
    """
    for k in BATCH_KEYS + (("target_ids",) if label_source == "target" else ()):
        if k not in batch:
            raise BadBatch(f"batch: field {k!r} missing (have {sorted(batch)})"
                           + (" (label_source=target needs the producer to send target_ids)"
                              if k == "target_ids" else ""))
    hidden, ids, lm, cu = (batch[k] for k in BATCH_KEYS)
    t = ids.shape[0]
    feature = getattr(dcfg, "target_hidden_size", dcfg.hidden_size)  # the target's width (EAGLE-3 records it)
    width = dcfg.num_target_layers * feature
    if hidden.dim() != 2 or hidden.shape != (t, width):
        raise BadBatch(f"batch: hidden has shape {tuple(hidden.shape)}, expected ({t}, {width}) "
                       f"({dcfg.num_target_layers} layers x {feature})")
    if ids.dim() != 1 or lm.shape != ids.shape:
        raise BadBatch(f"batch: input_ids {tuple(ids.shape)} and loss_mask {tuple(lm.shape)} must be equal 1-D")
    for k in TARGET_LABEL_KEYS:
        if k in batch and batch[k].shape[0] != t:
            raise BadBatch(f"batch: {k} has {batch[k].shape[0]} rows, input_ids {t}")
    cu = cu.detach().cpu()
    if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != t or bool((cu[1:] < cu[:-1]).any()):
        raise BadBatch(f"batch: cu_seqlens must run from 0 to {t} without decreasing, got "
                       f"{cu.tolist()[:4]}...{cu.tolist()[-2:]}")
    for k in ("input_ids", "target_ids"):
        if k in batch and t:
            lo, hi = (int(x) for x in batch[k].detach().aminmax())
            if lo < 0 or hi >= dcfg.vocab_size:
                raise BadBatch(f"batch: {k} outside 0..{dcfg.vocab_size - 1} (min {lo}, max {hi})")
    return t


class Trainer:
    """DFlash trainer of one data-parallel rank (see the module docstring).

    ``cfg``: ``TrainerConfig``; ``dcfg``: ``DFlashConfig``; ``target_dir``: target checkpoint (embedding
    and LM head are read from it); ``device``: ``"cpu"`` or ``"cuda:N"``; ``run_dir``: where
    ``metrics.jsonl`` and ``checkpoints/`` live. With ``world_size > 1``, ``torch.distributed`` must be
    initialised (gloo on CPU, NCCL on GPU) and ``process_group`` (default: the world) spans the consumers.

    Keyword options: ``total_steps`` (schedule length; default ``cfg.max_steps``), ``max_mask_elems``
    (mask/score budget per forward of the grouped forms, default 2**27, see ``split_sequences``),
    ``attention``: ``"flex"`` (the whole batch in one forward; block-sparse ``flex_attention`` compiled for
    the GPU, ``consumer.blocks.build_flex_mask``: only the context before each anchor and the own block are
    computed), ``"dense"`` (groups of sequences, ``[Q, C+Q]`` mask into ``scaled_dot_product_attention``),
    ``"structured"`` (groups, context mask + own block, scores computed explicitly, ``Q*(C+B)`` of them:
    the cheapest on CPU) or ``"auto"`` (default: flex on CUDA, structured elsewhere; see
    ``benchmarks/trainer.py`` and docs/performance.md for the measured rates),
    ``write_metrics`` (rank 0 writes ``metrics.jsonl``), ``keep_last`` (checkpoints kept; None = all),
    ``compile_layers`` (``torch.compile`` each draft layer in place; default ``cfg.compile``, whose None
    means on CUDA: measured 1.8x the positions/s of the uncompiled flex form for the fixture drafter).
    """

    def __init__(self, cfg: TrainerConfig, dcfg: DFlashConfig | Eagle3Config, target_dir: str | Path,
                 device: str | torch.device, run_dir: str | Path, rank: int = 0, world_size: int = 1,
                 process_group=None, *, total_steps: int | None = None, max_mask_elems: int = 2 ** 27,
                 attention: str = "auto", write_metrics: bool = True, keep_last: int | None = None,
                 compile_layers: bool | None = None, draft_vocab: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.kind = "eagle3" if isinstance(dcfg, Eagle3Config) else "dflash"
        if self.kind == "dflash" and dcfg.block_size != cfg.block_size:
            raise ValueError(f"block_size: trainer {cfg.block_size} != drafter config {dcfg.block_size}")
        if self.kind == "eagle3" and draft_vocab is None:
            raise ValueError("draft_vocab: an EAGLE-3 trainer needs the run's draft vocabulary (d2t, t2d)")
        self.cfg, self.dcfg = cfg, dcfg
        # statistics per draft position: DFlash block slots, or EAGLE-3 TTT steps
        self.num_slots = cfg.block_size if self.kind == "dflash" else dcfg.ttt_steps
        self.device = torch.device(device)
        self.run_dir = Path(run_dir)
        self.rank, self.world_size, self.pg = rank, world_size, process_group
        if world_size > 1 and not dist.is_initialized():
            raise ValueError("world_size > 1 needs torch.distributed initialised first")
        self.total_steps = int(total_steps or cfg.max_steps)
        self.max_mask_elems = int(max_mask_elems)
        # rows of [rows, V] float32 logits alive at once: about 1 GiB (2**28 floats)
        self.loss_chunk_rows = max(256, 2 ** 28 // max(1, dcfg.vocab_size))
        attention = cfg.attention if attention == "auto" else attention
        if attention not in ("auto", "flex", "dense", "structured"):
            raise ValueError(f"attention: must be auto, flex, dense or structured, got {attention!r}")
        self.attention = attention if attention != "auto" else ("flex" if self.device.type == "cuda"
                                                                else "structured")
        self.keep_last = keep_last
        self.target_dir = Path(target_dir)

        torch.manual_seed(cfg.seed)
        if self.kind == "dflash":  # initialised on the CPU: the same weights on every rank and device
            self.model = DFlashDrafter(dcfg)
        else:
            self.model = Eagle3Drafter(dcfg)
            self.model.set_draft_vocab(*draft_vocab)
        self.model.load_target_head(target_dir)
        self.model.to(self.device).train()
        if compile_layers is None:
            compile_layers = self.device.type == "cuda" if cfg.compile is None else cfg.compile
        self.compiled = bool(compile_layers)
        if self.compiled:
            for layer in (self.model.layers if self.kind == "dflash" else [self.model.midlayer]):  # in place: parameter names (checkpoints, exports) are unchanged
                layer.compile(dynamic=True)  # one graph for every batch shape: no recompile mid-run
        self.params = [p for n, p in self.model.named_parameters() if p.requires_grad]
        decay = [p for p in self.params if p.dim() >= 2]
        no_decay = [p for p in self.params if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, **({"fused": True} if self.device.type == "cuda" else {}))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, cfg.warmup_steps, self.total_steps, cfg.min_lr_ratio))
        self.weights = loss_weights(cfg.block_size, cfg.resolved_gamma()).to(self.device)
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda"
                         else contextlib.nullcontext())

        self.step_count = 0              # optimizer steps taken (skipped windows included)
        self.micro_step = 0              # micro-batches seen
        self.trained_batch_ids: list[int] = []
        self.skipped_batch_ids: list[int] = []
        self.num_skipped = 0
        self.nonfinite_in_row = 0
        self._reset_window()

        self._metrics_path = self.run_dir / "metrics.jsonl"
        self._write_metrics = write_metrics and rank == 0
        if self._write_metrics:  # the supervisor sends these lines to the trackers (--report-to)
            self.run_dir.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ one micro-batch
    def _reset_window(self) -> None:
        b = self.num_slots
        # [weighted_ce, weight_sum, accept_sum, num_blocks, num_tokens, nonfinite, correct[S], counted[S]]
        # (S: DFlash block slots, or EAGLE-3 TTT steps; "blocks" are EAGLE-3 positions)
        self._stats = torch.zeros(6 + 2 * b, dtype=torch.float64, device=self.device)
        self._window_ids: list[int] = []
        self._window_t0: float | None = None

    def _forward_backward(self, batch: dict[str, torch.Tensor], batch_ids: list[int],
                          backward: bool = True, checked: bool = False) -> torch.Tensor:
        """Forward (+ backward) of one micro-batch; returns its local statistics vector (``_reset_window``).

        Host work is kept out of the device's way: the batch is checked on the host copies of its small
        fields, anchors, blocks, labels and the attention mask are built on the device, and the only
        synchronisation is the anchor count (``sample_anchors``); the statistics stay on the device until
        the optimizer step reads them.
        """
        t = batch["input_ids"].shape[0] if checked else check_batch(batch, self.dcfg, self.cfg.label_source)
        if self.kind == "eagle3":
            return self._forward_backward_eagle3(batch, t, backward)
        b = self.cfg.block_size
        dev = self.device
        hidden = to_device(batch["hidden"], dev)
        ids = to_device(batch["input_ids"], dev)
        lm = to_device(batch["loss_mask"], dev)
        cu_cpu = batch["cu_seqlens"].detach().cpu().long()
        extra = {k: to_device(batch[k], dev) for k in TARGET_LABEL_KEYS if k in batch}
        next_ids = extra.get("target_ids") if self.cfg.label_source == "target" else None
        gen = torch.Generator().manual_seed(anchor_seed(self.cfg.seed, batch_ids))
        anchors = sample_anchors(lm, cu_cpu, self.cfg.num_anchors, b, gen)
        stats = torch.zeros_like(self._stats)
        stats[4] = t
        if self.attention == "flex":
            groups = [(0, cu_cpu.numel() - 1, anchors)]
        else:
            groups = []
            anchors_cpu = anchors.cpu()
            for s0, s1 in split_sequences(cu_cpu, anchors_cpu, b, self.max_mask_elems, dense=self.attention == "dense"):
                lo, hi = int(cu_cpu[s0]), int(cu_cpu[s1])
                groups.append((s0, s1, anchors_cpu[(anchors_cpu >= lo) & (anchors_cpu < hi)].to(dev)))
        for s0, s1, a_g in groups:
            if a_g.numel() == 0:
                continue
            lo, hi = int(cu_cpu[s0]), int(cu_cpu[s1])
            cu_g = cu_cpu[s0:s1 + 1] - lo
            bb = build_block_batch(ids[lo:hi], lm[lo:hi], cu_g, a_g - lo, b, self.dcfg.mask_token_id,
                                   next_token_ids=None if next_ids is None else next_ids[lo:hi], check=False)
            if self.attention == "flex":
                mask, form = build_flex_mask(bb.anchors, bb.seq_start, hi - lo, b), None
            elif self.attention == "dense":
                mask, form = build_attention_mask(bb.anchors, cu_g.to(dev), b), None
            else:
                mask, form = build_context_mask(bb.anchors, cu_g.to(dev), b), b
            distill = {}
            if self.cfg.distill_topk and "target_topk_ids" in extra:
                src = (bb.label_pos - 1).clamp(min=0) + lo  # the position whose next token slot k predicts
                distill = dict(topk_ids=extra["target_topk_ids"][src], topk_logprobs=extra["target_topk_logprobs"][src],
                               distill_weight=self.cfg.distill_weight)
            with self.autocast:
                h = self.model(bb.block_input_ids, bb.block_positions, hidden[lo:hi], bb.ctx_positions, mask,
                               block_size=form)
                # the loss back-propagates chunk by chunk into a detached copy of h (see block_loss), then
                # h.backward() carries that gradient through the drafter once
                h_leaf = h.detach().requires_grad_(True) if backward else h
                out = block_loss(self.model.logits, h_leaf, bb.labels, self.weights,
                                 chunk_rows=self.loss_chunk_rows, backward=backward, **distill)
            if backward and h_leaf.grad is not None:
                h.backward(h_leaf.grad)
            finite = torch.isfinite(out.weighted_ce.detach())
            stats[0] += torch.where(finite, out.weighted_ce.detach(), 0.0).double()
            stats[1] += out.weight_sum.double()
            stats[2] += out.accept_sum.double()
            stats[3] += out.num_blocks
            stats[5] += (~finite).double()
            stats[6:6 + b] += out.correct.double()
            stats[6 + b:] += out.counted.double()
        return stats

    def warm_up(self) -> float:
        """Compile the kernels of the flex form (``torch.compile``: tens of seconds on a cold cache) on a
        synthetic batch, so the first real step is not mistaken for a hang; weights, optimizer, counters and
        the global RNG are untouched. Returns the seconds it took (0 for the other forms, which compile nothing).

        A compiler failure (a toolchain the machine lacks, a torch without the needed support) is logged as an
        error naming the form given up, and the trainer falls back: compiled layers -> eager layers, then flex
        -> dense attention; the weights are the same either way, only the speed differs."""
        if (self.kind == "eagle3" or self.attention != "flex") and not self.compiled:
            return 0.0  # EAGLE-3 never uses flex attention: only compiled layers need warming up
        t0 = time.perf_counter()
        try:
            self._warm_up_once()
        except Exception as e:  # noqa: BLE001 - any compiler error; the fallback is logged
            if self.compiled:
                logger.error("compile_failed form=compiled_layers fallback=eager_layers error=%s: %s",
                             type(e).__name__, str(e)[:500])
                for layer in (self.model.layers if self.kind == "dflash" else [self.model.midlayer]):
                    layer._compiled_call_impl = None  # undo nn.Module.compile()
                self.compiled = False
            else:
                logger.error("compile_failed form=flex fallback=dense error=%s: %s", type(e).__name__, str(e)[:500])
                self.attention = "dense"
            self.optimizer.zero_grad(set_to_none=True)
            return time.perf_counter() - t0 + self.warm_up()
        return time.perf_counter() - t0

    def _warm_up_once(self) -> None:
        n = 2 * self.cfg.block_size + 2
        width = self.dcfg.num_target_layers * getattr(self.dcfg, "target_hidden_size", self.dcfg.hidden_size)
        token = self.dcfg.mask_token_id if self.kind == "dflash" else 0
        batch = {"hidden": torch.zeros(2 * n, width, device=self.device),
                 "input_ids": torch.full((2 * n,), token, dtype=torch.int32, device=self.device),
                 "loss_mask": torch.ones(2 * n, dtype=torch.uint8, device=self.device),
                 "cu_seqlens": torch.tensor([0, n, 2 * n], dtype=torch.int32)}
        if self.cfg.label_source == "target":
            batch["target_ids"] = batch["input_ids"].clone()
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            self._forward_backward(batch, [-1], checked=True)
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _forward_backward_eagle3(self, batch: dict[str, torch.Tensor], t: int, backward: bool) -> torch.Tensor:
        """EAGLE-3: training-time test over every position (``consumer.eagle3_ttt.eagle3_loss``)."""
        dev = self.device
        cu_cpu = batch["cu_seqlens"].detach().cpu().long()
        on_dev = {k: to_device(batch[k], dev) for k in ("hidden", "input_ids", "loss_mask", *TARGET_LABEL_KEYS)
                  if k in batch}
        stats = torch.zeros_like(self._stats)
        stats[4] = t
        with self.autocast:
            loss, wsum, correct, counted, accept, npos = eagle3_loss(self.model, on_dev, cu_cpu, self.cfg.label_source,
                                                                     backward)
        finite = torch.isfinite(loss)
        k = self.num_slots
        stats[0] += torch.where(finite, loss, 0.0).double()
        stats[1] += wsum.double()
        stats[2] += accept.double()
        stats[3] += npos.double()
        stats[5] += (~finite).double()
        stats[6:6 + k] += correct.double()
        stats[6 + k:] += counted.double()
        return stats

    # ------------------------------------------------------------------ public step
    def step(self, batch: dict[str, torch.Tensor], batch_ids: list[int], checked: bool = False) -> dict[str, Any]:
        """Train on one packed micro-batch (``hidden [T, n*H]``, ``input_ids [T] int32``, ``loss_mask [T]
        uint8``, ``cu_seqlens [S+1] int32``; with ``label_source="target"`` also ``target_ids [T] int32`` and,
        with ``distill_topk``, ``target_topk_ids``/``target_topk_logprobs [T, K]``; see
        ``shared.layout.slot_payload_specs``) identified by ``batch_ids``. Tensors may be on the host or the
        device; ``checked=True`` says ``check_batch`` already passed (the consumer runs it on the slot's host
        views before the copy).

        Every ``grad_accum``-th call takes the optimizer step (all ranks must call ``step`` the same
        number of times) and returns the window's group-wide metrics with ``optimizer_step=True`` and
        ``batch_ids`` = every rank's ids of the window. Other calls return this micro-batch's local
        metrics with ``optimizer_step=False``. Keys: ``step``, ``loss``, ``per_slot_acc`` (DFlash: slots 1..B-1;
        EAGLE-3: ``per_step_acc``, TTT steps 0..K-1),
        ``accept_proxy``, ``num_tokens``, ``tokens_per_s``, ``skipped``, ``optimizer_step``, ``batch_ids``,
        ``lr``, ``grad_norm``, ``num_blocks``, ``time``. Raises ``BadBatch`` for a malformed batch and
        after ``max_nonfinite_in_row`` non-finite windows in a row.
        """
        if self._window_t0 is None:
            self._window_t0 = time.perf_counter()
        ids = [int(x) for x in batch_ids]
        local = self._forward_backward(batch, ids, checked=checked)
        self._stats += local
        self._window_ids += ids
        self.micro_step += 1
        if self.micro_step % self.cfg.grad_accum:
            m = self._metrics(local, ids, time.perf_counter() - self._window_t0)
            m.update(optimizer_step=False, skipped=False, grad_norm=None)
            return m
        return self._optimizer_step()

    def _flat_grads(self) -> torch.Tensor:
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                          for p in self.params])

    def _optimizer_step(self) -> dict[str, Any]:
        stats = self._stats
        if self.world_size > 1:
            flat = self._flat_grads()
            dist.all_reduce(flat, group=self.pg)
            dist.all_reduce(stats, group=self.pg)
            offset = 0
            for p in self.params:
                n = p.numel()
                p.grad = flat[offset:offset + n].view_as(p).to(p.dtype)
                offset += n
        weight_sum = float(stats[1])
        nonfinite = float(stats[5]) > 0
        skipped, grad_norm = True, None
        if not nonfinite and weight_sum > 0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.div_(weight_sum)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip))
            if math.isfinite(grad_norm):
                self.optimizer.step()
                skipped = False
            else:
                nonfinite = True
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        all_ids = self._gather_ids(self._window_ids)
        elapsed = time.perf_counter() - (self._window_t0 or time.perf_counter())
        m = self._metrics(stats, all_ids, elapsed)
        m.update(optimizer_step=True, skipped=skipped, grad_norm=grad_norm, lr=lr)
        self.step_count += 1
        if skipped:
            self.num_skipped += 1
            self.skipped_batch_ids += all_ids
            logger.warning("step_skipped step=%d reason=%s batch_ids=%s", m["step"],
                           "nonfinite" if nonfinite else "no_labels", all_ids)
        else:
            self.trained_batch_ids += all_ids
        self.nonfinite_in_row = self.nonfinite_in_row + 1 if nonfinite else 0
        m.update(num_skipped=self.num_skipped, nonfinite_in_row=self.nonfinite_in_row)
        self._reset_window()
        self._log_metrics(m)
        if self.nonfinite_in_row >= self.cfg.max_nonfinite_in_row:
            raise BadBatch(f"{self.nonfinite_in_row} non-finite steps in a row (max_nonfinite_in_row="
                           f"{self.cfg.max_nonfinite_in_row}); last batch ids {all_ids}")
        return m

    def _gather_ids(self, ids: list[int]) -> list[int]:
        if self.world_size == 1:
            return list(ids)
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, list(ids), group=self.pg)
        return [int(x) for part in out for x in part]

    def _metrics(self, stats: torch.Tensor, ids: list[int], elapsed_s: float) -> dict[str, Any]:
        b = self.num_slots
        s = stats.detach().cpu().tolist()
        correct, counted = s[6:6 + b], s[6 + b:]
        acc = [correct[k] / counted[k] if counted[k] else None for k in range(b)]
        return {
            "step": self.step_count,
            "loss": s[0] / s[1] if s[1] > 0 else float("nan"),
            # DFlash: accuracy of block slots 1..B-1; EAGLE-3: of TTT steps 0..K-1
            **({"per_slot_acc": acc[1:]} if self.kind == "dflash" else {"per_step_acc": acc}),
            "accept_proxy": s[2] / s[3] if s[3] else float("nan"),
            "num_blocks": int(s[3]),
            "num_tokens": int(s[4]),
            "tokens_per_s": s[4] / elapsed_s if elapsed_s > 0 else None,
            "batch_ids": list(ids),
            "lr": self.optimizer.param_groups[0]["lr"],
            "time": time.time(),
        }

    def _log_metrics(self, m: dict[str, Any]) -> None:
        if not self._write_metrics:
            return
        with open(self._metrics_path, "a") as f:
            f.write(json.dumps(m) + "\n")

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs: trainable weights, optimizer, scheduler, RNG states, step, data position."""
        rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        return {
            "model": {k: v.detach().cpu().clone() for k, v in self.model.trainable_state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": rng,
            "step": self.step_count,
            "micro_step": self.micro_step,
            "trained_batch_ids": list(self.trained_batch_ids),
            "skipped_batch_ids": list(self.skipped_batch_ids),
            "num_skipped": self.num_skipped,
            "nonfinite_in_row": self.nonfinite_in_row,
            "world_size": self.world_size,
            "drafter": self.kind,
            "drafter_config": self.dcfg.to_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of ``state_dict``. Raises ``ValueError`` when the drafter config differs (layer ids,
        block size, shapes): a checkpoint of another drafter must not be continued silently."""
        kind = state.get("drafter", "dflash")
        if kind != self.kind:
            raise ValueError(f"checkpoint holds a {kind} drafter, this run trains {self.kind}")
        saved = state.get("drafter_config", state.get("dflash_config"))  # dflash_config: checkpoints before 0.2
        if saved is not None and saved != self.dcfg.to_dict():
            diff = sorted(k for k in saved if saved.get(k) != self.dcfg.to_dict().get(k))
            raise ValueError(f"checkpoint drafter config differs from this run in {diff}")
        with torch.no_grad():
            named = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
            missing = set(self.model.trainable_state_dict()) - set(state["model"])
            if missing:
                raise ValueError(f"checkpoint lacks weights {sorted(missing)}")
            for k, v in state["model"].items():
                named[k].copy_(v.to(named[k].device, named[k].dtype))
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        rng = state.get("rng", {})
        if "torch" in rng:
            torch.set_rng_state(rng["torch"].cpu())
        if "python" in rng:
            random.setstate(rng["python"])
        if "numpy" in rng:
            np.random.set_state(rng["numpy"])
        if "cuda" in rng and torch.cuda.is_available() and len(rng["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(rng["cuda"])
        self.step_count = int(state["step"])
        self.micro_step = int(state["micro_step"])
        self.trained_batch_ids = list(state["trained_batch_ids"])
        self.skipped_batch_ids = list(state.get("skipped_batch_ids", []))
        self.num_skipped = int(state.get("num_skipped", 0))
        self.nonfinite_in_row = int(state.get("nonfinite_in_row", 0))
        self.optimizer.zero_grad(set_to_none=True)
        self._reset_window()

    def save_checkpoint(self, checkpoints_dir: str | Path | None = None) -> Path | None:
        """Write ``checkpoints/step-{step:06d}/`` (rank 0 only; other ranks return None). Must be called
        between optimizer steps (raises ``RuntimeError`` in the middle of an accumulation window)."""
        if self.micro_step % self.cfg.grad_accum:
            raise RuntimeError(f"save_checkpoint in the middle of a grad_accum window (micro_step {self.micro_step})")
        if self.rank != 0:
            return None
        state = self.state_dict()
        tensors = dict(state.pop("model"))
        tensors.update(self.model.frozen_state_dict())
        root = Path(checkpoints_dir) if checkpoints_dir is not None else self.run_dir / "checkpoints"
        return ckpt.save_checkpoint(root, self.step_count, tensors, state, self.dcfg.to_dict(), self.keep_last,
                                    drafter=self.kind)

    def load_checkpoint(self, path: str | Path) -> Path:
        """Resume from ``path`` (step, checkpoints or run directory). Checks that the checkpoint's frozen
        embedding/LM head are bit for bit the target's (and, for EAGLE-3, that its draft vocabulary is the one
        the trainer was built with; ``ValueError`` otherwise), restores the state and, on rank 0, drops lines of
        ``metrics.jsonl`` beyond the restored step. Returns the step directory used."""
        step_dir = ckpt.resolve_checkpoint(path)
        if ckpt.drafter_kind(step_dir) != self.kind:
            raise ValueError(f"checkpoint {step_dir} holds a {ckpt.drafter_kind(step_dir)} drafter, this run trains "
                             f"{self.kind}")
        tensors, state, _ = ckpt.load_checkpoint(step_dir)
        for key, mine in self.model.frozen_state_dict().items():
            if key in tensors and not torch.equal(tensors[key], mine.cpu()):
                raise ValueError(f"checkpoint {step_dir}: {key} differs from the target's in {self.target_dir}")
        if self.kind == "eagle3":  # the run's draft vocabulary file and the checkpoint's must agree
            for key in ("d2t", "t2d"):
                if key in tensors and not torch.equal(tensors[key], getattr(self.model, key).cpu()):
                    raise ValueError(f"checkpoint {step_dir}: its draft vocabulary ({key}) differs from the one this "
                                     f"trainer was given (the run's draft_vocab.safetensors)")
        frozen = set(self.model.frozen_state_dict())
        state["model"] = {k: v for k, v in tensors.items() if k not in frozen}
        self.load_state_dict(state)
        if self._write_metrics and self._metrics_path.is_file():
            keep = [ln for ln in self._metrics_path.read_text().splitlines()
                    if ln.strip() and json.loads(ln).get("step", 0) < self.step_count]
            tmp = self._metrics_path.with_suffix(f".tmp-{os.getpid()}")
            tmp.write_text("".join(ln + "\n" for ln in keep))
            os.replace(tmp, self._metrics_path)
        logger.info("resumed step=%d from=%s trained_batches=%d", self.step_count, step_dir,
                    len(self.trained_batch_ids))
        return step_dir
