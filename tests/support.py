"""What several test modules share: the checkout's paths, a small tokenized dataset, packed batches computed in
the test's own process, and stand-ins that production code does not need.

Nothing here starts a process; helpers that drive the real launcher are in ``tests/system/launcher_util.py``.
"""

from __future__ import annotations

import contextlib
import os
import sysconfig
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import torch

from specring.shared.paths import DEFAULT_TARGET

REPO = Path(__file__).resolve().parents[1]  # the checkout: launch.py, and the PYTHONPATH of helper processes
TARGET = DEFAULT_TARGET                     # the fixture target, assets/tiny-code-lm


# ------------------------------------------------------------------------------------------------ data
def make_dataset(path: Path, num_samples: int = 48, seed: int = 0) -> Path:
    """A small tokenized dataset of real stdlib code (fixture tokenizer), lengths 48..128, written as Arrow."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TARGET))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((stdlib / name).read_text() for name in ("textwrap.py", "bisect.py", "heapq.py", "shlex.py"))
    ids = np.asarray(tok(text)["input_ids"], dtype=np.int32)
    rng = np.random.default_rng(seed)
    rows, masks, src = [], [], []
    pos = 0
    for i in range(num_samples):
        n = int(rng.integers(48, 129))
        if pos + n > len(ids):
            pos = 0
        rows.append(ids[pos:pos + n].tolist())
        masks.append([1] * n)
        src.append(i)
        pos += n
    table = pa.table({
        "input_ids": pa.array(rows, type=pa.list_(pa.int32())),
        "loss_mask": pa.array(masks, type=pa.list_(pa.uint8())),
        "source_file": pa.array([0] * num_samples, type=pa.int32()),
        "source_row": pa.array(src, type=pa.int64()),
    })
    path.parent.mkdir(parents=True, exist_ok=True)
    with ipc.new_file(str(path), table.schema) as w:
        w.write_table(table)
    return path


def windows(ds, count: int, seq_len: int, first: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` windows of ``seq_len`` tokens from rows spread over ``ds`` (middle third of each row), as
    ``(input_ids [seq_len], loss_mask [seq_len])`` pairs."""
    rows = [i for i in range(len(ds)) if ds.lengths[i] >= seq_len]
    stride = max(1, len(rows) // (count + first))
    out = []
    for r in rows[first * stride::stride][:count]:
        ids, lm = ds[r]
        s = (len(ids) - seq_len) // 3
        out.append((torch.from_numpy(ids[s:s + seq_len].copy()), torch.from_numpy(lm[s:s + seq_len].copy())))
    assert len(out) == count
    return out


# ------------------------------------------------------------------------------------------------ batches
@torch.no_grad()
def make_batch_in_process(target_model, sequences: list[tuple[torch.Tensor, torch.Tensor]],
                          target_layer_ids: list[int], target_ids: bool = False) -> dict[str, torch.Tensor]:
    """A packed batch computed in this process (the producer does this in a run).

    ``target_model``: a Hugging Face causal LM; ``sequences``: ``(input_ids [L], loss_mask [L])`` pairs.
    Returns ``hidden [T, n*H]`` (model dtype; layer id ``i`` = ``hidden_states[i + 1]``), ``input_ids
    [T] int32``, ``loss_mask [T] uint8``, ``cu_seqlens [S+1] int32`` and, with ``target_ids=True``,
    ``target_ids [T] int32`` (argmax of the logits). Sequences are right-padded into one forward (a causal
    model's real positions do not see the padding).
    """
    dev = next(target_model.parameters()).device
    lens = [int(s[0].numel()) for s in sequences]
    pad = torch.zeros(len(sequences), max(lens), dtype=torch.long)
    att = torch.zeros_like(pad)
    for i, (ids, _) in enumerate(sequences):
        pad[i, :lens[i]] = ids.long()
        att[i, :lens[i]] = 1
    out = target_model(input_ids=pad.to(dev), attention_mask=att.to(dev), output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1] for i in target_layer_ids], dim=-1)
    hidden = torch.cat([feats[i, :lens[i]] for i in range(len(sequences))])
    cu = torch.zeros(len(sequences) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    out_batch = {
        "hidden": hidden.contiguous(),
        "input_ids": torch.cat([s[0] for s in sequences]).to(torch.int32),
        "loss_mask": torch.cat([s[1] for s in sequences]).to(torch.uint8),
        "cu_seqlens": cu,
    }
    if target_ids:
        greedy = out.logits.argmax(-1)
        out_batch["target_ids"] = torch.cat([greedy[i, :lens[i]] for i in range(len(sequences))]).to(torch.int32).cpu()
    return out_batch


def cat_batches(bs: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One packed batch made of the packed batches ``bs`` (``cu_seqlens`` offset accordingly)."""
    cu = [0]
    for b in bs:
        cu += [cu[-1] + int(x) for x in b["cu_seqlens"][1:]]
    out = {"hidden": torch.cat([b["hidden"] for b in bs]), "input_ids": torch.cat([b["input_ids"] for b in bs]),
           "loss_mask": torch.cat([b["loss_mask"] for b in bs]), "cu_seqlens": torch.tensor(cu, dtype=torch.int32)}
    if all("target_ids" in b for b in bs):
        out["target_ids"] = torch.cat([b["target_ids"] for b in bs])
    return out


@torch.no_grad()
def evaluate_batch(trainer, batch: dict[str, torch.Tensor], batch_ids: list[int]) -> dict[str, Any]:
    """Loss and accuracy metrics of ``trainer`` (a ``consumer.trainer.Trainer``) on ``batch`` without any
    update (the same anchors as training would draw for these ``batch_ids``); keys as in ``Trainer.step``.
    Nothing is all-reduced or logged."""
    was_training = trainer.model.training
    trainer.model.eval()
    try:
        t0 = time.perf_counter()
        ids = [int(x) for x in batch_ids]
        stats = trainer._forward_backward(batch, ids, backward=False)
        return trainer._metrics(stats.host(), ids, time.perf_counter() - t0)
    finally:
        trainer.model.train(was_training)


# ------------------------------------------------------------------------------------------------ targets
# Tiny random targets of the shapes users train for now, built from transformers' own config classes (no download):
# hybrid linear-attention stacks (Gated DeltaNet layers with a full-attention layer every third), mixture-of-experts
# MLPs, and sliding-window attention. initializer_range 0.2 makes their greedy continuations vary (at transformers'
# default 0.02 a random stack of this width repeats one token), so that drafts are accepted and rejected.
TINY_TARGETS = ("qwen3_5", "qwen3_next", "qwen3_moe", "qwen3_5_moe", "qwen3_sliding")
_HYBRID = ["linear_attention", "linear_attention", "full_attention"]


def tiny_target_config(kind: str, vocab_size: int = 8192, num_layers: int = 6, **overrides):
    """The transformers config of a tiny target of ``kind`` (``TINY_TARGETS``): hidden 32, ``num_layers`` layers
    (hybrid kinds: linear, linear, full, repeated), 2 attention heads of 16, 4 experts of which 2 per token for
    the MoE kinds, sliding windows of 6 tokens on every other layer for ``qwen3_sliding``. ``overrides`` go to the
    config class. Raises ``ValueError`` for an unknown kind."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3Config, Qwen3MoeConfig, Qwen3NextConfig

    common = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=num_layers, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
                  initializer_range=0.2, pad_token_id=3, bos_token_id=0, eos_token_id=0)
    linear = dict(linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                  linear_conv_kernel_dim=4, layer_types=(_HYBRID * num_layers)[:num_layers])
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    if kind == "qwen3_5":
        return Qwen3_5TextConfig(intermediate_size=64, **linear, **{**common, **overrides})
    if kind == "qwen3_next":
        return Qwen3NextConfig(intermediate_size=64, shared_expert_intermediate_size=16, decoder_sparse_step=1,
                               **moe, **linear, **{**common, **overrides})
    if kind == "qwen3_5_moe":  # publishes no dense intermediate_size (shared.models.target_config.text_config)
        return Qwen3_5MoeTextConfig(shared_expert_intermediate_size=16, **moe, **linear, **{**common, **overrides})
    if kind == "qwen3_moe":
        return Qwen3MoeConfig(intermediate_size=64, decoder_sparse_step=1, **moe, **{**common, **overrides})
    if kind == "qwen3_sliding":
        return Qwen3Config(intermediate_size=64, sliding_window=6, use_sliding_window=True,
                           layer_types=(["sliding_attention", "full_attention"] * num_layers)[:num_layers],
                           **{**common, **overrides})
    raise ValueError(f"tiny_target_config: unknown kind {kind!r} (known: {', '.join(TINY_TARGETS)})")


def tiny_target(kind: str, seed: int = 0, **kwargs):
    """A tiny random causal LM of ``kind`` (``tiny_target_config``), float32, eval mode, gradients off; the
    global RNG is left as it was."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_target_config(kind, **kwargs)).float().eval()
    model.requires_grad_(False)
    return model


def write_tiny_target(path: Path, kind: str, seed: int = 0, **kwargs) -> Path:
    """``tiny_target(kind)`` saved as a checkpoint directory (safetensors, ``config.json``) with the fixture's
    tokenizer (assets/tiny-code-lm), as Hugging Face saves one: a target ``launch.py train`` takes."""
    import shutil

    tiny_target(kind, seed, **kwargs).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TARGET / name, Path(path) / name)
    return Path(path)


# ------------------------------------------------------------------------------------------------ decoding
class NoDraftProposer:
    """Proposes nothing: speculative decoding degenerates to one token per target forward (τ = 1)."""

    name = "no-draft"
    needs_features = False

    def reset(self, prompt_ids: list[int]) -> None:
        pass

    def add_context(self, features, positions) -> None:
        pass

    def propose(self, tokens: list[int], k: int) -> list[int]:
        return []


@contextlib.contextmanager
def temp_ring(num_slots: int, slot_bytes: int):
    """A real shared-memory ring of ``num_slots`` slots of ``slot_bytes`` bytes under a fresh run id, closed and
    unlinked at the end; then asserts that its segment is gone from ``/dev/shm``."""
    from specring.shared.transport import ring

    r = ring.Ring.create(ring.segment_name(ring.new_run_id(), "ut"), num_slots=num_slots, slot_bytes=slot_bytes)
    try:
        yield r
    finally:
        r.close()
        r.unlink()
    assert not os.path.exists(os.path.join(ring.SHM_DIR, r.name))


def stdlib_prompts(names, start: int, lengths) -> list[list[int]]:
    """Prompts from held-out stdlib files (the fixture target never trained on them): file ``names[i]`` tokenized
    by the fixture's tokenizer, tokens ``start .. start + lengths[i]``. Raises ``AssertionError`` for a file the
    fixture trained on."""
    from transformers import AutoTokenizer

    from specring.shared.data.demo import is_heldout
    tok = AutoTokenizer.from_pretrained(str(TARGET))
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for name, n in zip(names, lengths):
        assert is_heldout(name), name
        out.append(tok((root / name).read_text(encoding="utf-8"))["input_ids"][start:start + n])
    return out
