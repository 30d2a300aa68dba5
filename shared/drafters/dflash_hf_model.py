"""``DFlashDraftModel`` for transformers' ``AutoModel.from_pretrained(export_dir, trust_remote_code=True)``.

This module is also the modelling file of every export: ``shared.drafters.dflash_export`` writes it as
``modeling_dflash.py`` (``modeling_source()``) with the ``specring:inline`` import below replaced by the
source of specring's own drafter building blocks from ``shared/models/dflash.py``, so an export needs only torch
and transformers, and the served draft computes exactly what specring trained and evaluated (the test holds
its logits equal to ``DFlashDrafter``'s).

The interface follows the public DFlash draft model (z-lab/dflash ``dflash/model.py``: ``DFlashDraftModel``,
a ``Qwen3Config`` model whose ``forward(position_ids, noise_embedding, target_hidden)`` returns the block's
hidden states, ``compute_logits(hidden, output_head)`` and ``spec_generate(target, input_ids, ...)``); the
weights carry the reference's names (``fc``, ``hidden_norm``, ``layers.{i}.self_attn.{q,k,v,o}_proj``, ...).
Written here from that reading, not copied. Like the released drafts, the model has no embedding and no LM
head of its own: it uses the target's.

Shapes: ``B`` sequences, ``C`` context tokens, ``Q`` block tokens (anchor then mask tokens), ``H`` hidden
size, ``n`` captured target layers, ``V`` vocabulary.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass  # noqa: F401 (DraftCache, inlined in an export, is a dataclass)

import torch
import torch.nn.functional as F  # noqa: F401 (used by the inlined drafter definitions of an export)
from torch import nn
from transformers import PreTrainedModel
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

from specring.shared.models.dflash import (  # specring:inline
    DFlashDecoderLayer,
    DraftCache,
    RMSNorm,
    rope_cos_sin,
)

INLINED = ("RMSNorm", "rope_cos_sin", "apply_rope", "block_attention", "DFlashAttention", "SwiGLUMLP",
           "DFlashDecoderLayer", "DraftCache")  # what an export's modelling file holds of shared/models/dflash.py


def _dflash(config, name: str, default=None):
    """A DFlash field: ``config.dflash_config[name]``, else ``config.<name>``, else ``default``."""
    return (getattr(config, "dflash_config", None) or {}).get(name, getattr(config, name, default))


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else getattr(config, "rope_theta", 10000.0))


class DFlashDraftModel(PreTrainedModel):
    """DFlash draft model of an export directory (see the module docstring).

    Attributes from ``config.json``: ``target_layer_ids`` (the target layers whose outputs, concatenated,
    are the context features; id ``i`` is ``output_hidden_states[i + 1]``), ``block_size``, ``mask_token_id``.
    Raises ``ValueError`` when ``dflash_config.target_layer_ids`` or ``mask_token_id`` is missing.
    """

    config_class = Qwen3Config
    base_model_prefix = "dflash"
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config):
        super().__init__(config)
        ids = _dflash(config, "target_layer_ids")
        mask = _dflash(config, "mask_token_id")
        if not ids or mask is None:
            raise ValueError("config.json: dflash_config.target_layer_ids and dflash_config.mask_token_id are required")
        self.target_layer_ids = [int(i) for i in ids]
        self.block_size = int(_dflash(config, "block_size", 16))
        self.mask_token_id = int(mask)
        if not getattr(config, "head_dim", None):
            config.head_dim = config.hidden_size // config.num_attention_heads
        config.num_key_value_heads = config.num_key_value_heads or config.num_attention_heads
        self.rope_theta = _rope_theta(config)
        h = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """Qwen3 initialisation (only for weights an export lacks): linears ~ N(0, initializer_range), norms 1."""
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=getattr(self.config, "initializer_range", 0.02))
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    # ------------------------------------------------------------------ pieces
    def _dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def _rope(self, positions: torch.Tensor):
        return rope_cos_sin(positions, self.config.head_dim, self.rope_theta)

    def target_features(self, hidden_states) -> torch.Tensor:
        """``[B, T, n*H]``: the captured layers of a target forward's ``output_hidden_states`` (a tuple of
        ``L + 1`` tensors ``[B, T, H]``), concatenated in ``target_layer_ids`` order."""
        return torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)

    def extend_cache(self, target_hidden: torch.Tensor, positions: torch.Tensor,
                     cache: DraftCache | None = None) -> DraftCache:
        """Append context tokens (``target_hidden [C, n*H]`` at ``positions [C]``, one sequence) to the
        per-layer key/value ``cache`` (a new one when None) and return it."""
        if cache is None:
            empty = torch.empty(self.config.num_key_value_heads, 0, self.config.head_dim, device=self.fc.weight.device,
                                dtype=self._dtype())
            cache = DraftCache([empty] * len(self.layers), [empty] * len(self.layers),
                               torch.empty(0, dtype=torch.long, device=self.fc.weight.device))
        if target_hidden.shape[0] == 0:
            return cache
        ctx = self.hidden_norm(self.fc(target_hidden.to(self._dtype())))
        cos, sin = self._rope(positions)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.project_kv(ctx, cos, sin)
            cache.keys[i] = torch.cat([cache.keys[i], k], dim=1)
            cache.values[i] = torch.cat([cache.values[i], v], dim=1)
        cache.positions = torch.cat([cache.positions, positions.to(cache.positions)])
        return cache

    def draft(self, noise_embedding: torch.Tensor, positions: torch.Tensor, cache: DraftCache) -> torch.Tensor:
        """Hidden states ``[Q, H]`` (after the final norm) of one block, ``noise_embedding [Q, H]`` (the target's
        embedding of the anchor then ``Q - 1`` mask tokens) at ``positions [Q]``, against every context
        token in ``cache`` and the whole block."""
        x = noise_embedding.to(self._dtype())
        cos, sin = self._rope(positions)
        for i, layer in enumerate(self.layers):
            x = layer(x, (cache.keys[i], cache.values[i]), cos, sin, None)
        return self.norm(x)

    # ------------------------------------------------------------------ the reference's interface
    def forward(self, position_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                noise_embedding: torch.Tensor | None = None, target_hidden: torch.Tensor | None = None,
                past_key_values=None, use_cache: bool = False, **kwargs) -> torch.Tensor:
        """Block hidden states ``[B, Q, H]`` (after the final norm).

        ``target_hidden [B, C, n*H]``: the context's target features (``target_features``);
        ``noise_embedding [B, Q, H]``: the target's embedding of each block (anchor, then mask tokens);
        ``position_ids [B, C + Q]``: positions of the context tokens, then of the block tokens. Every block
        token attends to all ``C`` context tokens and to its whole block, so ``attention_mask`` must be None;
        a key/value cache is ``spec_generate``'s business (``past_key_values`` must be None). Map the result to
        logits with ``compute_logits(hidden, target.lm_head)``. Raises ``ValueError`` for a mask or cache.
        """
        if attention_mask is not None or past_key_values is not None:
            raise ValueError("DFlashDraftModel.forward: attention_mask and past_key_values are not supported "
                             "(a block sees its whole context); use spec_generate for incremental decoding")
        c = target_hidden.shape[1]
        out = []
        for b in range(noise_embedding.shape[0]):
            cache = self.extend_cache(target_hidden[b], position_ids[b, :c])
            out.append(self.draft(noise_embedding[b], position_ids[b, c:], cache))
        return torch.stack(out)

    def compute_logits(self, hidden: torch.Tensor, output_head: nn.Module) -> torch.Tensor:
        """``[..., H]`` -> ``[..., V]`` through the target's LM head (``output_head``, e.g. ``target.lm_head``),
        in the head's dtype (a bfloat16 draft may serve a float32 target)."""
        weight = getattr(output_head, "weight", None)
        return output_head(hidden if weight is None else hidden.to(weight.dtype))

    @torch.no_grad()
    def spec_generate(self, target: nn.Module, input_ids: torch.LongTensor, max_new_tokens: int,
                      stop_token_ids: list[int] | None = None, temperature: float = 0.0,
                      block_size: int | None = None) -> torch.LongTensor:
        """Greedy speculative decoding with ``target`` (the causal LM this draft was trained for): each round
        drafts a block from the anchor (the last token), verifies it with one target forward, keeps the
        longest agreeing prefix plus the target's own next token. Returns ``[1, P + N]`` (prompt, then
        ``N <= max_new_tokens`` tokens, ending at the first stop token): the same tokens as the target's
        greedy decoding. ``input_ids [1, P]``. Raises ``ValueError`` for a batch of more than one sequence
        and ``NotImplementedError`` for ``temperature > 0``.
        """
        if temperature and temperature > 0:
            raise NotImplementedError("spec_generate: only greedy decoding (temperature 0) is implemented")
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"spec_generate: input_ids must be [1, P], got {tuple(input_ids.shape)}")
        self.eval()
        bsz, stop = int(block_size or self.block_size), set(stop_token_ids or [])
        dev = input_ids.device
        head, embed = target.get_output_embeddings(), target.get_input_embeddings()
        out = target(input_ids, use_cache=True, output_hidden_states=True)
        past, p = out.past_key_values, input_ids.shape[1]
        cache_arg = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
        cache = self.extend_cache(self.target_features(out.hidden_states)[0], torch.arange(p, device=dev))
        tokens = [int(out.logits[0, -1].argmax())]
        pos = p                                     # position of tokens[-1], the next anchor
        while len(tokens) < max_new_tokens and tokens[-1] not in stop:
            k = min(bsz, max_new_tokens - len(tokens) + 1)
            block = [tokens[-1]]
            if k > 1:
                ids = torch.tensor([tokens[-1]] + [self.mask_token_id] * (k - 1), device=dev)
                hidden = self.draft(embed(ids), torch.arange(pos, pos + k, device=dev), cache)
                block += self.compute_logits(hidden[1:], head).argmax(-1).tolist()
            ver = target(torch.tensor([block], device=dev), **{cache_arg: past}, use_cache=True,
                         output_hidden_states=True, position_ids=torch.arange(pos, pos + k, device=dev)[None])
            post = ver.logits[0].argmax(-1).tolist()
            a = 0
            while a < k - 1 and block[a + 1] == post[a]:
                a += 1
            if a + 1 < k:  # drop the rejected drafts (a negative count: transformers 4 and 5 alike)
                past.crop(-(k - a - 1))
            cache = self.extend_cache(self.target_features(ver.hidden_states)[0, :a + 1],
                                      torch.arange(pos, pos + a + 1, device=dev), cache)
            tokens += block[1:a + 1] + [post[a]]
            pos += a + 1
        tokens = tokens[:max_new_tokens]
        for j, t in enumerate(tokens):
            if t in stop:
                tokens = tokens[:j + 1]
                break
        return torch.cat([input_ids, torch.tensor([tokens], dtype=input_ids.dtype, device=dev)], dim=1)


# The drafter's training-only attention form (block-sparse flex attention over packed batches) is never taken
# when drafting; these stand-ins keep the inlined definitions self-contained.
TRAINING_ONLY = '''class FlexMask:
    """Training-only attention form of specring (shared/drafters/dflash_blocks.py); never constructed at inference."""


def flex_attention_fn(compiled):
    raise NotImplementedError("flex attention is specring's training form; drafting uses the dense form")'''


def modeling_source() -> str:
    """The text of an export's ``modeling_dflash.py``: this module with its ``specring:inline`` import
    replaced by the source of ``INLINED`` from ``shared/models/dflash.py`` (``inspect.getsource``), so it runs
    with torch and transformers alone. Raises ``RuntimeError`` if the marker or a source is missing."""
    import ast
    import inspect
    import sys

    from specring.shared.models import dflash

    text = inspect.getsource(sys.modules[__name__])
    lines = text.splitlines(keepends=True)
    tree = ast.parse(text)
    marked = [(n.lineno - 1, n.end_lineno) for n in tree.body
              if isinstance(n, ast.ImportFrom) and "# specring:inline" in lines[n.lineno - 1]]
    if len(marked) != 1:
        raise RuntimeError("shared/drafters/dflash_hf_model.py: exactly one '# specring:inline' import expected")
    first, last = marked[0]
    imports_end = max(n.end_lineno for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)))
    blocks = "\n\n".join([TRAINING_ONLY] + [inspect.getsource(getattr(dflash, name)).rstrip() for name in INLINED])
    header = ("# Generated by specring (cli/export.py) from shared/drafters/dflash_hf_model.py "
              "and the drafter definition in\n"
              "# shared/models/dflash.py; regenerate with `launch.py export` instead of editing.\n")
    # the marked import goes; the inlined definitions follow the other imports (they use torch, nn, ...)
    body = "".join(lines[:first] + lines[last:imports_end]) + "\n\n# ---- from specring shared/models ----\n" + \
        blocks + "\n# ---- end of specring shared/models ----\n" + "".join(lines[imports_end:])
    cut = body.index("\n\ndef modeling_source()")
    return header + body[:cut].rstrip() + "\n"
