"""The DFlash drafter: a few Qwen3-style decoder layers that draft a block of tokens in parallel.

Algorithm: "DFlash: Block Diffusion for Flash Speculative Decoding" (z-lab). The module layout and the
parameter names follow the public draft model definition, z-lab/dflash ``dflash/model.py``
(``DFlashDraftModel``, ``Qwen3DFlashAttention``, ``Qwen3DFlashDecoderLayer``), so that the trainable
weights export without renaming: ``fc.weight``, ``hidden_norm.weight``, ``norm.weight``,
``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``,
``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``layers.{i}.{input,post_attention}_layernorm.weight``.
Written here from the paper and that reading, not copied.

What the drafter computes:

* Context: the ``n`` captured target layers of each context token, concatenated (``[C, n*H]``), give
  ``ctx = hidden_norm(fc(ctx_hidden))`` (``fc``: ``n*H -> H``, no bias). The context is the same for
  every draft layer.
* KV injection: in every draft layer the keys and values are that layer's own ``k_proj``/``v_proj`` over
  ``[ctx ; draft tokens]`` (``k_norm`` on both); queries come only from the draft tokens. RoPE uses the
  true positions of the context tokens and of the draft tokens. Attention inside a block is bidirectional;
  which context a draft token sees is decided by the caller's mask (``consumer/blocks.py``).
* The embedding and the LM head are the target's own tensors, frozen (``requires_grad=False``), kept in
  the checkpoint's dtype, loaded by ``load_target_head`` from the target's safetensors shards without
  loading the rest of the target. Tied embeddings share one tensor. The forward refuses to run before they
  are loaded: a randomly initialised head trains "fine" and accepts nothing.

Shapes: everything is packed, without a batch dimension. ``Q`` draft tokens (``A`` blocks of ``B``), ``C``
context tokens, ``H`` hidden size, ``V`` vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specring.shared.models.draft_attention import (
    FlexMask,
    block_attention,
    flex_attention_fn,
)
from specring.shared.models.target import resolve_layer_ids
from specring.shared.models.target_config import read_target_config, text_config

logger = logging.getLogger(__name__)


EMBED_KEY = "embed_tokens.weight"


HEAD_KEY = "lm_head.weight"


FROZEN_KEYS = (EMBED_KEY, HEAD_KEY)


def _rope_theta(cfg: dict) -> float:
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


def resolve_mask_token_id(target_dir: str | Path, trust_remote_code: bool = False) -> int:
    """The default mask token: the tokenizer's mask token, else its pad token (the choice is logged).

    The tokenizer is loaded through ``shared.hub.load_pretrained`` (``trust_remote_code``: the tokenizer's own
    code may run). Raises ``ValueError`` when the tokenizer has neither (pass ``mask_token_id`` explicitly then).
    """
    from specring.shared.hub import load_pretrained

    tok = load_pretrained("tokenizer", target_dir, trust_remote_code=trust_remote_code)
    if getattr(tok, "mask_token_id", None) is not None:
        logger.info("mask_token source=tokenizer.mask_token token=%r id=%d", tok.mask_token, tok.mask_token_id)
        return int(tok.mask_token_id)
    if getattr(tok, "pad_token_id", None) is not None:
        logger.info("mask_token source=tokenizer.pad_token token=%r id=%d", tok.pad_token, tok.pad_token_id)
        return int(tok.pad_token_id)
    raise ValueError(f"mask_token_id: the tokenizer in {target_dir} has neither a mask nor a pad token; set it")


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


@dataclass
class DFlashConfig(DraftConfigDict):
    """Shape and conventions of a DFlash drafter (serialised as ``dflash_config.json`` in checkpoints).

    ``num_hidden_layers`` is the number of *draft* layers; ``num_target_layers`` (``n``) the number of
    captured target layers, ``len(target_layer_ids)``. ``target_layer_ids`` follow the DFlash convention
    (id ``i`` = output of target decoder layer ``i``).
    """
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    max_position_embeddings: int
    target_layer_ids: list[int]
    num_target_layers: int
    block_size: int = 16
    mask_token_id: int = 0
    target_model_type: str = "qwen3"
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02

    def __post_init__(self):
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if self.num_target_layers != len(self.target_layer_ids):
            raise ValueError(f"num_target_layers: {self.num_target_layers} != len(target_layer_ids) "
                             f"{len(self.target_layer_ids)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads: {self.num_key_value_heads} does not divide "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim: must be even for RoPE, got {self.head_dim}")
        if self.block_size < 2:
            raise ValueError(f"block_size: must be >= 2, got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id: {self.mask_token_id} outside the vocabulary 0..{self.vocab_size - 1}")

    @classmethod
    def from_target(cls, target_dir: str | Path, target_layer_ids: list[int] | None, block_size: int = 16,
                    mask_token_id: int | None = None, num_draft_layers: int | None = None,
                    num_target_layers: int = 5, trust_remote_code: bool = False) -> "DFlashConfig":
        """Size a drafter like the target in ``target_dir`` (its ``config.json``).

        ``target_layer_ids=None`` -> ``default_target_layer_ids(L, num_target_layers)`` (the producer's
        ``producers.target`` definitions, so both sides pick and validate the same layers).
        ``num_draft_layers=None`` -> one draft layer per captured layer. ``mask_token_id=None`` ->
        ``resolve_mask_token_id(target_dir, trust_remote_code)``. Raises ``ConfigError`` (a ``ValueError``) for
        layer ids outside the target or repeated.
        """
        raw = read_target_config(target_dir)
        cfg = text_config(raw)
        num_layers = int(cfg["num_hidden_layers"])
        target_layer_ids = resolve_layer_ids(num_layers, target_layer_ids, num_target_layers, exact=False)
        if mask_token_id is None:
            mask_token_id = resolve_mask_token_id(target_dir, trust_remote_code)
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(num_draft_layers or len(target_layer_ids)),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(cfg),
            vocab_size=int(cfg["vocab_size"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            target_layer_ids=list(target_layer_ids),
            num_target_layers=len(target_layer_ids),
            block_size=int(block_size),
            mask_token_id=int(mask_token_id),
            target_model_type=str(cfg.get("model_type", raw.get("model_type", "qwen3"))),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
            initializer_range=float(cfg.get("initializer_range", 0.02)),
        )


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: ``weight * (x / rms(x))``, the normalisation computed in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
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


class DFlashAttention(nn.Module):
    """Attention whose keys/values cover ``[context ; draft tokens]`` and whose queries are the draft tokens."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values of ``x [N, H]`` -> two ``[kv_heads, N, head_dim]`` tensors."""
        n = x.shape[0]
        k = self.k_norm(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)).transpose(0, 1)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim).transpose(0, 1)
        return apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, ctx_kv: tuple[torch.Tensor, torch.Tensor], cos: torch.Tensor,
                sin: torch.Tensor, attn_mask: torch.Tensor | None, block_size: int | None = None) -> torch.Tensor:
        """``x [Q, H]`` draft stream (already normed); ``ctx_kv`` from ``project_kv`` of the context;
        ``cos/sin [Q, D]`` of the draft positions. Dense form (``block_size=None``): ``attn_mask [Q, C+Q]
        bool`` (True = may attend) or None (everything visible). Structured form (``block_size=B``):
        ``attn_mask [Q, C]`` is the context mask and each run of ``B`` draft tokens sees exactly itself
        (``block_attention``). Flex form (``attn_mask`` a ``consumer.blocks.FlexMask``): ``x`` and the context
        are already padded to the mask's ``q_len``/``ctx_len`` and ``flex_attention`` runs the block-sparse
        pattern (compiled on CUDA). Returns ``[Q, H]``."""
        q_len = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(q_len, self.num_heads, self.head_dim)).transpose(0, 1)
        q = apply_rope(q, cos, sin)
        k_blk, v_blk = self.project_kv(x, cos, sin)
        if isinstance(attn_mask, FlexMask):
            dt = v_blk.dtype  # the matmul dtype (bfloat16 under autocast); norms and RoPE return float32
            k = torch.cat([ctx_kv[0].to(dt), k_blk.to(dt)], dim=1)[None]
            v = torch.cat([ctx_kv[1].to(dt), v_blk], dim=1)[None]
            out = flex_attention_fn(q.is_cuda)(q.to(dt)[None], k, v, block_mask=attn_mask.block_mask,
                                               enable_gqa=self.num_heads != self.num_kv_heads)[0]
            return self.o_proj(out.transpose(0, 1).reshape(q_len, self.num_heads * self.head_dim))
        if block_size is not None:
            out = block_attention(q, ctx_kv[0].to(k_blk.dtype), ctx_kv[1].to(v_blk.dtype), k_blk, v_blk,
                                  attn_mask, block_size)
            return self.o_proj(out.transpose(0, 1).reshape(q_len, self.num_heads * self.head_dim))
        k = torch.cat([ctx_kv[0].to(k_blk.dtype), k_blk], dim=1)
        v = torch.cat([ctx_kv[1].to(v_blk.dtype), v_blk], dim=1)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=0)
            v = v.repeat_interleave(groups, dim=0)
        mask = None if attn_mask is None else attn_mask[None, None]
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask)
        return self.o_proj(out[0].transpose(0, 1).reshape(q_len, self.num_heads * self.head_dim))


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


class DFlashDecoderLayer(nn.Module):
    """Pre-norm decoder layer: ``x + attn(ln(x), ctx)`` then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, ctx_kv, cos, sin, attn_mask, block_size=None):
        x = x + self.self_attn(self.input_layernorm(x), ctx_kv, cos, sin, attn_mask, block_size)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class DraftCache:
    """Per-layer keys/values of the context tokens fed so far (inference only).

    ``keys[i]``/``values[i]``: ``[kv_heads, C, head_dim]`` for draft layer ``i``; ``positions``: ``[C]``.
    Only context enters the cache, never a draft block, so after a verify step the caller simply feeds
    the newly accepted tokens' target hidden states as the next context. ``crop(n)`` keeps the first
    ``n`` context tokens (to roll back context that was fed but then rejected).
    """
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    positions: torch.Tensor

    @property
    def length(self) -> int:
        return int(self.positions.shape[0])

    def crop(self, length: int) -> "DraftCache":
        if not 0 <= length <= self.length:
            raise ValueError(f"crop length {length} outside 0..{self.length}")
        self.keys = [k[:, :length] for k in self.keys]
        self.values = [v[:, :length] for v in self.values]
        self.positions = self.positions[:length]
        return self


class DFlashDrafter(nn.Module):
    """DFlash draft model; see the module docstring for what it computes and where it comes from.

    Trainable parameters: everything except ``embed_tokens.weight`` and ``lm_head.weight`` (frozen, the
    target's; one shared tensor when the target ties them). ``trainable_state_dict()`` is the export set.
    """

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_target_layers * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        # Frozen placeholders: replaced by the target's tensors in load_target_head / load_frozen.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False)
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(False)
        self.head_loaded = False
        self.reset_parameters()

    # ------------------------------------------------------------------ weights
    def reset_parameters(self) -> None:
        """Trainable linears ~ N(0, initializer_range), norms = 1 (Qwen3 initialisation)."""
        std = self.config.initializer_range
        for name, module in self.named_modules():
            if name in ("embed_tokens", "lm_head"):
                continue
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The trainable weights under their export names (no embedding, no LM head)."""
        return {n: p.detach() for n, p in self.named_parameters() if n not in FROZEN_KEYS}

    def frozen_state_dict(self) -> dict[str, torch.Tensor]:
        """``embed_tokens.weight`` and ``lm_head.weight`` (separate keys even when tied)."""
        return {EMBED_KEY: self.embed_tokens.weight.detach(), HEAD_KEY: self.lm_head.weight.detach()}

    def load_trainable(self, tensors: dict[str, torch.Tensor], source: str) -> None:
        """Copy the trainable weights from ``tensors`` (export names, frozen keys ignored), cast to each
        parameter's dtype. Raises ``ValueError`` naming ``source`` and the missing/unexpected keys unless
        the set of trainable keys matches exactly."""
        trainable = {k: v for k, v in tensors.items() if k not in FROZEN_KEYS}
        expected = set(self.trainable_state_dict())
        if set(trainable) != expected:
            raise ValueError(f"{source}: weights do not match the drafter config: missing "
                             f"{sorted(expected - set(trainable))}, unexpected {sorted(set(trainable) - expected)}")
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name in trainable:
                    p.copy_(trainable[name].to(p.dtype))

    def load_frozen(self, embed: torch.Tensor, head: torch.Tensor | None) -> None:
        """Install the target's embedding ``[V, H]`` and LM head ``[V, H]`` (``head=None``: tied), frozen,
        bit for bit in their own dtype. Raises ``ValueError`` on a shape mismatch."""
        v, h = self.config.vocab_size, self.config.hidden_size
        for name, t in (("embedding", embed), ("lm_head", head)):
            if t is not None and tuple(t.shape) != (v, h):
                raise ValueError(f"target {name} has shape {tuple(t.shape)}, drafter expects ({v}, {h})")
        device = self.fc.weight.device
        self.embed_tokens.weight = nn.Parameter(embed.detach().clone().to(device), requires_grad=False)
        if head is None:
            self.lm_head.weight = self.embed_tokens.weight
        else:
            self.lm_head.weight = nn.Parameter(head.detach().clone().to(device), requires_grad=False)
        self.head_loaded = True

    def load_target_head(self, target_dir: str | Path) -> None:
        """Copy the target's embedding and LM head from its safetensors shards (only those tensors).

        Reads ``model.safetensors.index.json`` (or a single ``model.safetensors``) and opens only the
        shards that hold the two tensors. With ``tie_word_embeddings`` (or no separate head in the
        checkpoint) the head is the embedding. Raises ``FileNotFoundError``/``KeyError`` naming what is
        missing.
        """
        embed, head = read_target_head(target_dir, self.config.tie_word_embeddings)
        self.load_frozen(embed, head)
        logger.info("target_head loaded dir=%s dtype=%s tied=%s", target_dir, embed.dtype, head is None)

    # ------------------------------------------------------------------ forward
    def _check_ready(self) -> None:
        if not self.head_loaded:
            raise RuntimeError("DFlashDrafter: target embedding/LM head not loaded (call load_target_head)")

    def _compute_dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[N, H]`` in the compute dtype, from the frozen target embedding."""
        self._check_ready()
        return F.embedding(ids, self.embed_tokens.weight).to(self._compute_dtype())

    def project_context(self, ctx_hidden: torch.Tensor) -> torch.Tensor:
        """``[C, n*H]`` target features -> ``[C, H]`` context ``hidden_norm(fc(.))``."""
        return self.hidden_norm(self.fc(ctx_hidden.to(self._compute_dtype())))

    def _rope(self, positions: torch.Tensor):
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)

    def forward(self, block_input_ids: torch.Tensor, block_positions: torch.Tensor, ctx_hidden: torch.Tensor,
                ctx_positions: torch.Tensor, attn_mask: torch.Tensor | None,
                block_size: int | None = None) -> torch.Tensor:
        """Draft-token hidden states.

        ``block_input_ids [Q] long`` (anchor then mask tokens per block), ``block_positions [Q] long``
        (positions inside their sequence), ``ctx_hidden [C, n*H]``, ``ctx_positions [C] long``,
        ``attn_mask [Q, C+Q] bool`` (True = may attend; columns are context then draft tokens) or None;
        or, with ``block_size=B``, the context mask ``[Q, C]`` alone (each block of B draft tokens then
        sees exactly itself; ``block_attention``), which needs ``Q*(C+B)`` scores instead of ``Q*(C+Q)``;
        or a ``consumer.blocks.FlexMask`` (``build_flex_mask``): block-sparse ``flex_attention``, about
        ``Q*(context before the anchor + B)`` scores, the training form on CUDA.
        Returns ``[Q, H]`` after the final norm; ``logits()`` maps it to the vocabulary.
        """
        ctx = self.project_context(ctx_hidden)
        if isinstance(attn_mask, FlexMask):  # pad queries and context to the mask's tile multiples
            q_pad, c_pad = attn_mask.q_len - block_input_ids.shape[0], attn_mask.ctx_len - ctx.shape[0]
            block_input_ids = F.pad(block_input_ids, (0, q_pad), value=self.config.mask_token_id)
            block_positions = F.pad(block_positions, (0, q_pad))
            ctx, ctx_positions = F.pad(ctx, (0, 0, 0, c_pad)), F.pad(ctx_positions, (0, c_pad))
        x = self.embed(block_input_ids)
        cos_q, sin_q = self._rope(block_positions)
        cos_c, sin_c = self._rope(ctx_positions)
        for layer in self.layers:
            ctx_kv = layer.self_attn.project_kv(ctx, cos_c, sin_c)
            x = layer(x, ctx_kv, cos_q, sin_q, attn_mask, block_size)
        x = self.norm(x)
        return x[:attn_mask.num_queries] if isinstance(attn_mask, FlexMask) else x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` -> ``[..., V]`` through the frozen target LM head."""
        self._check_ready()
        w = self.lm_head.weight
        if not torch.is_autocast_enabled(hidden.device.type):
            w = w.to(hidden.dtype)  # under autocast the bf16 head is used as is: no [V, H] float32 copy
        return F.linear(hidden, w)

    # ------------------------------------------------------------------ inference
    def extend_cache(self, ctx_hidden: torch.Tensor, ctx_positions: torch.Tensor,
                     cache: DraftCache | None = None) -> DraftCache:
        """Append context tokens (``ctx_hidden [C, n*H]`` at ``ctx_positions [C]``) to ``cache``
        (a new one when None) and return it. Each layer's context keys/values depend only on the
        projected context, so caching them is exact."""
        if cache is None:
            dev = self.fc.weight.device
            empty = torch.empty(self.config.num_key_value_heads, 0, self.config.head_dim, device=dev,
                                dtype=self._compute_dtype())
            cache = DraftCache([empty] * len(self.layers), [empty] * len(self.layers),
                               torch.empty(0, dtype=torch.long, device=dev))
        if ctx_hidden.shape[0] == 0:
            return cache
        ctx = self.project_context(ctx_hidden)
        cos, sin = self._rope(ctx_positions)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.project_kv(ctx, cos, sin)
            cache.keys[i] = torch.cat([cache.keys[i], k.to(cache.keys[i].dtype)], dim=1)
            cache.values[i] = torch.cat([cache.values[i], v.to(cache.values[i].dtype)], dim=1)
        cache.positions = torch.cat([cache.positions, ctx_positions.to(cache.positions)])
        return cache

    @torch.no_grad()
    def draft_block(self, ctx_hidden: torch.Tensor, ctx_positions: torch.Tensor, anchor_token: int,
                    anchor_pos: int, cache: DraftCache | None = None,
                    block_size: int | None = None) -> tuple[torch.Tensor, DraftCache]:
        """Draft one block for speculative decoding.

        Feeds the new context (``ctx_hidden [C, n*H]`` at ``ctx_positions [C]``; may be empty) into the
        cache, then runs the block ``[anchor_token, MASK x (B-1)]`` at positions ``anchor_pos ..
        anchor_pos + B - 1`` against every cached context token (the caller keeps the cache to context
        strictly before ``anchor_pos``: the anchor's own target state is never context). Returns
        ``(logits [B, V] float32, cache)``: row ``k >= 1`` predicts the token at ``anchor_pos + k``; row 0
        is not a prediction. Typical loop: ``logits, cache = draft_block(h[:p], pos[:p], tok[p], p)``;
        verify with the target; then ``draft_block(h_new_accepted, their_positions, bonus, p2, cache)``.
        """
        b = block_size or self.config.block_size
        cache = self.extend_cache(ctx_hidden, ctx_positions, cache)
        if cache.length and int(cache.positions.max()) >= anchor_pos:
            raise ValueError(f"draft_block: cache holds context at position {int(cache.positions.max())} "
                             f">= anchor_pos {anchor_pos}; crop it first")
        dev = self.fc.weight.device
        ids = torch.full((b,), self.config.mask_token_id, dtype=torch.long, device=dev)
        ids[0] = int(anchor_token)
        pos = torch.arange(anchor_pos, anchor_pos + b, device=dev)
        x = self.embed(ids)
        cos, sin = self._rope(pos)
        for i, layer in enumerate(self.layers):
            x = layer(x, (cache.keys[i], cache.values[i]), cos, sin, None)
        return self.logits(self.norm(x)).float(), cache


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


def build_drafter(dcfg: DFlashConfig, target_dir: str | Path | None = None, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    """A drafter with trainable weights in ``dtype`` on ``device`` and, when ``target_dir`` is given, the
    target's frozen embedding/head loaded (in the checkpoint's dtype)."""
    model = DFlashDrafter(dcfg).to(device=device, dtype=dtype)
    if target_dir is not None:
        model.load_target_head(target_dir)
    return model
