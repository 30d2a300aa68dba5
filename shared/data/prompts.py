"""Held-out prompts from a token dataset: the first tokens of samples spread evenly over the file
(``load_prompts``), as ``launch.py eval`` and τ during training decode them."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from specring.shared.data.dataset import TokenDataset

logger = logging.getLogger(__name__)


def load_prompts(path: str | Path, num_prompts: int, prompt_len: int) -> list[list[int]]:
    """The first ``prompt_len`` tokens of ``num_prompts`` held-out samples, spread evenly over the file.

    Only samples with more than ``prompt_len`` tokens are used (a continuation exists). Raises
    ``ValueError`` naming the file when none is long enough; logs when fewer than asked are available.
    """
    if num_prompts < 1 or prompt_len < 1:
        raise ValueError(f"num_prompts and prompt_len must be >= 1, got {num_prompts} and {prompt_len}")
    ds = TokenDataset(path)
    eligible = np.nonzero(ds.lengths > prompt_len)[0]
    if eligible.size == 0:
        raise ValueError(f"{path}: no sample is longer than --prompt-len {prompt_len}")
    if eligible.size < num_prompts:
        logger.warning("only %d samples of %s are longer than %d tokens (asked for %d prompts)",
                       eligible.size, path, prompt_len, num_prompts)
    n = min(num_prompts, int(eligible.size))
    picks = [int(eligible[(i * eligible.size) // n]) for i in range(n)]
    return [ds[i][0][:prompt_len].astype(np.int64).tolist() for i in picks]
