"""The DFlash2 drafter: DFlash plus grouped dynamic causal convolutions in every layer and a candidate selector.

Source: the public DFlash2 draft model of z-lab/dflash ``dflash/model.py`` (``GroupedDynamicCausalConv``,
``CandidateSelector``, ``DFlash2DraftModel``; commit 10129599dffb338ff38cfd235a53ca6d3667b4dd), read, not
copied; the parameter names are the reference's so that the weights export under its per-layer names
(``layers.{i}.attention_conv.base_kernel``, ``layers.{i}.attention_conv.kernel_projection.weight``,
``layers.{i}.mlp_conv.*``, ``candidate_selector.hidden_projection.weight``,
``candidate_selector.{predecessor,successor}_codebook.weight``; the reference's checkpoint stores the two
codebooks without ``.weight``, a renaming that is the export's business).

What it adds to ``shared.models.dflash.DFlashDrafter`` (shapes packed as there: ``Q`` draft tokens, ``A``
blocks of ``B``, ``H`` hidden size, ``G = H / conv_group_size`` groups, ``K = conv_kernel_size``):

* Convolutions. Each decoder layer wraps both sublayers in a ``GroupedDynamicCausalConv``:
  ``a = input_layernorm(h); a', dA = attention_conv.prepare(a); h = h + attention_conv.finish(self_attn(a', ctx),
  dA)``, then the same with ``post_attention_layernorm``, ``mlp_conv`` and the MLP. The residual path is never
  convolved. The convolution mixes each token with the ``K - 1`` tokens before it *in its own block*: the
  reference drafts one block per forward, so its only boundary is the zero padding at the start of the
  stream; packed training streams hold ``A`` blocks, so here tap ``k`` of row ``t`` is zero when
  ``t mod B < k`` (a design choice of this implementation, identical to the reference for one block).
* Initialisation at the identity (also a choice here: the reference leaves ``base_kernel`` uninitialised):
  ``base_kernel[:, 0] = 1``, other taps 0, ``kernel_projection`` 0, and the selector's ``hidden_projection``
  0, so an untrained DFlash2 computes exactly what a DFlash with the same other weights computes (greedy
  proposals included). ``DFlash2Drafter(cfg)`` under a seed also draws the same DFlash weights as
  ``DFlashDrafter(cfg)`` under that seed (the new modules draw nothing before them).
* Logits: ``output_multiplier * head(hidden)``, then ``c * tanh(x / c)`` when ``final_logit_softcapping`` ``c``
  is set.
* The candidate selector (``CandidateSelector``): the top-``selector_top_k`` tokens of each slot's logits,
  rescored with a low-rank bigram term and chosen left to right (``propose_block``).

Everything else (context, KV injection, masks and their per-layer-type variants, cache) is DFlash's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specring.shared.models.dflash import DFlashConfig, DFlashDecoderLayer, DFlashDrafter, DraftCache, HeadSpec


def _check_int(name: str, value, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name}: must be an integer >= {lo}, got {value!r}")


@dataclass
class DFlash2Config(DFlashConfig):
    """A DFlash config plus the DFlash2 fields (serialised as ``dflash2_config.json``).

    ``conv_kernel_size`` ``K`` (taps, ``>= 1``); ``conv_group_size`` ``S`` (channels sharing one dynamic
    coefficient; divides ``hidden_size``); ``selector_top_k`` (candidates per slot, ``1..vocab_size``);
    ``selector_rank`` ``R`` (``>= 1``); ``output_multiplier`` (finite, ``> 0``); ``final_logit_softcapping``
    (None = off, else ``> 0``). The reference's checkpoint (its fixture) uses K 2, S 16, top-K 16, R 256,
    multiplier ``1/sqrt(26)``, softcap 20. Raises ``ValueError`` naming the field.
    """
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_top_k: int = 16
    selector_rank: int = 256
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    def __post_init__(self):
        super().__post_init__()
        _check_int("conv_kernel_size", self.conv_kernel_size, 1)
        _check_int("conv_group_size", self.conv_group_size, 1)
        if self.hidden_size % self.conv_group_size:
            raise ValueError(f"conv_group_size: {self.conv_group_size} does not divide hidden_size {self.hidden_size}")
        _check_int("selector_top_k", self.selector_top_k, 1)
        if self.selector_top_k > self.vocab_size:
            raise ValueError(f"selector_top_k: {self.selector_top_k} > vocab_size {self.vocab_size}")
        _check_int("selector_rank", self.selector_rank, 1)
        m = self.output_multiplier
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m) or m <= 0:
            raise ValueError(f"output_multiplier: must be a finite number > 0, got {m!r}")
        self.output_multiplier = float(m)
        c = self.final_logit_softcapping
        if c is not None:
            if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c <= 0:
                raise ValueError(f"final_logit_softcapping: must be None (off) or a finite number > 0, got {c!r}")
            self.final_logit_softcapping = float(c)

    @property
    def conv_num_groups(self) -> int:
        """``G = hidden_size // conv_group_size``."""
        return self.hidden_size // self.conv_group_size

    @classmethod
    def from_target(cls, target_dir: str | Path, target_layer_ids: list[int] | None, block_size: int = 16,
                    mask_token_id: int | None = None, num_draft_layers: int | None = None,
                    num_target_layers: int = 5, trust_remote_code: bool = False,
                    sliding_window: int | None = None, layer_types: str | list[str] | None = None,
                    is_causal: bool = False, conv_kernel_size: int = 2, conv_group_size: int = 16,
                    selector_top_k: int = 16, selector_rank: int = 256, output_multiplier: float = 1.0,
                    final_logit_softcapping: float | None = None) -> "DFlash2Config":
        """``DFlashConfig.from_target`` (same arguments and rules) plus the DFlash2 fields."""
        fields = cls._target_fields(target_dir, target_layer_ids, block_size, mask_token_id, num_draft_layers,
                                    num_target_layers, trust_remote_code, sliding_window, layer_types, is_causal)
        return cls(**fields, conv_kernel_size=conv_kernel_size, conv_group_size=conv_group_size,
                   selector_top_k=selector_top_k, selector_rank=selector_rank,
                   output_multiplier=output_multiplier, final_logit_softcapping=final_logit_softcapping)


class GroupedDynamicCausalConv(nn.Module):
    """Depthwise causal convolution over the draft stream whose taps are a static per-channel kernel plus a
    per-token, per-group dynamic coefficient (z-lab/dflash ``GroupedDynamicCausalConv``, read, not copied).

    Parameters: ``base_kernel [2, K, H]`` (phase 0 = ``prepare``, before the sublayer; phase 1 = ``finish``,
    after it; lag ``k = 0`` is the token itself) and ``kernel_projection`` (Linear ``H -> 2*K*G``, no bias).
    Both phases' dynamic coefficients come from the *sublayer input* ``x``: ``dyn = kernel_projection(x)``
    viewed ``[Q, 2, K, G]``. Phase ``p`` of ``u`` is

        ``out[t, c] = sum_k (base_kernel[p, k, c] + dyn[t, p, k, g(c)]) * u[t - k, c]``,  ``g(c) = c // S``,

    computed in ``u``'s dtype, lags ascending (base term, then dynamic term), where ``u[t - k]`` counts as
    zero when ``t mod B < k`` (``B`` = ``block_size``: the stream is blocks of ``B`` tokens and no tap crosses
    a block boundary; ``block_size=None``: the whole stream is one block, the reference's zero padding).
    Initialised to the identity (``base_kernel[:, 0] = 1``, rest 0, projection 0): ``prepare(x)`` returns
    ``x`` and ``finish(u)`` returns ``u``, bit for bit. ``own_init``: ``DFlashDrafter.reset_parameters``
    leaves it to ``reset_parameters`` here.
    """

    own_init = True

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"conv_group_size: {group_size} does not divide hidden_size {hidden_size}")
        self.kernel_size = int(kernel_size)
        self.group_size = int(group_size)
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, self.kernel_size, hidden_size))
        # skip_init: no random draw (the identity init below does not need one, and the drafter's other
        # weights then draw exactly what DFlash's draw)
        self.kernel_projection = nn.utils.skip_init(nn.Linear, hidden_size, 2 * self.kernel_size * self.num_groups,
                                                    bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity: ``base_kernel[:, 0, :] = 1``, other taps 0, ``kernel_projection.weight = 0``."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0, :] = 1.0
            self.kernel_projection.weight.zero_()

    def _conv(self, u: torch.Tensor, phase: int, dyn: torch.Tensor, block_size: int | None) -> torch.Tensor:
        """Phase ``phase`` of ``u [Q, H]`` with dynamic coefficients ``dyn [Q, K, G]``."""
        q, h = u.shape
        g, s = self.num_groups, self.group_size
        base = self.base_kernel[phase].to(u.dtype).view(self.kernel_size, g, s)
        dyn = dyn.to(u.dtype)
        slot = torch.arange(q, device=u.device)
        if block_size is not None:
            slot = slot % int(block_size)
        out = torch.zeros(q, g, s, dtype=u.dtype, device=u.device)
        for k in range(self.kernel_size):
            if k == 0:
                shifted = u
            else:
                shifted = F.pad(u, (0, 0, k, 0))[:q]
                shifted = torch.where((slot >= k)[:, None], shifted, torch.zeros_like(shifted))
            sg = shifted.view(q, g, s)
            out = out + base[k] * sg
            out = out + dyn[:, k, :, None] * sg
        return out.view(q, h)

    def prepare(self, x: torch.Tensor, block_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [Q, H]`` (the normed sublayer input) -> ``(phase 0 of x [Q, H], finish coefficients [Q, K, G])``."""
        q = x.shape[0]
        dyn = self.kernel_projection(x.to(self.kernel_projection.weight.dtype)
                                     if not torch.is_autocast_enabled(x.device.type) else x)
        dyn = dyn.view(q, 2, self.kernel_size, self.num_groups)
        return self._conv(x, 0, dyn[:, 0], block_size), dyn[:, 1]

    def finish(self, u: torch.Tensor, dyn_finish: torch.Tensor, block_size: int | None) -> torch.Tensor:
        """Phase 1 of the sublayer output ``u [Q, H]`` with ``prepare``'s coefficients -> ``[Q, H]``."""
        return self._conv(u, 1, dyn_finish, block_size)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    """A DFlash decoder layer with a ``GroupedDynamicCausalConv`` around each sublayer (``attention_conv``,
    ``mlp_conv``), inside the residual branch:

    ``a = input_layernorm(h); a', dA = attention_conv.prepare(a); h = h + attention_conv.finish(self_attn(a'), dA)``;
    ``m = post_attention_layernorm(h); m', dM = mlp_conv.prepare(m); h = h + mlp_conv.finish(mlp(m'), dM)``.

    The block length of the stream is ``draft_block_size`` (else ``block_size``, the structured form's; both
    None: the stream is one block)."""

    def __init__(self, cfg: DFlash2Config, layer_type: str = "full_attention", is_causal: bool = False):
        super().__init__(cfg, layer_type, is_causal)
        self.attention_conv = GroupedDynamicCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_conv = GroupedDynamicCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, x, ctx_kv, cos, sin, attn_mask, block_size=None, draft_block_size=None):
        b = draft_block_size or block_size
        a, d_a = self.attention_conv.prepare(self.input_layernorm(x), b)
        x = x + self.attention_conv.finish(self.self_attn(a, ctx_kv, cos, sin, attn_mask, block_size), d_a, b)
        m, d_m = self.mlp_conv.prepare(self.post_attention_layernorm(x), b)
        return x + self.mlp_conv.finish(self.mlp(m), d_m, b)


class CandidateSelector(nn.Module):
    """Chooses each draft slot's token among its top-K logits with a hidden-state-modulated low-rank bigram
    score (z-lab/dflash ``CandidateSelector``, read, not copied).

    Parameters: ``hidden_projection`` (Linear ``H -> R``, no bias; zero at init, so the scores are then the
    unary logits and the greedy walk is DFlash's argmax), ``predecessor_codebook`` and ``successor_codebook``
    (Embedding ``V x R``, ~ N(0, initializer_range)). The score of candidate token ``s`` at a slot with
    hidden state ``h``, unary logit ``u`` and predecessor token ``p`` is

        ``score = u + sum_r P[p, r] * (W h)[r] * S[s, r]``.

    ``select`` is the reference's procedure: top-K of each row, then a *sequential* left-to-right walk: the
    predecessor of the first slot is the anchor, of every later slot the token chosen at the slot before;
    greedy takes each slot's argmax given that predecessor, sampling draws from ``softmax(score / T)`` over the
    K candidates. There is no Viterbi/beam search: the greedy walk maximises each step given the previous
    choice, *not* the summed score of the whole path (the tests check the walk against an explicit loop over
    every candidate's score, and show by brute force over all K*K pairs that the best-sum pair may differ).
    ``own_init``: initialised by ``reset_parameters`` (the drafter calls it after its Qwen3 init).
    """

    own_init = True

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int, initializer_range: float = 0.02,
                 initialise: bool = True):
        super().__init__()
        if not 1 <= top_k <= vocab_size:
            raise ValueError(f"selector_top_k: must be in 1..{vocab_size}, got {top_k}")
        self.top_k = int(top_k)
        self.initializer_range = float(initializer_range)
        self.hidden_projection = nn.utils.skip_init(nn.Linear, hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.utils.skip_init(nn.Embedding, vocab_size, rank)
        self.successor_codebook = nn.utils.skip_init(nn.Embedding, vocab_size, rank)
        if initialise:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """``hidden_projection = 0``; codebooks ~ N(0, initializer_range) (predecessor, then successor)."""
        with torch.no_grad():
            self.hidden_projection.weight.zero_()
            nn.init.normal_(self.predecessor_codebook.weight, mean=0.0, std=self.initializer_range)
            nn.init.normal_(self.successor_codebook.weight, mean=0.0, std=self.initializer_range)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, H]`` -> ``W h [N, R]`` (in the projection's dtype unless autocast decides)."""
        w = self.hidden_projection.weight
        if not torch.is_autocast_enabled(hidden.device.type):
            hidden = hidden.to(w.dtype)
        return self.hidden_projection(hidden)

    def pair_scores(self, z: torch.Tensor, unary: torch.Tensor, cand: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
        """``scores`` from the projected hidden states ``z [N, R]`` (``project``)."""
        e = self.predecessor_codebook(pred.long()) * z.to(self.predecessor_codebook.weight.dtype)   # [N, R]
        pair = torch.einsum("nr,nkr->nk", e, self.successor_codebook(cand.long()))
        return unary.float() + pair.float()

    def scores(self, hidden: torch.Tensor, unary: torch.Tensor, cand: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
        """``[N, K] float32``: ``unary + <P[pred] * hidden_projection(hidden), S[cand]>`` for ``hidden [N, H]``,
        ``unary [N, K]`` (the candidates' logits), ``cand [N, K] long`` (their token ids), ``pred [N] long``."""
        return self.pair_scores(self.project(hidden), unary, cand, pred)

    @torch.no_grad()
    def select(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: int, temperature: float = 0.0,
               generator: torch.Generator | None = None, probs=None,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The walk over ``L`` slots (see the class): ``hidden [L, H]`` (final-normed), ``logits [L, V]`` (the
        unary logits), ``anchor`` the token before slot 0.

        Returns ``(path [L] long, cand [L, K] long, q [L, K] float32 or None)``: ``cand`` the top-K ids of each
        row (sorted by logit, descending), ``path[i]`` the chosen token, ``q[i]`` the distribution it was drawn
        from given ``path[i - 1]`` (``temperature > 0``; None when greedy). ``generator``: used for the draws
        (a CPU generator with device tensors: drawn on the CPU). Raises ``ValueError`` naming ``temperature``
        unless it is a finite number ``>= 0``. ``probs`` (sampling only): ``scores [K] -> q [K]``, default
        ``softmax(scores / temperature)`` as the reference; a caller's top-k/top-p filter plugs in here.
        """
        t = temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature: must be a finite number >= 0 (0 = greedy), got {t!r}")
        n, dev = logits.shape[0], logits.device
        k = min(self.top_k, logits.shape[-1])
        unary, cand = torch.topk(logits.float(), k, dim=-1, sorted=True)
        if n == 0:
            return cand[:, 0], cand, (torch.empty(0, k, device=dev) if t > 0 else None)
        # every slot's scores for every possible predecessor at once: slot 0's one predecessor is the anchor,
        # slot i's are the K candidates of slot i - 1; then the walk runs on the host over [n, K, K] numbers
        # (one transfer instead of a few kernels and a round trip per slot)
        z = self.project(hidden).to(self.predecessor_codebook.weight.dtype)                          # [n, R]
        preds = torch.cat([torch.full((1, k), int(anchor), dtype=torch.long, device=dev), cand[:-1]])  # [n, K]
        e = self.predecessor_codebook(preds) * z[:, None, :]                                         # [n, K, R]
        pair = torch.einsum("npr,nkr->npk", e, self.successor_codebook(cand)).float()                # [n, Kp, K]
        table = (unary[:, None, :] + pair).cpu()
        cand_host = cand.cpu()
        idx_path, qs, prev = [], [], 0
        for i in range(n):
            sc = table[i, prev]
            if t > 0:
                qi = probs(sc) if probs is not None else torch.softmax(sc / float(t), dim=-1)
                prev = int(torch.multinomial(qi, 1, generator=generator if generator is None
                                             or generator.device.type == "cpu" else None))
                qs.append(qi)
            else:
                prev = int(sc.argmax())
            idx_path.append(prev)
        path = cand_host[torch.arange(n), torch.tensor(idx_path)].to(dev)
        q = torch.stack(qs).to(dev) if t > 0 else None
        return path, cand, q


class DFlash2Drafter(DFlashDrafter):
    """The DFlash2 draft model (see the module docstring): ``DFlashDrafter`` with ``DFlash2DecoderLayer`` layers,
    a ``candidate_selector``, scaled/soft-capped logits and ``propose_block``. Training forward, masks (every
    form and layer-type variant), cache and ``draft_block`` are DFlash's; ``trainable_state_dict`` and
    ``load_trainable`` cover the new weights."""

    layer_class = DFlash2DecoderLayer

    def __init__(self, cfg: DFlash2Config):
        if not isinstance(cfg, DFlash2Config):
            raise ValueError(f"DFlash2Drafter: needs a DFlash2Config, got {type(cfg).__name__}")
        super().__init__(cfg)

    def _add_modules(self) -> None:
        c = self.config
        self.candidate_selector = CandidateSelector(c.hidden_size, c.vocab_size, c.selector_rank, c.selector_top_k,
                                                    c.initializer_range, initialise=False)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` -> ``[..., V]``: ``output_multiplier * head(hidden)``, then ``c * tanh(x / c)`` with
        ``c = final_logit_softcapping`` when set (in the head's output dtype, as the reference)."""
        x = super().logits(hidden)
        m, c = self.config.output_multiplier, self.config.final_logit_softcapping
        if m != 1.0:
            x = x * m
        if c is not None:
            x = c * torch.tanh(x / c)
        return x

    def head_spec(self):
        """``logits``' head with its output multiplier and softcap (``shared.models.dflash.HeadSpec``)."""
        spec = super().head_spec()
        return HeadSpec(spec.weight, float(self.config.output_multiplier), self.config.final_logit_softcapping)

    @torch.no_grad()
    def propose_block(self, ctx_hidden: torch.Tensor, ctx_positions: torch.Tensor, anchor_token: int,
                      anchor_pos: int, cache: DraftCache | None = None, block_size: int | None = None,
                      temperature: float = 0.0, generator: torch.Generator | None = None, probs=None,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, DraftCache]:
        """Draft one block and choose its tokens with the selector: ``draft_block_hidden`` (same arguments and
        cache rules as ``draft_block``), then ``candidate_selector.select`` over rows ``1..B-1`` with their
        final-normed hidden states and unary logits, the anchor as the first predecessor.

        Returns ``(path [B-1] long, cand [B-1, K] long, q [B-1, K] float32 or None (greedy), cache)``: the draft
        for positions ``anchor_pos + 1 ..``, the candidates, and the distribution each draft was drawn from
        (zero outside ``cand``), for rejection sampling."""
        hidden, logits, cache = self.draft_block_hidden(ctx_hidden, ctx_positions, anchor_token, anchor_pos, cache,
                                                        block_size)
        path, cand, q = self.candidate_selector.select(hidden[1:], logits[1:], anchor_token, temperature, generator,
                                                       probs)
        return path, cand, q, cache


def build_drafter2(dcfg: DFlash2Config, target_dir: str | Path | None = None, device: str | torch.device = "cpu",
                   dtype: torch.dtype = torch.float32) -> DFlash2Drafter:
    """A DFlash2 drafter with trainable weights in ``dtype`` on ``device`` and, when ``target_dir`` is given, the
    target's frozen embedding/head loaded (in the checkpoint's dtype)."""
    model = DFlash2Drafter(dcfg).to(device=device, dtype=dtype)
    if target_dir is not None:
        model.load_target_head(target_dir)
    return model
