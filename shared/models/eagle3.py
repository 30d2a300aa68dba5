"""The EAGLE-3 drafter: one decoder layer over the fused low/mid/high target features and the token embedding,
a draft vocabulary, and training-time test (TTT).

Algorithm: "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time Test" (Li et
al., arXiv 2503.01840), as defined by the public trainers and the serving engines' loaders: SpecForge
``specforge/modeling/draft/llama3_eagle.py`` (``LlamaForCausalLMEagle3``) and ``specforge/core/eagle3.py``
(TTT, loss), SafeAILab/EAGLE ``eagle/traineagle3/cnets.py``, SGLang and vLLM ``models/llama_eagle3.py``
(``load_weights``). Read to learn the definition; written here, not copied. Parameter names follow the
loaders (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, buffers ``d2t``/``t2d``) so exports need no renaming.

What the drafter computes (``T`` packed positions, ``H`` hidden, ``Ht`` the target's hidden, ``V`` the
target's vocabulary, ``Vd`` the draft vocabulary):

* Features: the target's residual stream after three decoder layers (``target_layer_ids``, specring's
  convention: id ``i`` = output of decoder layer ``i``; default ``[1, L//2 - 1, L - 4]``, the references'
  ``hidden_states[2], [L//2], [L-3]``), concatenated ``[T, 3*Ht]``; ``fc`` (no bias) maps them to ``H``.
* One layer: ``x = [input_layernorm(embed(token)) ; hidden_norm(h)]`` (``2H``, the embedding first); q/k/v
  project from ``2H`` (no bias, RoPE, grouped keys); ``h' = h + o_proj(attention)`` (the residual is the
  un-normalised ``h``), then a SwiGLU MLP with ``post_attention_layernorm``. ``h'`` (pre-norm) is what the next
  step is fed; ``lm_head(norm(h'))`` gives ``[T, Vd]`` logits.
* Position ``t`` of TTT step ``k`` reads token ``x[t+1+k]`` and, for ``k > 0``, its own step ``k-1`` output at
  ``t``; its RoPE position is ``t + k``. It attends to the step-0 keys of its sequence up to ``t`` and to the
  keys of its own steps ``1..k`` at ``t`` (the references' "cache hidden" / diagonal pattern, which is what the
  draft KV cache holds at inference), and predicts ``x[t+2+k]``.
* Draft vocabulary: the ``Vd`` most frequent loss-masked tokens of the training data, ascending by id;
  ``d2t[i] = target_id(i) - i`` (int64 offsets, as both engines expect), ``t2d`` a ``[V]`` bool mask.
  ``Vd >= V`` keeps the whole vocabulary (``d2t`` all zero).
* Frozen: ``embed_tokens`` (the target's). ``lm_head`` starts from the target's head rows of the draft
  vocabulary and is trained (SpecForge trains it from random, speculators copies and freezes it; starting from
  the target's rows is a head start that keeps it trainable).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specring.shared.errors import ConfigError
from specring.shared.models.building_blocks import (
    DraftConfigDict,
    RMSNorm,
    SwiGLUMLP,
    apply_rope,
    read_target_head,
    rope_cos_sin,
    rope_theta_from_config,
)
from specring.shared.models.layer_ids import resolve_eagle3_layer_ids
from specring.shared.models.target_config import read_target_config, text_config

DEFAULT_DRAFT_VOCAB = 32000
DEFAULT_TTT_STEPS = 7
DEFAULT_TTT_DECAY = 0.8
BUFFER_KEYS = ("d2t", "t2d")


@dataclass
class Eagle3Config(DraftConfigDict):
    """Shape of an EAGLE-3 drafter (serialised as ``eagle3_config.json`` in checkpoints).

    ``target_layer_ids``: the three captured layers (specring's convention); ``draft_vocab_size``: ``Vd``
    (at most ``vocab_size``); ``ttt_steps``/``ttt_decay``: TTT length and per-step loss weight ``decay**k``.
    """
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    max_position_embeddings: int
    target_layer_ids: list[int]
    ttt_steps: int = DEFAULT_TTT_STEPS
    ttt_decay: float = DEFAULT_TTT_DECAY
    target_model_type: str = "qwen3"
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02

    def __post_init__(self):
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if len(self.target_layer_ids) != 3:
            raise ValueError(f"target_layer_ids: EAGLE-3 fuses three target layers, got {self.target_layer_ids}")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size: must be in 1..{self.vocab_size}, got {self.draft_vocab_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads: {self.num_key_value_heads} does not divide "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.ttt_steps < 1:
            raise ValueError(f"ttt_steps: must be >= 1, got {self.ttt_steps}")
        if not 0 < self.ttt_decay <= 1:
            raise ValueError(f"ttt_decay: must be in (0, 1], got {self.ttt_decay}")

    @property
    def num_target_layers(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_target(cls, target_dir: str | Path, target_layer_ids: list[int] | None = None,
                    draft_vocab_size: int = DEFAULT_DRAFT_VOCAB, ttt_steps: int = DEFAULT_TTT_STEPS,
                    ttt_decay: float = DEFAULT_TTT_DECAY) -> "Eagle3Config":
        """Size a drafter like the target in ``target_dir`` (its ``config.json``): the layer of a target decoder
        layer, ``min(draft_vocab_size, V)``. Raises ``ConfigError`` for layer ids outside the target or not three
        distinct ones."""
        raw = read_target_config(target_dir)
        cfg = text_config(raw)
        num_layers = int(cfg["num_hidden_layers"])
        try:
            ids = resolve_eagle3_layer_ids(num_layers, target_layer_ids)
        except ConfigError as e:
            raise ConfigError(f"--target-layers: {e.detail}", key=e.key, detail=e.detail) from None
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        vocab = int(cfg["vocab_size"])
        return cls(hidden_size=hidden, intermediate_size=int(cfg["intermediate_size"]), num_attention_heads=heads,
                   num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                   head_dim=int(cfg.get("head_dim") or hidden // heads),
                   rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta_from_config(cfg),
                   vocab_size=vocab, draft_vocab_size=min(int(draft_vocab_size), vocab), target_hidden_size=hidden,
                   max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)), target_layer_ids=ids,
                   ttt_steps=int(ttt_steps), ttt_decay=float(ttt_decay),
                   target_model_type=str(cfg.get("model_type", raw.get("model_type", "qwen3"))),
                   tie_word_embeddings=bool(raw.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
                   initializer_range=float(cfg.get("initializer_range", 0.02)))


# ------------------------------------------------------------------------------------------------ vocabulary
def build_draft_vocab(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t [Vd] int64, t2d [V] bool)`` from ``token_counts [V]`` (loss-masked occurrences per target id).

    The ``Vd`` most frequent ids (ties to the lower id), sorted ascending; ``d2t[i] = used[i] - i``; ``t2d`` marks
    them. ``Vd >= V`` keeps every id. Reference: SpecForge ``specforge/data/preprocessing.py``
    (``process_token_dict_to_mappings``), the format SGLang and vLLM load.
    """
    v = int(token_counts.numel())
    vd = min(int(draft_vocab_size), v)
    if vd == v:
        used = torch.arange(v)
    else:
        order = torch.argsort(-token_counts.to(torch.int64), stable=True)  # stable: ties keep the lower id first
        used = order[:vd].sort().values
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[used] = True
    return (used - torch.arange(vd)).to(torch.int64), t2d


def draft_to_target(d2t: torch.Tensor) -> torch.Tensor:
    """``[Vd] long``: the target id of each draft id (``d2t + arange``)."""
    return d2t.long() + torch.arange(d2t.numel(), device=d2t.device)


def target_to_draft(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[V] long``: the draft id of each target id, ``-1`` where the id is outside the draft vocabulary."""
    out = torch.full((vocab_size,), -1, dtype=torch.long, device=d2t.device)
    out[draft_to_target(d2t)] = torch.arange(d2t.numel(), device=d2t.device)
    return out


# ------------------------------------------------------------------------------------------------ the layer
def eagle3_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, mask0: torch.Tensor,
                     diag_k: list[torch.Tensor], diag_v: list[torch.Tensor]) -> torch.Tensor:
    """Attention of ``q [Hq, Tq, D]`` over the step-0 keys ``k0/v0 [Hkv, Tk, D]`` where ``mask0 [Tq, Tk]`` allows
    (True), plus, for each later TTT step, the one key ``diag_k[i][:, t]`` of the query's own position ``t``
    (``diag_k[i]``/``diag_v[i]`` are ``[Hkv, Tq, D]``). One softmax over all of them, in float32. Returns
    ``[Hq, Tq, D]``. Grouped-query: query heads map onto their key head without repeating the keys."""
    hq, tq, d = q.shape
    hkv = k0.shape[0]
    g = hq // hkv
    scale = d ** -0.5
    qg = q.reshape(hkv, g, tq, d).float()
    s0 = torch.einsum("hgtd,hsd->hgts", qg, k0.float()) * scale
    s0 = s0.masked_fill(~mask0[None, None], float("-inf"))
    sd = [torch.einsum("hgtd,htd->hgt", qg, kd.float())[..., None] * scale for kd in diag_k]
    p = torch.softmax(torch.cat([s0] + sd, dim=-1), dim=-1)
    out = torch.einsum("hgts,hsd->hgtd", p[..., :k0.shape[1]], v0.float())
    for i, vd in enumerate(diag_v):
        out = out + p[..., k0.shape[1] + i, None] * vd.float()[:, None]
    return out.reshape(hq, tq, d).to(q.dtype)



def padded_eagle3_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, blocked: torch.Tensor,
                            diag_k: torch.Tensor | None = None, diag_v: torch.Tensor | None = None,
                            used: torch.Tensor | None = None) -> torch.Tensor:
    """``eagle3_attention`` for ``S`` padded sequences at once: ``q [S, Hq, L, D]`` over the step-0 keys ``k0/v0
    [S, Hkv, L, D]`` except where ``blocked [L, L]`` (True: the key comes after the query), plus the keys
    ``diag_k/diag_v [S, Hkv, L, n, D]`` of the query's own position where ``used [n]`` (bool) is True (None:
    none). One softmax over the ``L + n`` scores, computed with the operations of ``eagle3_attention`` (so with
    its precision under autocast); a blocked or unused key gets probability exactly 0. Returns ``[S, Hq, L, D]``
    in ``q``'s dtype. A query row always keeps its own step-0 key, so padding rows (whatever they hold) stay
    finite; real rows never see them (the keys after a real query are blocked)."""
    s, hq, length, d = q.shape
    hkv = k0.shape[1]
    g = hq // hkv
    scale = d ** -0.5
    qf = q.reshape(s, hkv, g * length, d).float()
    s0 = (torch.matmul(qf, k0.float().transpose(-1, -2)) * scale).view(s, hkv, g, length, length)
    s0 = s0.masked_fill(blocked, float("-inf"))
    if diag_k is None:
        p = torch.softmax(s0, dim=-1)
        out = torch.matmul(p.view(s, hkv, g * length, length), v0.float())
        return out.reshape(s, hq, length, d).to(q.dtype)
    sd = torch.einsum("shgld,shlnd->shgln", qf.view(s, hkv, g, length, d), diag_k.float()) * scale
    sd = sd.masked_fill(~used, float("-inf"))
    p = torch.softmax(torch.cat([s0, sd], dim=-1), dim=-1)
    out = torch.matmul(p[..., :length].reshape(s, hkv, g * length, length), v0.float()).view(s, hkv, g, length, d)
    out = out + (p[..., length:, None] * diag_v.float()[:, :, None]).sum(-2)
    return out.reshape(s, hq, length, d).to(q.dtype)


@dataclass
class PaddedLayout:
    """A packed batch (``T`` tokens, ``cu_seqlens [S+1]``) as ``S`` rows of ``L`` positions (``L`` the longest
    sequence), the layout in which ``Eagle3Drafter.ttt_forward`` runs TTT: one attention call per step for the
    whole batch. ``gather [S*L] long``: the packed row each padded row reads (``cu[s] + j``, clamped to ``T-1``;
    padding rows read some real row and are never read back); ``scatter [T] long``: the padded row of each
    packed token (``s*L + position``); ``blocked [L, L] bool``: the causal mask's complement. Device tensors;
    ``S``/``L`` host ints (from the host ``cu_seqlens``: no synchronisation). The batch plan keeps ``S*L`` within
    ``max_tokens`` (``shared/data/dataset.py``), so padding costs at most what the plan already budgets."""
    num_seqs: int
    length: int
    gather: torch.Tensor
    scatter: torch.Tensor
    blocked: torch.Tensor

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor, device: torch.device | str) -> "PaddedLayout":
        """From ``cu_seqlens [S+1]`` (host tensor, else one device-to-host copy). Raises ``ValueError`` for an
        empty batch (``T == 0``)."""
        cu_host = cu_seqlens.detach().cpu().long()
        bounds = cu_host.tolist()                                 # host ints (no scalar reads of a tensor)
        t, s = bounds[-1], len(bounds) - 1
        if t < 1 or s < 1:
            raise ValueError(f"cu_seqlens: TTT needs at least one token, got {bounds}")
        length = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        # through pinned memory: a pageable host-to-device copy would wait for every kernel queued before it
        cu = cu_host.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else cu_host
        j = torch.arange(length, device=device)
        gather = (cu[:-1, None] + j[None]).clamp(max=t - 1).reshape(-1)
        idx = torch.arange(t, device=device)
        seq = torch.searchsorted(cu[1:], idx, right=True)
        scatter = seq * length + idx - cu[seq]
        blocked = torch.ones(length, length, dtype=torch.bool, device=device).triu(1)
        return cls(s, length, gather, scatter, blocked)


class Eagle3Attention(nn.Module):
    """Llama-style attention whose q/k/v read the ``2H`` input (no bias, no q/k norms)."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        h2, d = 2 * cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h2, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h2, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h2, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, cfg.hidden_size, bias=False)

    def project(self, x2: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``x2 [T, 2H]`` -> ``q [Hq, T, D]``, ``k, v [Hkv, T, D]`` (RoPE on q and k)."""
        t = x2.shape[0]
        q = self.q_proj(x2).view(t, self.num_heads, self.head_dim).transpose(0, 1)
        k = self.k_proj(x2).view(t, self.num_kv_heads, self.head_dim).transpose(0, 1)
        v = self.v_proj(x2).view(t, self.num_kv_heads, self.head_dim).transpose(0, 1)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def out(self, attn: torch.Tensor) -> torch.Tensor:
        """``[Hq, T, D]`` -> ``[T, H]``."""
        return self.o_proj(attn.transpose(0, 1).reshape(attn.shape[1], self.num_heads * self.head_dim))


class Eagle3Layer(nn.Module):
    """The one decoder layer (``midlayer``); see the module docstring for what it computes."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)

    def qkv(self, emb: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Queries, keys, values of positions with token embeddings ``emb [T, H]`` and hidden ``h [T, H]``."""
        x2 = torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], dim=-1)
        return self.self_attn.project(x2, cos, sin)

    def finish(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """``h + o_proj(attn)``, then the MLP block: the pre-norm output ``[T, H]``."""
        h = h + self.self_attn.out(attn)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(self, emb_n: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                blocked: torch.Tensor, slot: torch.Tensor, used: torch.Tensor, k0: torch.Tensor | None = None,
                v0: torch.Tensor | None = None, diag_k: torch.Tensor | None = None,
                diag_v: torch.Tensor | None = None):
        """One TTT step over a padded batch (``PaddedLayout``: ``S`` sequences of ``L`` positions, rows flattened,
        ``N = S*L``); what ``torch.compile`` compiles (``Eagle3Family.compiled_modules``).

        ``emb_n [N, H]``: ``input_layernorm`` of the embeddings of the tokens read at this step; ``h [N, H]``:
        the previous step's pre-norm output (step 0: ``fc`` of the features); ``cos``/``sin [L, D]`` float32:
        RoPE of positions ``j + k``; ``blocked [L, L]`` bool; ``slot``/``used [K-1]`` bool: the diagonal slot
        this step's keys go to (``k-1``) and the slots filled once they are in (``< k``). State (None at step
        0): ``k0``/``v0 [S, Hkv, L, D]`` the step-0 keys/values, ``diag_k``/``diag_v [S, Hkv, L, K-1, D]`` the
        keys/values of steps ``1..K-1`` at each position (zeros in the slots not filled yet). Returns
        ``(h' [N, H], k0, v0, diag_k, diag_v)``: the pre-norm output and the state with this step's keys in
        (step 0: as ``k0``/``v0``; later: in ``slot``), ready for the next step.

        The state has the same shapes at every step (slots, not a growing list), so ``torch.compile(dynamic=
        True)`` makes two graphs, step 0 and the others, for any ``K`` and any batch shape (one-sequence
        batches add their own two)."""
        attn = self.self_attn
        n_rows, length = h.shape[0], blocked.shape[0]
        s = n_rows // length
        x2 = torch.cat([emb_n, self.hidden_norm(h)], dim=-1)
        q = attn.q_proj(x2).view(s, length, attn.num_heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x2).view(s, length, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x2).view(s, length, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if k0 is None:
            k0, v0 = k, v
            o = padded_eagle3_attention(q, k0, v0, blocked)
            # zeros in the slots, computed from k/v so that they require grad as the later steps' states do
            # (one compiled graph for steps 1..K-1, not one for step 1 and another for the rest)
            diag_k = k[..., None, :].expand(*k.shape[:3], used.shape[0], k.shape[3]) * 0
            diag_v = v[..., None, :].expand(*v.shape[:3], used.shape[0], v.shape[3]) * 0
        else:
            diag_k = torch.where(slot[:, None], k[..., None, :], diag_k)
            diag_v = torch.where(slot[:, None], v[..., None, :], diag_v)
            o = padded_eagle3_attention(q, k0, v0, blocked, diag_k, diag_v, used)
        h = h + attn.o_proj(o.transpose(1, 2).reshape(n_rows, attn.num_heads * attn.head_dim))
        return h + self.mlp(self.post_attention_layernorm(h)), k0, v0, diag_k, diag_v


class Eagle3Drafter(nn.Module):
    """EAGLE-3 draft model (module docstring). Trainable: everything but ``embed_tokens``; buffers ``d2t``/``t2d``
    (the draft vocabulary, set once with ``set_draft_vocab``)."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, h, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        d2t, t2d = build_draft_vocab(torch.arange(cfg.vocab_size, 0, -1), cfg.draft_vocab_size)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)
        self.head_loaded = False
        std = cfg.initializer_range
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=std)

    # ------------------------------------------------------------------ weights
    def set_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the draft vocabulary (``build_draft_vocab``). Raises ``ValueError`` on a shape mismatch or a
        ``t2d`` that disagrees with ``d2t``."""
        vd, v = self.config.draft_vocab_size, self.config.vocab_size
        if tuple(d2t.shape) != (vd,) or tuple(t2d.shape) != (v,):
            raise ValueError(f"draft vocabulary: d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)}, expected ({vd},) / "
                             f"({v},)")
        if not torch.equal(torch.nonzero(t2d.cpu()).flatten(), draft_to_target(d2t.cpu())):
            raise ValueError("draft vocabulary: t2d does not mark exactly the ids of d2t")
        self.d2t.copy_(d2t.to(self.d2t.device, torch.int64))
        self.t2d.copy_(t2d.to(self.t2d.device, torch.bool))

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Trainable weights and the vocabulary buffers under their export names (no ``embed_tokens``)."""
        out = {n: p.detach() for n, p in self.named_parameters() if n != "embed_tokens.weight"}
        out.update({k: getattr(self, k).detach() for k in BUFFER_KEYS})
        return out

    def frozen_state_dict(self) -> dict[str, torch.Tensor]:
        return {"embed_tokens.weight": self.embed_tokens.weight.detach()}

    def load_trainable(self, tensors: dict[str, torch.Tensor], source: str) -> None:
        """Copy trainable weights and buffers; raises ``ValueError`` naming ``source`` and the key mismatch or the
        tensors of another shape, before anything is copied."""
        mine = self.trainable_state_dict()
        have = {k: v for k, v in tensors.items() if k != "embed_tokens.weight"}
        if set(have) != set(mine):
            raise ValueError(f"{source}: weights do not match the EAGLE-3 config: missing "
                             f"{sorted(set(mine) - set(have))}, unexpected {sorted(set(have) - set(mine))}")
        bad = sorted(f"{k} {tuple(v.shape)} (config wants {tuple(mine[k].shape)})" for k, v in have.items()
                     if tuple(v.shape) != tuple(mine[k].shape))
        if bad:
            raise ValueError(f"{source}: weights do not match the EAGLE-3 config's shapes: {'; '.join(bad)}")
        self.set_draft_vocab(have["d2t"], have["t2d"])
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name in have:
                    p.copy_(have[name].to(p.dtype))

    def load_frozen(self, embed: torch.Tensor) -> None:
        """Install the target's embedding ``[V, H]`` (frozen, in its own dtype). Raises ``ValueError`` on a shape
        mismatch."""
        v, h = self.config.vocab_size, self.config.hidden_size
        if tuple(embed.shape) != (v, h):
            raise ValueError(f"target embedding has shape {tuple(embed.shape)}, drafter expects ({v}, {h})")
        self.embed_tokens.weight = nn.Parameter(embed.detach().clone().to(self.fc.weight.device), requires_grad=False)
        self.head_loaded = True

    def load_target_head(self, target_dir: str | Path) -> None:
        """The target's embedding (frozen) and, as the starting point of ``lm_head``, its head rows of the draft
        vocabulary (call after ``set_draft_vocab``). Raises ``FileNotFoundError``/``KeyError`` naming what is
        missing, ``ValueError`` on a shape mismatch."""
        embed, head = read_target_head(target_dir, self.config.tie_word_embeddings)
        self.load_frozen(embed)
        head = embed if head is None else head
        with torch.no_grad():
            self.lm_head.weight.copy_(head[draft_to_target(self.d2t.cpu())].to(self.lm_head.weight))

    # ------------------------------------------------------------------ pieces
    def _dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.head_loaded:
            raise RuntimeError("Eagle3Drafter: target embedding not loaded (call load_target_head)")
        return F.embedding(ids, self.embed_tokens.weight).to(self._dtype())

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """``[T, 3*Ht]`` target features -> ``[T, H]``."""
        return self.fc(features.to(self._dtype()))

    def rope(self, positions: torch.Tensor):
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden ``[..., H]`` -> draft-vocabulary logits ``[..., Vd]``."""
        return self.lm_head(self.norm(h))

    # ------------------------------------------------------------------ training
    def ttt_forward(self, step_ids: torch.Tensor | list[torch.Tensor], cu_seqlens: torch.Tensor,
                    features: torch.Tensor, layout: PaddedLayout | None = None) -> torch.Tensor:
        """Training-time test over a packed batch: the pre-norm outputs ``[K, T, H]`` of the ``K`` steps.

        ``step_ids [K, T] long`` (or a list of ``K`` ``[T]``): the token each position reads at step ``k``
        (``x[t+1+k]``, anything where that runs past its sequence: those positions carry no loss);
        ``cu_seqlens [S+1]`` (host, else one synchronisation); ``features [T, 3*Ht]``; ``layout``: the batch's
        ``PaddedLayout`` (built here when None). Attention per sequence: step-0 keys causally, later steps' keys
        on the diagonal (``padded_eagle3_attention``).

        Batched where the algorithm allows (step ``k`` needs step ``k-1``'s output, so the steps themselves
        stay a loop of ``K`` layer calls, as in SpecForge ``specforge/core/eagle3.py``, which caches each step's
        keys): every sequence in one call per step (``PaddedLayout``), the embeddings and ``input_layernorm``
        of all steps in one call, one RoPE table for all steps, no host synchronisation. Equal to the
        sequence-by-sequence ``eagle3_ttt_reference.reference_ttt_forward`` (``tests/unit/test_eagle3_batched.py``).
        """
        steps = torch.stack(list(step_ids)) if isinstance(step_ids, (list, tuple)) else step_ids
        lay = layout if layout is not None else PaddedLayout.of(cu_seqlens, features.device)
        h = self.fuse(features)[lay.gather]                                      # [S*L, H]
        emb_n = self.midlayer.input_layernorm(self.embed(steps[:, lay.gather]))  # [K, S*L, H]
        num_steps, length = steps.shape[0], lay.length
        cos, sin = self.rope(torch.arange(length + num_steps - 1, device=features.device))
        slots = torch.arange(num_steps - 1, device=features.device)
        ks = torch.arange(num_steps, device=features.device)[:, None]
        slot, used = slots == ks - 1, slots < ks                                # [K, K-1] each: row k for step k
        state: tuple = (None, None, None, None)
        outs = []
        for k in range(num_steps):
            # copies, not views: an input's storage offset would become a symbol of the compiled step (and a
            # recompile whenever it happens to equal a size)
            h, *state = self.midlayer(emb_n[k].clone(), h, cos[k:k + length].clone(), sin[k:k + length].clone(),
                                      lay.blocked, slot[k].clone(), used[k].clone(), *state)
            outs.append(h)
        return torch.stack(outs)[:, lay.scatter]


@dataclass
class Eagle3Cache:
    """Step-0 keys/values of the verified context (``[Hkv, C, D]`` each) and how many positions they cover."""
    keys: torch.Tensor
    values: torch.Tensor

    @property
    def length(self) -> int:
        return int(self.keys.shape[1])


@torch.no_grad()
def eagle3_extend(drafter: Eagle3Drafter, cache: Eagle3Cache | None, features: torch.Tensor, next_ids: torch.Tensor,
                  positions: torch.Tensor) -> tuple[Eagle3Cache, torch.Tensor]:
    """Step 0 over new verified context: ``features [C, 3*Ht]`` of positions ``positions [C]`` (continuing the
    cache), each paired with the token that follows it (``next_ids [C]``). Returns the grown cache and the
    pre-norm outputs ``[C, H]`` (the last one drafts the first token)."""
    dev = drafter.fc.weight.device
    h = drafter.fuse(features.to(dev))
    cos, sin = drafter.rope(positions.to(dev))
    q, k, v = drafter.midlayer.qkv(drafter.embed(next_ids.to(dev)), h, cos, sin)
    if cache is not None:
        k, v = torch.cat([cache.keys, k], dim=1), torch.cat([cache.values, v], dim=1)
    c_old = k.shape[1] - q.shape[1]
    mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=dev).tril(diagonal=c_old)
    out = drafter.midlayer.finish(h, eagle3_attention(q, k, v, mask, [], []))
    return Eagle3Cache(k, v), out


@torch.no_grad()
def eagle3_chain(drafter: Eagle3Drafter, cache: Eagle3Cache, h_last: torch.Tensor, position: int,
                 k: int) -> tuple[list[int], list[torch.Tensor]]:
    """Chain drafting: ``k`` target token ids, each from the previous step's pre-norm output (``h_last [H]`` of
    the last context position ``position`` first) and the token it drafted, at positions ``position + j``,
    attending to the verified context (the cache) and to this chain's own keys (TTT's pattern). Returns the
    tokens and the pre-norm outputs of steps ``1..k-1`` (``[H]`` each)."""
    dev = drafter.fc.weight.device
    d2t_full = draft_to_target(drafter.d2t)
    h = h_last[None]
    token = int(d2t_full[drafter.logits(h)[0].argmax()])
    out, hiddens = [token], []
    dk: list[torch.Tensor] = []
    dv: list[torch.Tensor] = []
    full = torch.ones(1, cache.length, dtype=torch.bool, device=dev)
    for j in range(1, k):
        cos, sin = drafter.rope(torch.tensor([position + j], device=dev))
        q, kk, vv = drafter.midlayer.qkv(drafter.embed(torch.tensor([token], device=dev)), h, cos, sin)
        dk.append(kk)
        dv.append(vv)
        h = drafter.midlayer.finish(h, eagle3_attention(q, cache.keys, cache.values, full, dk, dv))
        token = int(d2t_full[drafter.logits(h)[0].argmax()])
        out.append(token)
        hiddens.append(h[0])
    return out, hiddens


def build_eagle3(cfg: Eagle3Config, target_dir: str | Path | None = None, d2t: torch.Tensor | None = None,
                 t2d: torch.Tensor | None = None, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> Eagle3Drafter:
    """A drafter with its draft vocabulary set (when given) and the target's embedding/head rows loaded (when
    ``target_dir`` is given), in ``dtype`` on ``device``."""
    model = Eagle3Drafter(cfg)
    if d2t is not None:
        model.set_draft_vocab(d2t, t2d)
    if target_dir is not None:
        model.load_target_head(target_dir)
    return model.to(device=device, dtype=dtype)  # floating tensors only: d2t/t2d keep int64/bool


def ttt_weights(cfg: Eagle3Config) -> list[float]:
    """Loss weight of each TTT step: ``decay**k``."""
    return [math.pow(cfg.ttt_decay, k) for k in range(cfg.ttt_steps)]
