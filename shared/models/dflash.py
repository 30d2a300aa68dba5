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
  true positions of the context tokens and of the draft tokens. Attention inside a block is bidirectional
  (causal with ``is_causal``); which context a draft token sees is decided by the caller's mask
  (``shared/models/draft_attention.py``), per layer type: a ``"sliding_attention"`` layer sees only context
  within ``sliding_window`` positions of the draft token (``DFlashConfig``; ``layer_masks`` builds one mask
  per layer type and ``forward`` hands each layer its own).
* The embedding and the LM head are the target's own tensors, frozen (``requires_grad=False``), kept in
  the checkpoint's dtype, loaded by ``load_target_head`` from the target's safetensors shards without
  loading the rest of the target. Tied embeddings share one tensor. The forward refuses to run before they
  are loaded: a randomly initialised head trains "fine" and accepts nothing.

Shapes: everything is packed, without a batch dimension. ``Q`` draft tokens (``A`` blocks of ``B``), ``C``
context tokens, ``H`` hidden size, ``V`` vocabulary.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specring.shared.models import draft_attention
from specring.shared.models.building_blocks import (
    DraftConfigDict,
    RMSNorm,
    SwiGLUMLP,
    apply_rope,
    read_target_head,
    rope_cos_sin,
    rope_theta_from_config,
)
from specring.shared.models.draft_attention import (
    FlexMask,
    block_attention,
    flex_attention_fn,
)
from specring.shared.models.layer_ids import resolve_layer_ids
from specring.shared.models.target_config import read_target_config, text_config

logger = logging.getLogger(__name__)


EMBED_KEY = "embed_tokens.weight"


HEAD_KEY = "lm_head.weight"


FROZEN_KEYS = (EMBED_KEY, HEAD_KEY)


def resolve_mask_token_id(target_dir: str | Path, trust_remote_code: bool = False) -> int:
    """The default mask token: the tokenizer's mask token, else its pad token (the choice is logged).

    The tokenizer is loaded through ``shared.models.hub.load_pretrained`` (``trust_remote_code``: the tokenizer's own
    code may run). Raises ``ValueError`` when the tokenizer has neither (pass ``mask_token_id`` explicitly then).
    """
    from specring.shared.models.hub import load_pretrained

    tok = load_pretrained("tokenizer", target_dir, trust_remote_code=trust_remote_code)
    if getattr(tok, "mask_token_id", None) is not None:
        logger.info("mask_token source=tokenizer.mask_token token=%r id=%d", tok.mask_token, tok.mask_token_id)
        return int(tok.mask_token_id)
    if getattr(tok, "pad_token_id", None) is not None:
        logger.info("mask_token source=tokenizer.pad_token token=%r id=%d", tok.pad_token, tok.pad_token_id)
        return int(tok.pad_token_id)
    raise ValueError(f"mask_token_id: the tokenizer in {target_dir} has neither a mask nor a pad token; set it")


FULL_ATTENTION = "full_attention"


SLIDING_ATTENTION = "sliding_attention"


LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


@dataclass(frozen=True)
class HeadSpec:
    """The drafter's LM head as a fused loss needs it: ``logits = softcap(scale * hidden @ weight.T)``.

    ``weight [V, H]`` (the frozen target head, bf16 on CUDA), ``scale`` the output multiplier (DFlash2's
    ``output_multiplier``; 1 for DFlash), ``softcap`` ``c`` of ``c * tanh(x / c)`` or None."""
    weight: torch.Tensor
    scale: float = 1.0
    softcap: float | None = None


@dataclass
class DFlashConfig(DraftConfigDict):
    """Shape and conventions of a DFlash drafter (serialised as ``dflash_config.json`` in checkpoints).

    ``num_hidden_layers`` is the number of *draft* layers; ``num_target_layers`` (``n``) the number of
    captured target layers, ``len(target_layer_ids)``. ``target_layer_ids`` follow the DFlash convention
    (id ``i`` = output of target decoder layer ``i``).

    Attention variants (z-lab/dflash ``dflash/model.py`` ``Qwen3DFlashAttention``, commit
    10129599dffb338ff38cfd235a53ca6d3667b4dd, read, not copied; the defaults are the plain DFlash pattern):

    * ``layer_types``: one of ``"full_attention"``/``"sliding_attention"`` per draft layer (None: all full).
    * ``sliding_window`` ``W``: a sliding layer's draft token at sequence position ``P`` sees a context token at
      ``c`` only if ``P - c < W`` (besides ``c < anchor``). Must be ``>= block_size`` when a layer slides:
      the reference also windows keys inside the block, which removes nothing exactly when ``W >= B``.
    * ``is_causal``: inside a block slot ``j`` sees slots ``<= j`` only (every layer). The reference's
      ``None`` (causal exactly in the sliding layers) is not accepted: give a bool.

    Raises ``ValueError`` naming the field.
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
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    is_causal: bool = False

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
        if self.layer_types is not None:
            if isinstance(self.layer_types, str) or not all(isinstance(t, str) for t in self.layer_types):
                raise ValueError(f"layer_types: must be a list of strings, got {self.layer_types!r}")
            self.layer_types = list(self.layer_types)
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"layer_types: {len(self.layer_types)} entries for num_hidden_layers "
                                 f"{self.num_hidden_layers}")
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad:
                raise ValueError(f"layer_types: unknown layer type(s) {bad} (known: {list(LAYER_TYPES)})")
        if self.sliding_window is not None:
            w = self.sliding_window
            if isinstance(w, bool) or not isinstance(w, int) or w < 1:
                raise ValueError(f"sliding_window: must be None or an integer >= 1, got {w!r}")
        if SLIDING_ATTENTION in self.resolved_layer_types():
            if self.sliding_window is None:
                raise ValueError("sliding_window: required (an integer >= 1) when a layer is sliding_attention")
            if self.sliding_window < self.block_size:
                raise ValueError(f"sliding_window: {self.sliding_window} < block_size {self.block_size} (the "
                                 "in-block window of the reference is not reproduced; use W >= B)")
        if not isinstance(self.is_causal, bool):
            raise ValueError(f"is_causal: must be a bool, got {self.is_causal!r}")

    # ------------------------------------------------------------------ attention variants
    def resolved_layer_types(self) -> list[str]:
        """The type of every draft layer (``layer_types``, or all ``"full_attention"``)."""
        return list(self.layer_types) if self.layer_types is not None else [FULL_ATTENTION] * self.num_hidden_layers

    def layer_window(self, layer_type: str) -> int | None:
        """The context window of a layer type: ``sliding_window`` for ``"sliding_attention"``, else None."""
        return self.sliding_window if layer_type == SLIDING_ATTENTION else None

    def attention_variants(self) -> dict[str, dict]:
        """``{layer_type: {"window": W or None, "causal": is_causal}}`` for the layer types this drafter has,
        in first-use order: the mask-builder keywords of each (``layer_masks``)."""
        return {t: {"window": self.layer_window(t), "causal": self.is_causal}
                for t in dict.fromkeys(self.resolved_layer_types())}

    @property
    def plain_attention(self) -> bool:
        """True when every layer is full attention and not causal: one mask serves every layer (today's form)."""
        return not self.is_causal and all(t == FULL_ATTENTION for t in self.resolved_layer_types())

    # ------------------------------------------------------------------ construction
    @classmethod
    def _target_fields(cls, target_dir: str | Path, target_layer_ids: list[int] | None, block_size: int,
                       mask_token_id: int | None, num_draft_layers: int | None, num_target_layers: int,
                       trust_remote_code: bool, sliding_window: int | None, layer_types: str | list[str] | None,
                       is_causal: bool) -> dict:
        """The constructor keywords of ``from_target`` (shared with ``DFlash2Config.from_target``)."""
        raw = read_target_config(target_dir)
        cfg = text_config(raw)
        num_layers = int(cfg["num_hidden_layers"])
        target_layer_ids = resolve_layer_ids(num_layers, target_layer_ids, num_target_layers, exact=False)
        if mask_token_id is None:
            mask_token_id = resolve_mask_token_id(target_dir, trust_remote_code)
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        num_hidden_layers = int(num_draft_layers or len(target_layer_ids))
        if isinstance(layer_types, str):
            layer_types = [layer_types] * num_hidden_layers
        return dict(
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta_from_config(cfg),
            vocab_size=int(cfg["vocab_size"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            target_layer_ids=list(target_layer_ids),
            num_target_layers=len(target_layer_ids),
            block_size=int(block_size),
            mask_token_id=int(mask_token_id),
            target_model_type=str(cfg.get("model_type", raw.get("model_type", "qwen3"))),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
            initializer_range=float(cfg.get("initializer_range", 0.02)),
            layer_types=None if layer_types is None else list(layer_types),
            sliding_window=None if sliding_window is None else sliding_window,
            is_causal=is_causal,
        )

    @classmethod
    def from_target(cls, target_dir: str | Path, target_layer_ids: list[int] | None, block_size: int = 16,
                    mask_token_id: int | None = None, num_draft_layers: int | None = None,
                    num_target_layers: int = 5, trust_remote_code: bool = False,
                    sliding_window: int | None = None, layer_types: str | list[str] | None = None,
                    is_causal: bool = False) -> "DFlashConfig":
        """Size a drafter like the target in ``target_dir`` (its ``config.json``).

        ``target_layer_ids=None`` -> ``default_target_layer_ids(L, num_target_layers)`` (the producer's
        ``shared.models.target`` definitions, so both sides pick and validate the same layers).
        ``num_draft_layers=None`` -> one draft layer per captured layer. ``mask_token_id=None`` ->
        ``resolve_mask_token_id(target_dir, trust_remote_code)``. ``layer_types``: a list (one per draft layer),
        one string for every layer, or None (all full attention); ``sliding_window``, ``is_causal``: see the
        class. Raises ``ConfigError`` (a ``ValueError``) for layer ids outside the target or repeated, and
        ``ValueError`` naming the field for a bad attention variant.
        """
        return cls(**cls._target_fields(target_dir, target_layer_ids, block_size, mask_token_id, num_draft_layers,
                                        num_target_layers, trust_remote_code, sliding_window, layer_types, is_causal))


def layer_masks(cfg: DFlashConfig, builder, *args, **kwargs) -> dict[str, Any]:
    """One attention mask per layer type of ``cfg``: ``{layer_type: builder(*args, **kwargs, window=W,
    causal=is_causal)}`` (``cfg.attention_variants()``), ``builder`` one of ``shared.models.draft_attention``'s
    ``build_attention_mask`` / ``build_context_mask`` / ``build_flex_mask``. This dict is what
    ``DFlashDrafter.forward`` takes as ``attn_mask`` for every config (a single mask is accepted only when
    ``cfg.plain_attention``). Example (trainer): ``layer_masks(dcfg, build_flex_mask, bb.anchors, bb.seq_start,
    ctx_len, B)``."""
    return {t: builder(*args, **kwargs, **v) for t, v in cfg.attention_variants().items()}


class DFlashAttention(nn.Module):
    """Attention whose keys/values cover ``[context ; draft tokens]`` and whose queries are the draft tokens."""

    def __init__(self, cfg: DFlashConfig, is_causal: bool = False):
        super().__init__()
        self.is_causal = bool(is_causal)  # structured form: causal inside the block (dense/flex: in the mask)
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
        (``block_attention``; causal inside the block when the layer ``is_causal``). Flex form (``attn_mask``
        a ``shared.models.draft_attention.FlexMask``): ``x`` and the context are already padded to the mask's
        ``q_len``/``ctx_len`` and ``flex_attention`` runs the block-sparse pattern (compiled on CUDA).
        Batched inference form (``ctx_kv`` of 4-D ``[R, kv_heads, C, head_dim]`` tensors, one padded context per
        row, ``shared.models.batched_decode``): ``x`` is ``R`` blocks of ``Q / R`` draft tokens, block ``r``
        attends to row ``r`` of the context and to itself under ``attn_mask [R, Q/R, C+Q/R] bool``; the dense
        form for every row at once. Returns ``[Q, H]``."""
        q_len = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(q_len, self.num_heads, self.head_dim)).transpose(0, 1)
        q = apply_rope(q, cos, sin)
        k_blk, v_blk = self.project_kv(x, cos, sin)
        if isinstance(attn_mask, FlexMask):
            dt = v_blk.dtype  # the matmul dtype (bfloat16 under autocast); norms and RoPE return float32
            k = torch.cat([ctx_kv[0].to(dt), k_blk.to(dt)], dim=1)[None]
            v = torch.cat([ctx_kv[1].to(dt), v_blk], dim=1)[None]
            out = flex_attention_fn(q.is_cuda)(q.to(dt)[None], k, v, block_mask=attn_mask.block_mask,
                                               enable_gqa=self.num_heads != self.num_kv_heads,
                                               kernel_options=draft_attention.FLEX_KERNEL_OPTIONS)[0]
            return self.o_proj(out.transpose(0, 1).reshape(q_len, self.num_heads * self.head_dim))
        if ctx_kv[0].dim() == 4:
            return self._batched(q, k_blk, v_blk, ctx_kv, attn_mask)
        if block_size is not None:
            out = block_attention(q, ctx_kv[0].to(k_blk.dtype), ctx_kv[1].to(v_blk.dtype), k_blk, v_blk,
                                  attn_mask, block_size, causal=self.is_causal)
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

    def _batched(self, q: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor,
                 ctx_kv: tuple[torch.Tensor, torch.Tensor], attn_mask: torch.Tensor) -> torch.Tensor:
        """The batched inference form of ``forward``: ``q [Hq, R*b, D]``, ``k_blk/v_blk [Hkv, R*b, D]``, ``ctx_kv``
        two ``[R, Hkv, C, D]``, ``attn_mask [R, b, C+b] bool`` -> ``[R*b, H]`` (the dense form, per row)."""
        r, q_len = ctx_kv[0].shape[0], q.shape[1]
        b = q_len // r
        qb = q.view(self.num_heads, r, b, self.head_dim).transpose(0, 1)
        kb = k_blk.view(self.num_kv_heads, r, b, self.head_dim).transpose(0, 1)
        vb = v_blk.view(self.num_kv_heads, r, b, self.head_dim).transpose(0, 1)
        k = torch.cat([ctx_kv[0].to(kb.dtype), kb], dim=2)
        v = torch.cat([ctx_kv[1].to(vb.dtype), vb], dim=2)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(qb, k, v, attn_mask=attn_mask[:, None])
        return self.o_proj(out.transpose(1, 2).reshape(q_len, self.num_heads * self.head_dim))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm decoder layer: ``x + attn(ln(x), ctx)`` then ``x + mlp(ln(x))``.

    ``layer_type`` (``"full_attention"``/``"sliding_attention"``) names which of the per-type masks the
    drafter hands this layer; ``is_causal`` makes the structured form causal inside the block. Neither
    changes the weights. ``draft_block_size`` (the length of each block of the packed draft stream) is not
    used here; a DFlash2 layer's convolutions need it."""

    def __init__(self, cfg: DFlashConfig, layer_type: str = "full_attention", is_causal: bool = False):
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = DFlashAttention(cfg, is_causal)
        self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, ctx_kv, cos, sin, attn_mask, block_size=None, draft_block_size=None):
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

    Subclasses (``shared.models.dflash2.DFlash2Drafter``) set ``layer_class`` and add modules in
    ``_add_modules`` (called before ``reset_parameters``); a module with ``own_init = True`` is left out of
    the Qwen3 initialisation and initialised by its own ``reset_parameters`` afterwards.
    """

    layer_class = DFlashDecoderLayer

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_target_layers * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(cfg, t, cfg.is_causal) for t in cfg.resolved_layer_types())
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        # Frozen placeholders: replaced by the target's tensors in load_target_head / load_frozen.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False)
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(False)
        self.head_loaded = False
        self._add_modules()
        self.reset_parameters()

    def _add_modules(self) -> None:
        """Hook for subclasses: register extra modules (DFlash: none)."""

    # ------------------------------------------------------------------ weights
    def reset_parameters(self) -> None:
        """Trainable linears ~ N(0, initializer_range), norms = 1 (Qwen3 initialisation); then every module
        marked ``own_init`` (skipped by that loop, with its children) runs its own ``reset_parameters``."""
        std = self.config.initializer_range
        own = [(n, m) for n, m in self.named_modules() if n and getattr(m, "own_init", False)]
        skip = tuple(n + "." for n, _ in own)
        own_names = {n for n, _ in own}
        for name, module in self.named_modules():
            if name in ("embed_tokens", "lm_head") or name in own_names or (skip and name.startswith(skip)):
                continue
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        for _, module in own:
            module.reset_parameters()

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
        shapes = dict(self.named_parameters())
        bad = sorted(f"{k} {tuple(v.shape)} (config wants {tuple(shapes[k].shape)})" for k, v in trainable.items()
                     if tuple(v.shape) != tuple(shapes[k].shape))
        if bad:
            raise ValueError(f"{source}: weights do not match the drafter config's shapes: {'; '.join(bad[:4])}"
                             + (f" and {len(bad) - 4} more" if len(bad) > 4 else ""))
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

    def _per_layer_masks(self, attn_mask) -> list:
        """The mask of each layer from ``forward``'s ``attn_mask`` (a per-layer-type dict, or one mask for a
        ``plain_attention`` config). Raises ``ValueError`` naming ``attn_mask`` otherwise, or when a dict lacks
        a layer type, or a ``FlexMask`` was built for another window/causality than its layer's."""
        cfg = self.config
        types = cfg.resolved_layer_types()
        if not isinstance(attn_mask, dict):
            if not cfg.plain_attention:
                raise ValueError("attn_mask: this drafter has sliding or causal layers (layer_types/sliding_window/"
                                 "is_causal); pass one mask per layer type, layer_masks(config, builder, ...)")
            return [attn_mask] * len(types)
        missing = sorted(set(types) - set(attn_mask))
        if missing:
            raise ValueError(f"attn_mask: no mask for layer type(s) {missing} (have {sorted(attn_mask)})")
        for t in dict.fromkeys(types):
            m = attn_mask[t]
            if isinstance(m, FlexMask) and (m.window != cfg.layer_window(t) or m.causal != cfg.is_causal):
                raise ValueError(f"attn_mask: the {t} FlexMask has window={m.window} causal={m.causal}, the layer "
                                 f"wants window={cfg.layer_window(t)} causal={cfg.is_causal}")
        return [attn_mask[t] for t in types]

    def forward(self, block_input_ids: torch.Tensor, block_positions: torch.Tensor, ctx_hidden: torch.Tensor,
                ctx_positions: torch.Tensor, attn_mask, block_size: int | None = None, *,
                draft_block_size: int | None = None) -> torch.Tensor:
        """Draft-token hidden states.

        ``block_input_ids [Q] long`` (anchor then mask tokens per block), ``block_positions [Q] long``
        (positions inside their sequence), ``ctx_hidden [C, n*H]``, ``ctx_positions [C] long``,
        ``attn_mask [Q, C+Q] bool`` (True = may attend; columns are context then draft tokens) or None;
        or, with ``block_size=B``, the context mask ``[Q, C]`` alone (each block of B draft tokens then
        sees exactly itself; ``block_attention``), which needs ``Q*(C+B)`` scores instead of ``Q*(C+Q)``;
        or a ``shared.models.draft_attention.FlexMask`` (``build_flex_mask``): block-sparse ``flex_attention``,
        about ``Q*(context before the anchor + B)`` scores, the training form on CUDA.

        Per layer type: ``attn_mask`` may be (and, unless ``config.plain_attention``, must be) a dict
        ``{layer_type: mask}`` of masks of one form, ``layer_masks(config, builder, ...)``; each layer gets its
        type's mask. ``draft_block_size``: the length of each block of the packed stream (DFlash2's
        convolutions; default ``block_size``, else the FlexMask's, else ``config.block_size``).
        Returns ``[Q, H]`` after the final norm; ``logits()`` maps it to the vocabulary.
        """
        masks = self._per_layer_masks(attn_mask)
        first = masks[0] if masks else None
        flex = isinstance(first, FlexMask)
        if draft_block_size is None:
            draft_block_size = block_size or (first.block_size if flex and first.block_size else None) \
                or self.config.block_size
        ctx = self.project_context(ctx_hidden)
        if flex:  # pad queries and context to the mask's tile multiples
            q_pad, c_pad = first.q_len - block_input_ids.shape[0], first.ctx_len - ctx.shape[0]
            block_input_ids = F.pad(block_input_ids, (0, q_pad), value=self.config.mask_token_id)
            block_positions = F.pad(block_positions, (0, q_pad))
            ctx, ctx_positions = F.pad(ctx, (0, 0, 0, c_pad)), F.pad(ctx_positions, (0, c_pad))
        x = self.embed(block_input_ids)
        cos_q, sin_q = self._rope(block_positions)
        cos_c, sin_c = self._rope(ctx_positions)
        for layer, mask in zip(self.layers, masks):
            ctx_kv = layer.self_attn.project_kv(ctx, cos_c, sin_c)
            x = layer(x, ctx_kv, cos_q, sin_q, mask, block_size, draft_block_size)
        x = self.norm(x)
        return x[:first.num_queries] if flex else x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` -> ``[..., V]`` through the frozen target LM head."""
        self._check_ready()
        w = self.lm_head.weight
        if not torch.is_autocast_enabled(hidden.device.type):
            w = w.to(hidden.dtype)  # under autocast the bf16 head is used as is: no [V, H] float32 copy
        return F.linear(hidden, w)

    def head_spec(self):
        """The head as a ``HeadSpec`` (for a fused linear + cross-entropy loss):
        ``logits`` is ``hidden @ weight.T`` (the weight cast to the hidden dtype outside autocast, as there)."""
        self._check_ready()
        return HeadSpec(self.lm_head.weight)

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

    def _inference_masks(self, cache: DraftCache, pos: torch.Tensor) -> dict[str, torch.Tensor | None]:
        """``{layer_type: [B, C+B] bool or None}`` for one block at ``pos [B]`` over the cached context: a
        sliding layer sees cached position ``c`` only if ``pos - c < W``; with ``is_causal`` slot ``j`` sees
        slots ``<= j``. None (everything visible) for a full, non-causal layer."""
        out: dict[str, torch.Tensor | None] = {}
        b = pos.shape[0]
        for t, v in self.config.attention_variants().items():
            if v["window"] is None and not v["causal"]:
                out[t] = None
                continue
            ctx = torch.ones(b, cache.length, dtype=torch.bool, device=pos.device)
            if v["window"] is not None:
                ctx = (pos[:, None] - cache.positions.to(pos.device)[None, :]) < v["window"]
            own = torch.ones(b, b, dtype=torch.bool, device=pos.device)
            if v["causal"]:
                own = own.tril()
            out[t] = torch.cat([ctx, own], dim=1)
        return out

    @torch.no_grad()
    def draft_block_hidden(self, ctx_hidden: torch.Tensor, ctx_positions: torch.Tensor, anchor_token: int,
                           anchor_pos: int, cache: DraftCache | None = None, block_size: int | None = None,
                           ) -> tuple[torch.Tensor, torch.Tensor, DraftCache]:
        """``draft_block`` that also returns the block's final-normed hidden states: ``(hidden [B, H] in the
        compute dtype, logits [B, V] float32, cache)``; ``logits`` is exactly ``draft_block``'s."""
        b = block_size or self.config.block_size
        w = self.config.sliding_window
        if w is not None and "sliding_attention" in self.config.resolved_layer_types() and b > w:
            raise ValueError(f"block_size: {b} > sliding_window {w}")
        cache = self.extend_cache(ctx_hidden, ctx_positions, cache)
        if cache.length and int(cache.positions.max()) >= anchor_pos:
            raise ValueError(f"draft_block: cache holds context at position {int(cache.positions.max())} "
                             f">= anchor_pos {anchor_pos}; crop it first")
        dev = self.fc.weight.device
        ids = torch.full((b,), self.config.mask_token_id, dtype=torch.long, device=dev)
        ids[0] = int(anchor_token)
        pos = torch.arange(anchor_pos, anchor_pos + b, device=dev)
        masks = self._inference_masks(cache, pos)
        x = self.embed(ids)
        cos, sin = self._rope(pos)
        for i, layer in enumerate(self.layers):
            x = layer(x, (cache.keys[i], cache.values[i]), cos, sin, masks[layer.layer_type], None, b)
        hidden = self.norm(x)
        return hidden, self.logits(hidden).float(), cache

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
        Sliding layers mask cached context at ``anchor_pos + k - c >= sliding_window`` (the cache keeps it:
        a full layer may still see it); ``is_causal`` makes the block causal. Raises ``ValueError`` for a
        block longer than the sliding window.
        """
        _, logits, cache = self.draft_block_hidden(ctx_hidden, ctx_positions, anchor_token, anchor_pos, cache,
                                                   block_size)
        return logits, cache


def build_drafter(dcfg: DFlashConfig, target_dir: str | Path | None = None, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    """A drafter with trainable weights in ``dtype`` on ``device`` and, when ``target_dir`` is given, the
    target's frozen embedding/head loaded (in the checkpoint's dtype)."""
    model = DFlashDrafter(dcfg).to(device=device, dtype=dtype)
    if target_dir is not None:
        model.load_target_head(target_dir)
    return model
