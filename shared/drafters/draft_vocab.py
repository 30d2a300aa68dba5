"""The draft vocabulary of an EAGLE-3 run: built once from the training data, stored in the run directory.

``RUN_DIR/draft_vocab.safetensors`` holds ``d2t [Vd] int64`` (offsets: draft id ``i`` is target id
``i + d2t[i]``) and ``t2d [V] bool`` (the target ids in the draft vocabulary), the format SGLang and vLLM load
(``shared.models.eagle3.build_draft_vocab``; SpecForge ``specforge/data/preprocessing.py``,
``process_token_dict_to_mappings``). Its metadata records the data it was counted on (``content_digest``) and
the sizes. The supervisor writes it before any process starts (``write_draft_vocab``) and never again on
``--resume``; every consumer reads it (``read_draft_vocab``), so all ranks train the same vocabulary.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from specring.shared.errors import ConfigError
from specring.shared.run.run_dir import DRAFT_VOCAB_FILE as DRAFT_VOCAB_FILE  # its name, for readers of this module
from specring.shared.run.run_dir import RunDir


def draft_vocab_path(run_dir: str | Path) -> Path:
    """``RUN_DIR/draft_vocab.safetensors`` (``shared.run.run_dir.RunDir.draft_vocab_file``)."""
    return RunDir(run_dir).draft_vocab_file


def write_draft_vocab(run_dir: str | Path, data_path: str | Path, vocab_size: int,
                      draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Count the loss-carrying tokens of the dataset at ``data_path`` (``TokenDataset.loss_token_counts``),
    keep the ``min(draft_vocab_size, vocab_size)`` most frequent (``build_draft_vocab``) and write them to
    ``RUN_DIR/draft_vocab.safetensors`` atomically (a temporary file renamed into place). Returns ``(d2t,
    t2d)``. Raises ``ValueError`` for token ids outside the vocabulary."""
    from safetensors.torch import save_file

    from specring.shared.data.dataset import TokenDataset
    from specring.shared.models.eagle3 import build_draft_vocab

    ds = TokenDataset(data_path)
    counts = torch.from_numpy(ds.loss_token_counts(vocab_size))
    d2t, t2d = build_draft_vocab(counts, draft_vocab_size)
    path = draft_vocab_path(run_dir)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    covered = int(counts[t2d].sum())
    save_file({"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}, str(tmp), metadata={
        "format": "pt", "data": str(Path(data_path).resolve()), "content_digest": ds.content_digest(),
        "vocab_size": str(int(vocab_size)), "draft_vocab_size": str(int(d2t.numel())),
        "loss_tokens": str(int(counts.sum())), "loss_tokens_covered": str(covered)})
    os.replace(tmp, path)
    return d2t, t2d


def read_draft_vocab(run_dir: str | Path, draft_vocab_size: int, vocab_size: int,
                     prefix: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t [Vd] int64, t2d [V] bool)`` from ``RUN_DIR/draft_vocab.safetensors``.

    Raises ``ConfigError`` naming the file when it is missing, unreadable, misshapen (not ``draft_vocab_size``
    / ``vocab_size`` entries), of the wrong dtype, or when ``t2d`` does not mark exactly the ids ``d2t`` maps to:
    a run must never train against another vocabulary than the one it started with. ``prefix`` (e.g.
    ``"--resume: "``) starts each message."""
    from safetensors import safe_open

    from specring.shared.models.eagle3 import draft_to_target

    path = draft_vocab_path(run_dir)
    if not path.is_file():
        raise ConfigError(f"{prefix}{path} is missing: it holds the draft vocabulary this EAGLE-3 run trained "
                          f"with (built once, when the run started) and cannot be rebuilt; restore it from a copy "
                          f"of the run directory or start a new run")
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise ConfigError(f"{prefix}{path} cannot be read as a draft vocabulary: {type(e).__name__}: {e}") from None
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    problem = ""
    if d2t is None or t2d is None:
        problem = f"holds {sorted(tensors)}, not d2t and t2d"
    elif tuple(d2t.shape) != (draft_vocab_size,) or tuple(t2d.shape) != (vocab_size,):
        problem = (f"d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)}, the run's drafter needs ({draft_vocab_size},) "
                   f"/ ({vocab_size},)")
    elif d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        problem = f"d2t {d2t.dtype} / t2d {t2d.dtype}, expected int64 / bool"
    elif not torch.equal(torch.nonzero(t2d).flatten(), draft_to_target(d2t)):
        problem = "t2d does not mark exactly the target ids of d2t"
    if problem:
        raise ConfigError(f"{prefix}{path} is not this run's draft vocabulary: {problem}")
    return d2t, t2d
