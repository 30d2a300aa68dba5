"""The building blocks every drafter family shares: RMSNorm, RoPE, the SwiGLU MLP, the RoPE base of a target's
config, the reader of the target's frozen embedding and LM head, and the ``to_dict``/``from_dict`` of drafter
config dataclasses.

Definitions as in the Llama/Qwen3 decoder (transformers ``models/qwen3/modeling_qwen3.py``: ``Qwen3RMSNorm``,
``rotate_half``/``apply_rotary_pos_emb``, ``Qwen3MLP``); written here, not copied. ``shared/models/dflash.py``,
``shared/models/dflash2.py`` and ``shared/models/eagle3.py`` build their layers from these; the export's
modelling file (``shared/drafters/dflash_hf_model.py``) inlines their source.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


class DraftConfigDict:
    """``to_dict``/``from_dict`` of a drafter's config dataclass (the checkpoint's ``*_config.json``):
    ``from_dict`` raises ``ValueError`` naming keys the dataclass does not have."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        known = {f.name for f in dataclasses.fields(cls)}
        bad = set(d) - known
        if bad:
            raise ValueError(f"unknown {cls.__name__} key(s) {sorted(bad)}")
        return cls(**d)


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: ``weight * (x / rms(x))``, the normalisation computed in float32 (``F.rms_norm`` without a
    weight: one operator instead of five, bit-equal on CPU to ``x * rsqrt(mean(x**2) + eps)``; the drafter's
    decode is bound by operator dispatch, benchmarks/decode_cycle.py)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * x32.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Default RoPE tables for ``positions [N] long`` -> ``(cos, sin)``, each ``[N, head_dim]`` float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [heads, N, D]`` by ``cos/sin [N, D]`` (rotate-half convention of Llama/Qwen)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos.to(x.dtype) + rotated * sin.to(x.dtype))


def rope_theta_from_config(cfg: dict) -> float:
    """``rope_theta`` from a transformers 4 (plain key) or 5 (``rope_parameters``) config."""
    if "rope_theta" in cfg:
        return float(cfg["rope_theta"])
    params = cfg.get("rope_parameters") or {}
    if "rope_theta" in params:
        rtype = params.get("rope_type", "default")
        if rtype not in ("default", None):
            logger.warning("rope_type=%s of the target is not reproduced by the drafter (plain RoPE used)", rtype)
        return float(params["rope_theta"])
    for sub in params.values():  # per-layer-type form: {"full_attention": {"rope_theta": ...}}
        if isinstance(sub, dict) and "rope_theta" in sub:
            return float(sub["rope_theta"])
    logger.warning("target config has no rope_theta; using 10000")
    return 10000.0


class SwiGLUMLP(nn.Module):
    """SwiGLU MLP of the Llama/Qwen decoder layer: ``down(silu(gate(x)) * up(x))``, ``[..., hidden_size]`` in and
    out, no biases (the DFlash and EAGLE-3 drafters both use it; weight names as transformers' ``mlp.*``)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _weight_index(target_dir: Path) -> dict[str, str]:
    """``tensor name -> shard file name`` for a safetensors checkpoint (sharded or single file)."""
    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = target_dir / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open
        with safe_open(str(single), framework="pt") as f:
            return {k: single.name for k in f.keys()}
    raise FileNotFoundError(f"no model.safetensors.index.json or model.safetensors in {target_dir}")


def read_target_head(target_dir: str | Path, tie_word_embeddings: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(embedding [V, H], lm_head [V, H] or None when tied)`` read from the target's safetensors.

    Looks for ``model.embed_tokens.weight`` (else any ``*embed_tokens.weight``) and ``lm_head.weight``.
    Raises ``KeyError`` naming the tensor when the checkpoint lacks it.
    """
    from safetensors import safe_open

    target_dir = Path(target_dir)
    wmap = _weight_index(target_dir)
    embed_name = "model.embed_tokens.weight"
    if embed_name not in wmap:
        cands = sorted(k for k in wmap if k.endswith("embed_tokens.weight"))
        if not cands:
            raise KeyError(f"no embed_tokens.weight in {target_dir}")
        embed_name = cands[0]
    head_name = "lm_head.weight" if "lm_head.weight" in wmap else None
    if head_name is None and not tie_word_embeddings:
        raise KeyError(f"lm_head.weight missing in {target_dir} and tie_word_embeddings is false")

    def get(name: str) -> torch.Tensor:
        with safe_open(str(target_dir / wmap[name]), framework="pt") as f:
            return f.get_tensor(name)

    embed = get(embed_name)
    head = None if (tie_word_embeddings or head_name is None) else get(head_name)
    return embed, head
