"""The producer's logic: forward a leased batch through the target, capture layers, write one ring slot.

``Producer`` holds no socket and starts no process; ``producers/main.py`` wraps it in the DEALER loop. A
test steps it in-process with ``run_batch(batch, slot, seq)``, which returns the message to send.

Slot payload: a ``shared.transport.slot_batch.SlotBatch`` (its ``SPECS`` declare names, dtypes, shapes, in write
order); each tensor starts at a 64-byte aligned offset and the exact offsets, dtypes and shapes travel as
``SlotReady.descriptor``. Only real tokens are stored: padding is dropped, and the ``B`` sequences of the batch
are packed back to back in the order of the lease's ``sample_ids``. ``hidden`` is in the target's dtype
(bfloat16 on CUDA and float32 on CPU unless ``producer.dtype`` says else); column block ``k`` holds layer
``layer_ids[k]`` (= HF ``hidden_states[layer_ids[k] + 1]``). With ``label_source="target"`` the forward runs to
the final layer and the slot also carries the target's greedy next token of every position (and, with
``topk``, its top-K log-probabilities).

What is guaranteed:

* ``SlotReady`` is returned only after every byte of the payload is in the slot: on CUDA the
  device-to-host copy runs on a dedicated copy stream into the (pinned) slot, an event is recorded after
  it, and ``complete`` waits on that event before ``ring.publish``. The device tensor the copy reads is
  kept referenced (and ``record_stream``-ed on the copy stream) until then, so the caching allocator
  cannot hand its memory to anyone while the copy may still read it.
* A batch whose captured hidden states hold a NaN or an infinity (checked on the device over the real
  tokens only) is never published: the slot goes back to EMPTY and ``BadBatch`` names the batch and the
  layers with non-finite values. So is a batch that does not fit in a slot or runs out of GPU memory.
* ``submit``/``complete`` split ``run_batch`` so the process can keep one batch in flight: the copy of
  batch k overlaps the forward of batch k+1, and each ``SlotReady`` still follows its own event.

Fault injection (tests only): ``inject_nonfinite`` (constructor; ``from_config`` reads
``SPECRING_INJECT_NONFINITE`` through ``shared.process.faults``) puts a NaN into the captured hidden states of those
batches, before the finite check, so the real check must catch it. ``slow_write_s`` sleeps between writing
the payload and publishing it (``SPECRING_SLOW_WRITE_S`` in the process), so a test can kill a producer
while its slot is WRITING.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Iterable

import torch

from specring.shared.config.run_config import ProducerConfig
from specring.shared.errors import ConfigError, PayloadTooLarge
from specring.shared.machine.devices import resolve_device_group
from specring.shared.models.target import (
    LayerCapture,
    StopForward,
    base_model,
    check_checkpoint,
    greedy_next_tokens,
    hidden_size,
    load_target,
    num_decoder_layers,
    resolve_layer_ids,
)
from specring.shared.process import faults
from specring.shared.transport import layout, messages
from specring.shared.transport.ring import Ring
from specring.shared.transport.slot_batch import SlotBatch

log = logging.getLogger(__name__)

BATCH_KEYS = ("input_ids", "attention_mask", "loss_mask", "lengths", "batch_id")


@dataclass
class ProducerCounters:
    """Counters since the producer started (the heartbeat reports them: ``shared.transport.stats.ProducerStats``)."""
    batches: int = 0            # published
    bad_batches: int = 0        # answered with BadBatch
    tokens: int = 0             # real tokens published


@dataclass
class Pending:
    """A batch between ``submit`` and ``complete``: its copy may still be in flight."""
    batch_id: int
    slot: int
    seq: int
    num_tokens: int
    descriptor: list = field(default_factory=list)
    payload_bytes: int = 0
    bad_reason: str = ""
    event: object = None        # torch.cuda.Event recorded after the copy (None on CPU)
    finite: torch.Tensor | None = None   # 0-d bool on the host once the event has completed
    keep: list = field(default_factory=list)  # device tensors the copy reads; dropped after the event
    keep_extra: list = field(default_factory=list)  # the target's labels (label_source=target), also copied
    wrote_slot: bool = False


class Producer:
    """Runs leased batches through the target and writes them into slots of ``ring``.

    Args:
        model: a causal LM from ``load_target`` (eval mode, on ``device``).
        layer_ids: ids to capture (validated with ``resolve_layer_ids``; order = column-block order).
        ring: this producer's ``shared.transport.ring.Ring`` (attached; pinned by the caller when on CUDA).
        generation: this incarnation's generation, written to slot headers and messages.
        device: the device of the model's inputs (its embedding): on a target split over a device group, the
            group's first device, on which the captured layers are gathered before the slot write.
        index: producer index, the ``producer`` field of every message.
        checksum: store a CRC32 of each payload (``RingConfig.checksum``).
        inject_nonfinite: batch ids whose hidden states get a NaN (tests; see the module docstring).
        slow_write_s: sleep this long between writing a payload and publishing it (chaos tests).
        stop_early: skip the layers above the deepest captured one (``StopForward``); same results.
            Ignored with ``label_source="target"``, which needs the whole forward.
        label_source: ``"data"`` (slots carry the hidden states and tokens) or ``"target"`` (they also
            carry ``target_ids``, the target's greedy next token after every position: final norm, LM head,
            argmax; ``shared.models.target.greedy_next_tokens``).
        topk: with ``label_source="target"``, also the target's ``topk`` most likely next tokens and their
            log-probabilities (``target_topk_ids``/``target_topk_logprobs``), for distillation.

    Not thread-safe. Raises ``ConfigError`` for bad layer ids.
    """

    def __init__(self, model, layer_ids, ring: Ring, generation: int, device, *, index: int = 0,
                 checksum: bool = False, inject_nonfinite: Iterable[int] = (), slow_write_s: float = 0.0,
                 stop_early: bool = True, label_source: str = "data", topk: int = 0):
        self.model = model
        self.base = base_model(model)
        self.device = torch.device(device)
        self.ring = ring
        self.generation = int(generation)
        self.index = int(index)
        self.checksum = bool(checksum)
        self.inject_nonfinite = set(int(b) for b in inject_nonfinite)
        self.slow_write_s = float(slow_write_s)
        self.num_layers = num_decoder_layers(model)
        self.layer_ids = resolve_layer_ids(self.num_layers, list(layer_ids), len(list(layer_ids)))
        self.hidden_size = hidden_size(model)
        self.dtype = next(model.parameters()).dtype
        self.label_source, self.topk = label_source, int(topk) if label_source == "target" else 0
        target_labels = label_source == "target"
        self.capture = LayerCapture(model, self.layer_ids, stop_after_last=stop_early and not target_labels,
                                    final_output=target_labels)
        self.lm_head = model.get_output_embeddings() if target_labels else None
        if target_labels and self.lm_head is None:
            raise ConfigError(f"label_source=target: {type(model).__name__} has no LM head (get_output_embeddings)")
        self.stats = ProducerCounters()
        self.current_batch = -1
        self.normed: torch.Tensor | None = None  # final norm output of the last forward (label_source=target)
        self.hf_config = getattr(model, "config", None)
        self._cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(device=self.device) if self._cuda else None

    @classmethod
    def from_config(cls, cfg: ProducerConfig, index: int, ring: Ring, generation: int, *,
                    checksum: bool = False, inject_nonfinite: Iterable[int] | None = None,
                    slow_write_s: float = 0.0, label_source: str = "data", topk: int = 0) -> "Producer":
        """Load ``cfg.target`` on ``cfg.devices[index]`` (a device or a device group ``cuda:0+cuda:1``, over which
        the target is split: ``shared.models.target.load_target``) and build a producer for it.

        ``inject_nonfinite`` defaults to ``$SPECRING_INJECT_NONFINITE`` (``shared.process.faults``). Raises
        ``ConfigError`` for a bad index, device, checkpoint or layer ids (see ``shared.models.target``).
        """
        if not 0 <= index < len(cfg.devices):
            raise ConfigError(f"producer index {index} has no device: producer.devices has "
                              f"{len(cfg.devices)} entries {cfg.devices}")
        resolve_device_group(cfg.devices[index])
        num_layers = getattr(check_checkpoint(cfg.target, cfg.trust_remote_code), "num_hidden_layers", None)
        if isinstance(num_layers, int):  # fail on bad ids before spending time on the weights
            resolve_layer_ids(num_layers, cfg.target_layer_ids, cfg.num_target_layers)
        model, hf_config = load_target(cfg.target, cfg.devices[index], cfg.dtype, random_weights=cfg.random_weights,
                                       trust_remote_code=cfg.trust_remote_code)
        ids = resolve_layer_ids(num_decoder_layers(model), cfg.target_layer_ids, cfg.num_target_layers)
        if inject_nonfinite is None:
            inject_nonfinite = faults.inject_nonfinite()
        dev = next(model.parameters()).device
        prod = cls(model, ids, ring, generation, dev, index=index, checksum=checksum,
                   inject_nonfinite=inject_nonfinite, slow_write_s=slow_write_s, label_source=label_source,
                   topk=topk)
        prod.hf_config = hf_config
        log.info("producer ready index=%d device=%s layer_ids=%s dtype=%s", index, dev, ids, prod.dtype)
        return prod

    # ------------------------------------------------------------------------------------------ sizes
    def payload_bytes(self, num_tokens: int, batch_size: int) -> int:
        """Bytes a slot needs for ``num_tokens`` real tokens in ``batch_size`` sequences."""
        return layout.payload_bytes(self._specs(num_tokens, batch_size))

    def _specs(self, t: int, b: int) -> dict:
        return SlotBatch.specs(t, b, len(self.layer_ids), self.hidden_size, self.dtype, self.label_source, self.topk)

    # ------------------------------------------------------------------------------------------ forward
    @staticmethod
    def _check_batch(batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        missing = [k for k in BATCH_KEYS if k not in batch]
        if missing:
            raise ValueError(f"batch is missing {missing} (needs {list(BATCH_KEYS)})")
        ids, am, lm = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        lengths = torch.as_tensor(batch["lengths"]).to(torch.int64).cpu()
        bid = int(batch["batch_id"])
        if ids.dim() != 2 or am.shape != ids.shape or lm.shape != ids.shape or lengths.shape != ids.shape[:1]:
            raise ValueError(f"batch {bid}: shapes disagree: input_ids {tuple(ids.shape)}, attention_mask "
                             f"{tuple(am.shape)}, loss_mask {tuple(lm.shape)}, lengths {tuple(lengths.shape)}")
        s = ids.shape[1]
        if ids.shape[0] < 1:
            raise ValueError(f"batch {bid}: no sequences")
        if (int(lengths.min()) < 1 or int(lengths.max()) > s):
            raise ValueError(f"batch {bid}: lengths {lengths.tolist()} must lie in [1, {s}]")
        expect = torch.arange(s)[None, :] < lengths[:, None]
        if not torch.equal(am.cpu().bool(), expect):
            raise ValueError(f"batch {bid}: attention_mask is not right padding matching lengths {lengths.tolist()}")
        return ids, am, lm, lengths, bid

    @staticmethod
    def token_index(lengths: torch.Tensor, seq_len: int) -> torch.Tensor:
        """Flat indices ``[T] int64`` of the real tokens in a right-padded ``[B, seq_len]`` batch."""
        return torch.cat([b * seq_len + torch.arange(int(n)) for b, n in enumerate(lengths.tolist())]
                         or [torch.zeros(0, dtype=torch.int64)])

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Host-to-device copy that does not block the host on CUDA (staged through pinned memory)."""
        if self._cuda and t.device.type == "cpu":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, lengths: torch.Tensor,
                flat_index: torch.Tensor | None = None) -> torch.Tensor:
        """Capture the chosen layers for a right-padded batch; returns ``hidden [T, n*H]`` on the device.

        ``input_ids``/``attention_mask``: ``[B, S]`` int64 (any device); ``lengths``: ``[B]``.
        Runs the base model only (no LM head); the result is packed (real tokens only, sequence by
        sequence), in the model's dtype.
        """
        if flat_index is None:
            flat_index = self.token_index(lengths.cpu(), input_ids.shape[1])
        with torch.inference_mode():
            self.capture.token_index = self.to_device(flat_index)
            with self.capture:
                try:
                    self.base(input_ids=self.to_device(input_ids), attention_mask=self.to_device(attention_mask),
                              use_cache=False)
                except StopForward:
                    pass
                # a split target's layers sit on several devices: the slot is written from the first one
                parts = [p if p.device == self.device else p.to(self.device) for p in self.capture.outputs()]
                self.normed = self.capture.final_output() if self.lm_head is not None else None
            self.capture.clear()
            self.capture.token_index = None
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def warm_up(self, max_tokens: int, max_batch_size: int, pad_id: int = 0) -> list[tuple[int, int]]:
        """Run the representative batch shapes through ``forward`` once before any lease; returns them.

        The shapes are the batch plan's extremes: one sequence of ``max_tokens`` tokens (the longest batch) and,
        when each sequence keeps at least 16 tokens, ``max_batch_size`` sequences of ``max_tokens //
        max_batch_size`` (the widest). Kernels that tune themselves at their first call of a shape (Triton's
        autotuning of flash-linear-attention's Gated DeltaNet kernels, cuBLAS heuristics) do it here, at start-up,
        where running out of memory is a clear start-up error and not a lost batch mid-run. Nothing is written
        to the ring. Raises ``ConfigError`` naming the shape and ``data.max_tokens`` when a shape does not fit
        in device memory.
        """
        shapes = [(1, int(max_tokens))]
        if max_batch_size > 1 and max_tokens // max_batch_size >= 16:
            shapes.append((int(max_batch_size), int(max_tokens) // int(max_batch_size)))
        for b, s in shapes:
            ids = torch.full((b, s), int(pad_id), dtype=torch.int64)
            lengths = torch.full((b,), s, dtype=torch.int64)
            try:
                self.forward(ids, torch.ones_like(ids), lengths)
            except torch.cuda.OutOfMemoryError as e:
                raise ConfigError(f"data.max_tokens: the warm-up forward of {b} x {s} tokens ran out of device "
                                  f"memory on {self.device} ({str(e).splitlines()[0]}); lower --max-tokens") from e
            finally:
                self.normed = None
        if self._cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        return shapes

    # ------------------------------------------------------------------------------------------ slots
    def run_batch(self, batch: dict, slot: int, seq: int):
        """Forward ``batch`` and write it into ``slot``; returns ``messages.SlotReady`` or ``messages.BadBatch``.

        ``batch``: ``input_ids [B, S]`` int64, ``attention_mask [B, S]`` int64 (right padding),
        ``loss_mask [B, S]`` uint8, ``lengths [B]`` and ``batch_id`` (as from ``shared.data.dataset.collate``).
        Returns only once the slot is published (or marked EMPTY for a bad batch).
        Raises ``ValueError`` for a malformed batch (shapes, padding), ``SlotError`` for a bad slot index.
        """
        return self.complete(self.submit(batch, slot, seq))

    def submit(self, batch: dict, slot: int, seq: int) -> Pending:
        """Start ``batch``: forward, finite check and the copy into ``slot`` are issued; returns a ``Pending``.

        On CPU everything is done on return; on CUDA the copy may still be running. Pass the result to
        ``complete`` (in submission order) to get the message.
        """
        ids, am, lm, lengths, bid = self._check_batch(batch)
        self.current_batch = bid
        b, s = ids.shape
        num_tokens = int(lengths.sum())
        pending = Pending(batch_id=bid, slot=int(slot), seq=int(seq), num_tokens=num_tokens)
        need = self.payload_bytes(num_tokens, b)
        if need > self.ring.slot_bytes:
            pending.bad_reason = str(PayloadTooLarge(
                f"batch {bid}: payload of {need} bytes ({num_tokens} tokens x {len(self.layer_ids)} layers x "
                f"{self.hidden_size}) does not fit in a slot of {self.ring.slot_bytes} bytes; raise ring.slot_bytes"))
            log.error("bad_batch batch_id=%d reason=payload_too_large need=%d slot_bytes=%d",
                      bid, need, self.ring.slot_bytes)
            return pending
        flat = self.token_index(lengths, s)
        try:
            hidden = self.forward(ids, am, lengths, flat)
        except torch.cuda.OutOfMemoryError as e:
            self.capture.clear()
            torch.cuda.empty_cache()
            pending.bad_reason = f"batch {bid}: out of GPU memory in the target forward ({num_tokens} tokens): {e}"
            log.error("bad_batch batch_id=%d reason=oom tokens=%d", bid, num_tokens)
            return pending
        with torch.inference_mode():
            if bid in self.inject_nonfinite and num_tokens:
                hidden[0, 0] = float("nan")
                log.warning("inject nonfinite batch_id=%d", bid)
            finite = torch.isfinite(hidden).all()
        next_ids = tk_ids = tk_lp = None
        if self.lm_head is not None:
            with torch.inference_mode():
                next_ids, tk_ids, tk_lp = greedy_next_tokens(self.normed, self.lm_head, self.topk)
                next_ids, tk_ids, tk_lp = (None if x is None else x.to(self.device) for x in (next_ids, tk_ids, tk_lp))
            self.normed = None
            pending.keep_extra = [t for t in (next_ids, tk_ids, tk_lp) if t is not None]
        host = SlotBatch(
            hidden=hidden,
            input_ids=ids.reshape(-1)[flat].to(torch.int32),
            loss_mask=lm.reshape(-1)[flat].to(torch.uint8),
            cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32),
            batch_id=torch.tensor([bid], dtype=torch.int64),
            layer_ids=torch.tensor(self.layer_ids, dtype=torch.int32),
            target_ids=next_ids, target_topk_ids=tk_ids, target_topk_logprobs=tk_lp,
        ).to_tensors()
        buf = self.ring.begin_write(pending.slot, bid, self.generation, pending.seq)
        pending.wrote_slot = True
        if self._cuda:
            copy_stream = self._copy_stream
            copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(copy_stream):
                hidden.record_stream(copy_stream)
                finite.record_stream(copy_stream)
                pending.descriptor, pending.payload_bytes = layout.write_tensors(buf, host, non_blocking=True)
                pending.finite = torch.empty((), dtype=torch.bool, pin_memory=True)
                pending.finite.copy_(finite, non_blocking=True)
                pending.event = torch.cuda.Event()
                pending.event.record(copy_stream)
            for t in pending.keep_extra:
                t.record_stream(copy_stream)
            pending.keep = [hidden, finite, *pending.keep_extra]  # alive until the event has completed
        else:
            pending.descriptor, pending.payload_bytes = layout.write_tensors(buf, host)
            pending.finite = finite
        return pending

    def complete(self, pending: Pending):
        """Wait for ``pending``'s copy, then publish its slot; returns ``SlotReady`` or ``BadBatch``."""
        if pending.event is not None:
            pending.event.synchronize()  # the payload and the finite flag are now on the host
        pending.keep.clear()
        try:
            if pending.bad_reason:
                return self._bad(pending, pending.bad_reason)
            if not bool(pending.finite):
                return self._bad(pending, self._nonfinite_reason(pending))
            if self.slow_write_s > 0:
                time.sleep(self.slow_write_s)
            crc = self.ring.publish(pending.slot, pending.batch_id, self.generation, pending.seq,
                                    pending.payload_bytes, checksum=self.checksum)
            self.stats.batches += 1
            self.stats.tokens += pending.num_tokens
            return messages.SlotReady(producer=self.index, generation=self.generation, slot=pending.slot,
                                      batch_id=pending.batch_id, seq=pending.seq, descriptor=pending.descriptor,
                                      payload_bytes=pending.payload_bytes, num_tokens=pending.num_tokens,
                                      checksum=crc)
        finally:
            if self.current_batch == pending.batch_id:  # a later batch may already be in flight
                self.current_batch = -1

    def _nonfinite_reason(self, pending: Pending) -> str:
        """Which layers hold non-finite values (read back from the slot: rare, so CPU time is fine)."""
        hidden = SlotBatch.from_tensors(layout.read_tensors(self.ring.payload(pending.slot), pending.descriptor)).hidden
        h = self.hidden_size
        bad_ids = [lid for k, lid in enumerate(self.layer_ids)
                   if not bool(torch.isfinite(hidden[:, k * h:(k + 1) * h]).all())]
        count = int((~torch.isfinite(hidden)).sum())
        return (f"batch {pending.batch_id}: {count} non-finite values in the captured hidden states "
                f"(layers {bad_ids})")

    def _bad(self, pending: Pending, reason: str):
        if pending.wrote_slot:
            self.ring.mark_empty(pending.slot)
        self.stats.bad_batches += 1
        log.warning("bad_batch batch_id=%d slot=%d reason=%r", pending.batch_id, pending.slot, reason)
        return messages.BadBatch(producer=self.index, generation=self.generation, slot=pending.slot,
                                 batch_id=pending.batch_id, reason=reason[:2000])
