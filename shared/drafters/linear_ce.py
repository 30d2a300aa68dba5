"""Fused linear + cross-entropy over the LM head: the ``LinearCE`` callables ``block_loss`` may use.

The DFlash families' loss is a cross-entropy over the frozen target head (``[rows, H] @ [H, V]``, V up to 152K
for Qwen3 targets), the largest matrix product and the largest tensor of a training step when its logits are
materialised in float32 (``shared.drafters.dflash_blocks.block_loss``'s own chunked path). A maintained kernel
library computes it chunk by chunk without storing the logits; ``--trainer.fused-ce`` picks it, measured against
the own path by ``benchmarks/trainer.py --attention flex flex+fused`` (docs/performance.md).
"""

from __future__ import annotations

import importlib.util
from typing import Callable

import torch
import torch.nn.functional as F

from specring.shared.config.run_config import FUSED_CE, LIGER_AUTO_MIN_VOCAB

IGNORE = -100  # the label of a row that is not a prediction (F.cross_entropy's ignore_index)

# (x [n, H], weight [V, H], labels [n] long (-100: ignored), softcap) -> (sum of CE over labelled rows: fp32
# scalar with a gradient into x, argmax [n] long (any value where ignored))
LinearCE = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "float | None"], "tuple[torch.Tensor, torch.Tensor]"]


def torch_linear_ce_sum(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                        softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``LinearCE`` in plain torch (float32 logits materialised): the reference the fused kernels are
    tested against, and the CPU path of ``--trainer.fused-ce`` tests."""
    logits = F.linear(x, weight).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    ce = F.cross_entropy(logits, labels, reduction="sum", ignore_index=IGNORE)
    return ce, logits.detach().argmax(-1)


def liger_linear_ce_sum(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                        softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``LinearCE`` by Liger Kernel's fused linear cross-entropy (linkedin/Liger-Kernel,
    ``liger_kernel/ops/fused_linear_cross_entropy.py``, an optional dependency, CUDA only): logits computed
    chunk by chunk in the kernel and never stored, the input gradient computed in the forward (reduction
    ``sum``: a scalar upstream gradient, as ``block_loss``'s per-slot weights are), the argmax from the same
    pass. The chunk budget is set so that one chunk covers the rows (``chunk_mem_const >= V / H``), since a
    per-slot call has only ``A`` rows."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    v, h = weight.shape
    out = liger_fused_linear_cross_entropy(x, weight, labels, ignore_index=IGNORE, reduction="sum",
                                           softcap=softcap, return_predicted_tokens=True,
                                           chunk_mem_const=max(1, -(-v // h)))
    return out.loss, out.predicted_tokens


def resolve_linear_ce(choice: str, device: torch.device | str, vocab_size: int | None = None) -> LinearCE | None:
    """The ``LinearCE`` of ``--trainer.fused-ce``: ``off`` none (``block_loss``'s chunked float32 path);
    ``liger`` Liger Kernel's (``ValueError`` when not installed or not on CUDA); ``torch`` the reference (tests);
    ``auto`` Liger's on CUDA when installed and ``vocab_size`` (the head's rows; None: unknown, taken as large) is
    at least ``LIGER_AUTO_MIN_VOCAB``, else none.

    Why the vocabulary decides (docs/performance.md, "The head's loss: fused or chunked"; one H100, 2026-12-07): at
    a Qwen3-8B shape (V 151,936) the fused step is 1.10x the chunked one and 9.4 GiB smaller; at the fixture's
    (V 8,192) the two are equal alone (0.98x) but, in the recipe's pipeline (two producers and the consumer on one
    GPU), the chunked loss trains 1.35x the steps per second: Liger makes the host wait about three times per slot call
    (``B - 1`` calls per micro-batch, 53 host waits a step against 9), and each wait also waits for the producers'
    kernels queued on the shared GPU. Between the two measured sizes the threshold is a choice, not a measurement.
    """
    if choice not in FUSED_CE:
        raise ValueError(f"fused_ce: must be one of {', '.join(FUSED_CE)}, got {choice!r}")
    cuda = torch.device(device).type == "cuda"
    have = importlib.util.find_spec("liger_kernel") is not None
    if choice == "liger" and not (cuda and have):
        raise ValueError("fused_ce: liger needs a CUDA device and Liger Kernel installed (pip install liger-kernel)"
                         + ("" if have else "; it is not installed"))
    large = vocab_size is None or vocab_size >= LIGER_AUTO_MIN_VOCAB
    if choice == "liger" or (choice == "auto" and cuda and have and large):
        # imported now, before anything is compiled: the import registers pytree node types (transformers'
        # output classes), and every graph traced before a registration is guarded on the registry's size,
        # so a first import inside the first step recompiled the draft layers at the first real batch
        import liger_kernel.transformers.functional  # noqa: F401
        return liger_linear_ce_sum
    return torch_linear_ce_sum if choice == "torch" else None
