"""The drafter training logic of every drafter family, steppable in-process: ``Trainer.step(batch, batch_ids)``;
no sockets.

``consumer/main.py`` (the process) copies a slot's tensors to the device, releases the slot and calls
``step``; tests call it directly. One ``Trainer`` per data-parallel rank.

What a step computes is the drafter family's objective (``DrafterFamily.objective``, ``shared/drafters/``: DFlash
and DFlash2 blocks, EAGLE-3 training-time test); it returns named statistics (``StepStats``) and leaves the
gradient of the *unnormalised* loss in the parameters. Every ``grad_accum`` micro-batches the optimizer step
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
import copy
import dataclasses
import logging
import math
import random
import threading
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
import torch.distributed as dist

from specring.shared.config.run_config import RunConfig, TrainerConfig
from specring.shared.drafters import checkpoint as ckpt
from specring.shared.drafters import family_of, get_family
from specring.shared.drafters.contract import ObjectiveContext, StepStats
from specring.shared.drafters.dflash_blocks import to_device
from specring.shared.drafters.linear_ce import resolve_linear_ce
from specring.shared.errors import BadBatch, MessageError
from specring.shared.run.run_dir import RunDir
from specring.shared.run.run_records import MetricsRecord
from specring.shared.transport.slot_batch import SlotBatch

logger = logging.getLogger(__name__)

CPU_MAX_MASK_ELEMS = 2 ** 20  # a CPU consumer's max_mask_elems: small groups, no work on other sequences' context


def drafter_config_from_run(run: RunConfig):
    """The drafter config of a run, from its drafter family (``run.trainer.drafter``, ``shared.drafters``)."""
    return get_family(run.trainer.drafter).config_from_run(run)


def compile_layer(layer: torch.nn.Module) -> None:
    """``torch.compile`` one draft layer in place (``nn.Module.compile``: parameter names unchanged) with dynamic
    shapes, inductor's backend: one graph for every batch shape under ``compile_shape_scope``."""
    layer.compile(dynamic=True)


def compile_shape_scope() -> contextlib.AbstractContextManager:
    """The shape rule under which the draft layers (``layer.compile(dynamic=True)``) and flex attention are
    traced: TorchDynamo's *duck sizing* off. With it on, two input dimensions of equal size at the first trace
    share one symbol and the graph is guarded on their equality; the warm-up's context of 128 positions then
    equals the fixture's 128 key/value features (2 heads x 64), so the first real batch, whose context differs,
    failed the guard ``ctx_kv[1]._base.size()[1] == ctx_kv[0].size()[1]`` and recompiled (about 20 s on the
    H200), and any later coincidence of two sizes could do the same mid-run. Each dimension gets its own symbol
    instead: one graph serves every batch shape (test: tests/unit/test_trainer.py). The switch is
    ``torch.fx.experimental._config.use_duck_shape``, which dynamo's recompile log itself names (PyTorch,
    ``torch/_dynamo/guards.py``); on a torch without it this is a no-op."""
    try:
        from torch.fx.experimental import _config as fx_config
        return fx_config.patch(use_duck_shape=False)
    except (ImportError, AttributeError, TypeError):  # a torch without the switch: duck sizing as it is
        return contextlib.nullcontext()


def pytree_registry_size() -> int:
    """The number of pytree node types registered (``torch.utils._pytree.SUPPORTED_NODES``): TorchDynamo guards
    a graph on it, so a type registered after a trace (an import inside the traced step) retraces the graph."""
    import torch.utils._pytree as pytree
    return len(pytree.SUPPORTED_NODES)


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Linear warm-up over ``warmup_steps`` (from ``1/warmup``), then cosine from 1 to ``min_lr_ratio``
    at ``total_steps``; constant ``min_lr_ratio`` after it."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def as_batch(batch: SlotBatch | Mapping[str, torch.Tensor]) -> SlotBatch:
    """``batch`` as a ``SlotBatch`` (``SlotBatch.of``: a mapping of its field names is accepted, for in-process
    callers); raises ``BadBatch`` naming an unknown or missing field."""
    try:
        return SlotBatch.of(batch)
    except MessageError as e:
        raise BadBatch(str(e)) from None


def check_batch(batch: SlotBatch | Mapping[str, torch.Tensor], dcfg, label_source: str = "data") -> int:
    """Validate a packed batch (a ``SlotBatch``, or a mapping of its field names); return its token count ``T``.
    Raises ``BadBatch`` naming the field.

    The checks read ``cu_seqlens`` and ``input_ids`` on the host: free for the CPU tensors a consumer hands
    over before its copy lands, one synchronisation for device tensors. ``label_source="target"`` also needs
    ``target_ids [T]`` (the producer's greedy next tokens).
    """
    batch = as_batch(batch)
    if label_source == "target" and batch.target_ids is None:
        raise BadBatch(f"batch: field 'target_ids' missing (have {sorted(batch.to_tensors())}) (label_source=target "
                       f"needs the producer to send target_ids)")
    hidden, ids, lm, cu = batch.hidden, batch.input_ids, batch.loss_mask, batch.cu_seqlens
    t = ids.shape[0]
    feature = getattr(dcfg, "target_hidden_size", dcfg.hidden_size)  # the target's width (EAGLE-3 records it)
    width = dcfg.num_target_layers * feature
    if hidden.dim() != 2 or hidden.shape != (t, width):
        raise BadBatch(f"batch: hidden has shape {tuple(hidden.shape)}, expected ({t}, {width}) "
                       f"({dcfg.num_target_layers} layers x {feature})")
    if ids.dim() != 1 or lm.shape != ids.shape:
        raise BadBatch(f"batch: input_ids {tuple(ids.shape)} and loss_mask {tuple(lm.shape)} must be equal 1-D")
    for k in SlotBatch.TARGET_LABELS:
        label = getattr(batch, k)
        if label is not None and label.shape[0] != t:
            raise BadBatch(f"batch: {k} has {label.shape[0]} rows, input_ids {t}")
    cu = cu.detach().cpu()
    if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != t or bool((cu[1:] < cu[:-1]).any()):
        raise BadBatch(f"batch: cu_seqlens must run from 0 to {t} without decreasing, got "
                       f"{cu.tolist()[:4]}...{cu.tolist()[-2:]}")
    for k, tokens in (("input_ids", ids), ("target_ids", batch.target_ids)):
        if tokens is not None and t:
            lo, hi = (int(x) for x in tokens.detach().aminmax())
            if lo < 0 or hi >= dcfg.vocab_size:
                raise BadBatch(f"batch: {k} outside 0..{dcfg.vocab_size - 1} (min {lo}, max {hi})")
    return t


class Trainer:
    """The trainer of one data-parallel rank, for any drafter family (see the module docstring).

    ``cfg``: ``TrainerConfig``; ``dcfg``: the drafter config (its class names the family,
    ``shared.drafters.family_of``); ``target_dir``: target checkpoint (embedding and LM head are read from it);
    ``device``: ``"cpu"`` or ``"cuda:N"``; ``run_dir``: where ``metrics.jsonl`` and ``checkpoints/`` live. With
    ``world_size > 1``, ``torch.distributed`` must be initialised (gloo on CPU, NCCL on GPU) and ``process_group``
    (default: the world) spans the consumers.

    Keyword options: ``total_steps`` (schedule length; default ``cfg.max_steps``), ``max_mask_elems`` (mask/score budget
    per forward of the grouped forms, default 2**27, see ``split_sequences``), ``attention``: ``"flex"`` (the whole
    batch in one forward; block-sparse ``flex_attention`` compiled for the GPU,
    ``shared.models.draft_attention.build_flex_mask``: only the context before each anchor and the own block are
    computed), ``"dense"`` (groups of sequences, ``[Q, C+Q]`` mask into ``scaled_dot_product_attention``),
    ``"structured"`` (groups, context mask + own block, scores computed explicitly, ``Q*(C+B)`` of them: the cheapest on
    CPU) or ``"auto"`` (default: flex on CUDA, structured elsewhere; see ``benchmarks/trainer.py`` and
    docs/performance.md for the measured rates), ``write_metrics`` (rank 0 writes ``metrics.jsonl``), ``keep_last``
    (checkpoints kept; None = all), ``compile_layers`` (``torch.compile`` each draft layer in place; default
    ``cfg.compile``, whose None means on CUDA: measured 1.8x the positions/s of the uncompiled flex form for the fixture
    drafter).
    """

    def __init__(self, cfg: TrainerConfig, dcfg, target_dir: str | Path,
                 device: str | torch.device, run_dir: str | Path, rank: int = 0, world_size: int = 1,
                 process_group=None, *, total_steps: int | None = None, max_mask_elems: int = 2 ** 27,
                 attention: str = "auto", write_metrics: bool = True, keep_last: int | None = None,
                 compile_layers: bool | None = None, draft_vocab: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.family = family_of(dcfg)
        self.kind = self.family.name
        if hasattr(dcfg, "block_size") and dcfg.block_size != cfg.block_size:
            raise ValueError(f"block_size: trainer {cfg.block_size} != drafter config {dcfg.block_size}")
        self.cfg, self.dcfg = cfg, dcfg
        # statistics per draft position: DFlash block slots, or EAGLE-3 TTT steps
        self.num_slots = self.family.num_positions(dcfg, cfg)
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

        torch.manual_seed(cfg.seed)  # initialised on the CPU: the same weights on every rank and device
        self.model = self.family.build(dcfg, target_dir, draft_vocab=draft_vocab)
        self.model.to(self.device).train()
        if compile_layers is None:
            compile_layers = self.device.type == "cuda" if cfg.compile is None else cfg.compile
        self.compiled = bool(compile_layers)
        if self.compiled:
            for layer in self.family.compiled_modules(self.model):  # in place: parameter names are unchanged
                compile_layer(layer)  # one graph for every batch shape (compile_shape_scope)
        self.params = [p for n, p in self.model.named_parameters() if p.requires_grad]
        decay = [p for p in self.params if p.dim() >= 2]
        no_decay = [p for p in self.params if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, **({"fused": True} if self.device.type == "cuda" else {}))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, cfg.warmup_steps, self.total_steps, cfg.min_lr_ratio))
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda"
                         else contextlib.nullcontext())
        self.objective_ctx = ObjectiveContext(
            model=self.model, tcfg=cfg, dcfg=dcfg, device=self.device, attention=self.attention,
            max_mask_elems=self.max_mask_elems, loss_chunk_rows=self.loss_chunk_rows, autocast=self.autocast,
            seed=cfg.seed, linear_ce=resolve_linear_ce(cfg.fused_ce, self.device, dcfg.vocab_size))

        self._background: threading.Thread | None = None  # the compile beside training (start_background_warm_up)
        self._background_batch: SlotBatch | None = None
        self._background_batch_ready = threading.Event()
        self._background_error: BaseException | None = None
        self._background_form: tuple[str, bool] = (self.attention, self.compiled)  # the form it compiles
        self._background_t0 = 0.0
        self.step_count = 0              # optimizer steps taken (skipped windows included)
        self.micro_step = 0              # micro-batches seen
        self.trained_batch_ids: list[int] = []
        self.skipped_batch_ids: list[int] = []
        self.num_skipped = 0
        self.nonfinite_in_row = 0
        self._reset_window()

        self._run = RunDir(self.run_dir)  # metrics.jsonl, checkpoints/
        self._write_metrics = write_metrics and rank == 0
        if self._write_metrics:  # the supervisor sends these lines to the trackers (--report-to)
            self.run_dir.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ one micro-batch
    def _reset_window(self) -> None:
        self._stats = StepStats(self.family.stats_layout(self.dcfg, self.cfg), self.device)
        self._window_ids: list[int] = []
        self._window_t0: float | None = None

    def _forward_backward(self, batch: SlotBatch | Mapping[str, torch.Tensor], batch_ids: list[int],
                          backward: bool = True, checked: bool = False) -> StepStats:
        """Forward (+ backward) of one micro-batch through the family's objective; returns its local statistics.
        The batch is checked on the host copies of its small fields unless ``checked``; the statistics stay on
        the device until the optimizer step reads them."""
        batch = as_batch(batch)
        t = batch.num_tokens if checked else check_batch(batch, self.dcfg, self.cfg.label_source)
        if backward and self.cfg.feature_noise > 0:
            batch = dataclasses.replace(batch, hidden=self._noised(batch.hidden))
        self.objective_ctx.attention = self.attention
        with compile_shape_scope():  # compiles happen inside (warm-up, a new shape): one shape rule for all
            return self.family.objective(self.objective_ctx, batch, batch_ids, t, backward)

    def _noised(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [T, L*H]`` (the captured layers side by side) plus uniform noise ``U(-a, a) * rms``, ``a`` =
        ``cfg.feature_noise`` and ``rms`` each token's root mean square over each layer's ``H`` features (layers
        differ in scale), in float32, returned in ``hidden``'s dtype. The noise comes from a generator seeded by
        ``(cfg.seed, micro_step)``, so a resumed run draws the same noise. The regulariser of EAGLE's training
        (SafeAILab/EAGLE @41d8abb, ``eagle/train/main.py``, ``AddUniformNoise``: ``(rand - 0.5) * std * 512 / T``
        added to the target's features, std 0.2), scaled here by the features' own size instead of a constant
        over the sequence length ``T``."""
        t, width = hidden.shape
        layers = self.dcfg.num_target_layers
        h = hidden.float().reshape(t, layers, width // layers)
        gen = torch.Generator(device=hidden.device)
        gen.manual_seed((int(self.cfg.seed) * 1_000_003 + self.micro_step) % (2 ** 63))
        u = torch.rand(h.shape, generator=gen, device=hidden.device, dtype=torch.float32).mul_(2).sub_(1)
        rms = h.pow(2).mean(-1, keepdim=True).sqrt_()
        return (h + u * (self.cfg.feature_noise * rms)).reshape(t, width).to(hidden.dtype)

    def warm_up(self) -> float:
        """Compile the kernels of the flex form (``torch.compile``: tens of seconds on a cold cache) on a
        synthetic batch, so the first real step is not mistaken for a hang; weights, optimizer, counters and
        the global RNG are untouched. Returns the seconds it took (0 for the other forms, which compile nothing).

        A compiler failure (a toolchain the machine lacks, a torch without the needed support) is logged as an
        error naming the form given up, and the trainer falls back: compiled layers -> eager layers, then flex
        -> dense attention; the weights are the same either way, only the speed differs. When the pass registered
        pytree node types (a module imported inside the step; ``pytree_registry_size``), it runs once more, so the
        compiled graphs' guard on the registry holds at the first real batch (logged ``warm_up pytree_registry``)."""
        uses_flex = self.attention == "flex" and self.family.uses_flex_attention
        if not uses_flex and not self.compiled:
            return 0.0  # nothing compiled: nothing to warm up
        t0 = time.perf_counter()
        try:
            nodes = pytree_registry_size()
            self._warm_up_once()
            if pytree_registry_size() != nodes:  # an import inside the step registered pytree types after the
                # layers were traced: their graphs are guarded on the registry's size, so trace them again now
                # rather than at the first real batch
                logger.warning("warm_up pytree_registry %d -> %d during the warm-up: warming up again (import "
                               "the module that registers them before the trainer is built)", nodes,
                               pytree_registry_size())
                self._warm_up_once()
        except Exception as e:  # noqa: BLE001 - any compiler error; the fallback is logged
            if self.compiled:
                logger.error("compile_failed form=compiled_layers fallback=eager_layers error=%s: %s",
                             type(e).__name__, str(e)[:500])
                for layer in self.family.compiled_modules(self.model):
                    layer._compiled_call_impl = None  # undo nn.Module.compile()
                self.compiled = False
            else:
                logger.error("compile_failed form=flex fallback=dense error=%s: %s", type(e).__name__, str(e)[:500])
                self.attention = "dense"
            self.optimizer.zero_grad(set_to_none=True)
            return time.perf_counter() - t0 + self.warm_up()
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ compile beside training
    def start_background_warm_up(self) -> bool:
        """Compile the flex form and the compiled layers in a thread while the first steps train eagerly; returns
        False (nothing started: call ``warm_up`` instead) unless ``cfg.warm_up`` resolves to ``background`` (auto:
        on CUDA), a form here compiles, and this trainer is a single rank.

        Until the thread ends, steps run the eager ``dense`` attention form (flex families) with eager layers; the
        step after it ends takes the compiled form back (``_take_compiled_form``; logged ``warm_up background
        done``). The thread passes, fwd + bwd, the warm-up batch and then a copy of the first real batch
        (``step``'s first call hands it over) through a *shadow* model: ``copy.deepcopy`` of the drafter with the
        frozen parameters shared and the trainable ones copied, so the optimizer's in-place updates and the
        gradients of the live model are never touched, and with its own autocast context (autocast state is per
        thread). TorchDynamo keeps compiled code per code object, guarded on the inputs' properties, not on the
        module's identity (the five draft layers share their graphs), so the live layers' ``compile`` finds the
        shadow's graphs and, having seen a real batch, no guard fails at the first compiled step. A compiler error
        in the thread is logged at the swap (``compile_failed ...``) and training stays on the eager form. The
        global RNG is not forked (another thread draws from it): the warm-up's objective draws only from its own
        seeded generator, and a drafter with dropout would shift the live steps' draws.

        Why: on a cold inductor cache the compile took 35 s before the first step and 16.8 s more at the first real
        batch on the H200 (docs/performance.md, "Time to the first step")."""
        mode = self.cfg.warm_up
        if mode == "auto":
            mode = "background" if self.device.type == "cuda" else "blocking"
        uses_flex = self.attention == "flex" and self.family.uses_flex_attention
        if mode != "background" or not (uses_flex or self.compiled) or self.world_size > 1:
            return False
        self._background_form = (self.attention, self.compiled)
        if self.compiled:
            for layer in self.family.compiled_modules(self.model):
                layer._compiled_call_impl = None  # the live layers run eagerly until the swap
        self.compiled = False
        if uses_flex:
            self.attention = "dense"
        self._background_t0 = time.perf_counter()
        self._background = threading.Thread(target=self._background_warm_up, name="warm_up", daemon=True)
        self._background.start()
        logger.info("warm_up background attention=%s compiled=%s (until it ends: attention=%s, eager layers)",
                    *self._background_form, self.attention)
        return True

    @property
    def warming_up(self) -> bool:
        """True while the background compile (``start_background_warm_up``) has not been taken over."""
        return self._background is not None

    def wait_for_warm_up(self, timeout_s: float | None = None) -> bool:
        """Block until the background compile's thread has ended (at most ``timeout_s`` seconds; None: no limit);
        True when it has (or none runs). The live model takes the compiled form at the start of the next ``step``,
        not here."""
        thread = self._background
        if thread is not None:
            thread.join(timeout_s)
            return not thread.is_alive()
        return True

    def _background_warm_up(self) -> None:
        attention, compiled = self._background_form
        try:
            shared = {id(p): p for p in self.model.parameters() if not p.requires_grad}
            shadow = copy.deepcopy(self.model, memo=shared)
            if compiled:
                for layer in self.family.compiled_modules(shadow):
                    compile_layer(layer)
            autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda"
                        else contextlib.nullcontext())
            ctx = dataclasses.replace(self.objective_ctx, model=shadow, attention=attention, autocast=autocast,
                                      extras={})

            def one_pass(batch: SlotBatch, name: str) -> None:
                t0, nodes = time.perf_counter(), pytree_registry_size()
                for _ in range(2):  # once more when the pass registered pytree types (see warm_up)
                    with compile_shape_scope():
                        self.family.objective(ctx, batch, [-1], batch.num_tokens, True)
                    shadow.zero_grad(set_to_none=True)
                    if pytree_registry_size() == nodes:
                        break
                    nodes = pytree_registry_size()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                logger.info("warm_up background pass=%s seconds=%.1f", name, time.perf_counter() - t0)

            one_pass(self._warm_up_batch(), "synthetic")
            if self._background_batch_ready.wait(timeout=600.0) and self._background_batch is not None:
                one_pass(self._background_batch, "first_batch")
        except BaseException as e:  # noqa: BLE001 - any compiler error; reported at the swap
            self._background_error = e
        finally:
            self._background_batch = None

    def _take_compiled_form(self) -> None:
        """At the start of a step: when the background compile has ended, the live model takes its form."""
        if self._background is None or self._background.is_alive():
            return
        self._background.join()
        self._background = None
        attention, compiled = self._background_form
        seconds = time.perf_counter() - self._background_t0
        if self._background_error is not None:
            e = self._background_error
            logger.error("compile_failed form=%s fallback=dense+eager_layers error=%s: %s",
                         "compiled_layers" if compiled else "flex", type(e).__name__, str(e)[:500])
            return
        if compiled:
            for layer in self.family.compiled_modules(self.model):
                compile_layer(layer)
        self.attention, self.compiled = attention, compiled
        logger.info("warm_up background done attention=%s compiled=%s seconds=%.1f eager_micro_steps=%d",
                    attention, compiled, seconds, self.micro_step)

    def _warm_up_once(self) -> None:
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            self._forward_backward(self._warm_up_batch(), [-1], checked=True)
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _warm_up_batch(self) -> SlotBatch:
        """The warm-up's synthetic batch, on the device: two sequences of ``2 * block_size + 2`` tokens of the
        family's warm-up token, zero features (every size the compiled kernels see is at least 2: flex masks pad
        to two tiles, ``shared.models.draft_attention``)."""
        n = 2 * self.cfg.block_size + 2
        width = self.dcfg.num_target_layers * getattr(self.dcfg, "target_hidden_size", self.dcfg.hidden_size)
        token = self.family.warm_up_token(self.dcfg)
        ids = torch.full((2 * n,), token, dtype=torch.int32, device=self.device)
        return SlotBatch(hidden=torch.zeros(2 * n, width, device=self.device), input_ids=ids,
                         loss_mask=torch.ones(2 * n, dtype=torch.uint8, device=self.device),
                         cu_seqlens=torch.tensor([0, n, 2 * n], dtype=torch.int32),
                         target_ids=ids.clone() if self.cfg.label_source == "target" else None)

    # ------------------------------------------------------------------ public step
    def step(self, batch: SlotBatch | Mapping[str, torch.Tensor], batch_ids: list[int],
             checked: bool = False) -> dict[str, Any]:
        """Train on one packed micro-batch, a ``shared.transport.slot_batch.SlotBatch`` (``hidden [T, n*H]``,
        ``input_ids [T] int32``, ``loss_mask [T] uint8``, ``cu_seqlens [S+1] int32``; with ``label_source="target"``
        also ``target_ids [T] int32`` and, with ``distill_topk``, ``target_topk_ids``/``target_topk_logprobs [T,
        K]``) or a mapping of its field names (tests, benchmarks), identified by ``batch_ids``. Tensors may be on
        the host or the device; ``checked=True`` says ``check_batch`` already passed (the consumer runs it on the
        slot's host views before the copy).

        Every ``grad_accum``-th call takes the optimizer step (all ranks must call ``step`` the same
        number of times) and returns the window's group-wide metrics with ``optimizer_step=True`` and
        ``batch_ids`` = every rank's ids of the window. Other calls return this micro-batch's local
        metrics with ``optimizer_step=False``. Keys: ``step``, ``loss``, ``per_slot_acc`` (DFlash: slots 1..B-1;
        EAGLE-3: ``per_step_acc``, TTT steps 0..K-1),
        ``accept_proxy``, ``num_tokens``, ``tokens_per_s``, ``skipped``, ``optimizer_step``, ``batch_ids``,
        ``lr``, ``grad_norm``, ``num_blocks``, ``time``. Raises ``BadBatch`` for a malformed batch and
        after ``max_nonfinite_in_row`` non-finite windows in a row.
        """
        if self._background is not None:
            if not self._background_batch_ready.is_set():  # the first real batch: the background pass's second
                b = as_batch(batch)
                self._background_batch = dataclasses.replace(b.map_tokens(lambda x: to_device(x, self.device).clone()),
                                                             cu_seqlens=b.cu_seqlens.clone())
                self._background_batch_ready.set()
            self._take_compiled_form()
        if self._window_t0 is None:
            self._window_t0 = time.perf_counter()
        ids = [int(x) for x in batch_ids]
        local = self._forward_backward(batch, ids, checked=checked)
        self._stats.add(local)
        self._window_ids += ids
        self.micro_step += 1
        if self.micro_step % self.cfg.grad_accum:
            m = self._metrics(local.host(), ids, time.perf_counter() - self._window_t0)
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
            dist.all_reduce(stats.flat(), group=self.pg)
            offset = 0
            for p in self.params:
                n = p.numel()
                p.grad = flat[offset:offset + n].view_as(p).to(p.dtype)
                offset += n
        sums = stats.host()
        weight_sum = float(sums["weight_sum"])
        nonfinite = float(sums["nonfinite"]) > 0
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
        m = self._metrics(sums, all_ids, elapsed)
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

    def _metrics(self, sums: dict[str, Any], ids: list[int], elapsed_s: float) -> dict[str, Any]:
        """The metrics record of a window (``sums``: ``StepStats.host()``): the family's named metrics (loss,
        per-position accuracy, acceptance proxy, and whatever else it measures) and the trainer's own."""
        fam = self.family.step_metrics(sums)
        return {
            "step": self.step_count,
            **fam,
            "num_blocks": int(sums["num_blocks"]),
            "num_tokens": int(sums["num_tokens"]),
            "tokens_per_s": sums["num_tokens"] / elapsed_s if elapsed_s > 0 else None,
            "batch_ids": list(ids),
            "lr": self.optimizer.param_groups[0]["lr"],
            "time": time.time(),
        }

    def _log_metrics(self, m: dict[str, Any]) -> None:
        if not self._write_metrics:
            return
        self._run.append_metrics(MetricsRecord.from_json(m))

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

    def _field_default(self, name: str):
        import dataclasses
        for f in dataclasses.fields(self.dcfg):
            if f.name == name:
                return f.default if f.default is not dataclasses.MISSING else None
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of ``state_dict``. Raises ``ValueError`` when the drafter config differs (layer ids,
        block size, shapes), or when the saved trainable weights are not exactly this drafter's (a frozen tensor, and
        what the model's ``load_trainable`` refuses: a name missing or unexpected, a tensor of another shape; each
        named) before any weight is copied: a checkpoint of another drafter must not be continued silently."""
        kind = state.get("drafter", "dflash")  # checkpoints before the drafter field held DFlash
        if kind != self.kind:
            raise ValueError(f"checkpoint holds a {kind} drafter, this run trains {self.kind}")
        saved = state.get("drafter_config", state.get("dflash_config"))  # dflash_config: checkpoints before 0.2
        mine = self.dcfg.to_dict()
        if saved is not None:  # a field added since the checkpoint was written counts as its default
            saved = {**{k: v for k, v in mine.items() if k not in saved and v == self._field_default(k)}, **saved}
        if saved is not None and saved != mine:
            diff = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
            raise ValueError(f"checkpoint drafter config differs from this run in {diff}")
        frozen = sorted(set(state["model"]) & set(self.model.frozen_state_dict()))
        if frozen:  # the model's load_trainable ignores frozen keys; a trainer state must not hold them
            raise ValueError(f"checkpoint holds weights this {self.kind} drafter does not train: {frozen}")
        self.model.load_trainable(state["model"], "checkpoint")
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
        root = Path(checkpoints_dir) if checkpoints_dir is not None else self._run.checkpoints_dir
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
        self.family.check_resume(self.model, tensors, f"checkpoint {step_dir}")
        frozen = set(self.model.frozen_state_dict())
        state["model"] = {k: v for k, v in tensors.items() if k not in frozen}
        self.load_state_dict(state)
        if self._write_metrics:
            self._run.keep_metrics_before(self.step_count)
        logger.info("resumed step=%d from=%s trained_batches=%d", self.step_count, step_dir,
                    len(self.trained_batch_ids))
        return step_dir
