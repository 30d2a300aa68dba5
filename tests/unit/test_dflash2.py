"""The DFlash2 drafter (shared/models/dflash2.py) and the attention variants it shares with DFlash (sliding window,
causal block): identity at init, block-local convolution, masks in every form and at inference, the selector's
walk, logit scaling, parameter names of the public checkpoint (z-lab/dflash dflash/model.py)."""

import itertools
import json

import pytest
import torch

from specring.shared.drafters.dflash_blocks import build_block_batch, sample_anchors
from specring.shared.models.dflash import DFlashConfig, DFlashDrafter, layer_masks
from specring.shared.models.dflash2 import (
    CandidateSelector,
    DFlash2Config,
    DFlash2Drafter,
    GroupedDynamicCausalConv,
)
from specring.shared.models.draft_attention import (
    build_attention_mask,
    build_context_mask,
    build_flex_mask,
)
from tests.support import TARGET

H, V, B = 32, 50, 4
BASE = dict(hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=V, max_position_embeddings=256,
            target_layer_ids=[0, 1], num_target_layers=2, block_size=B, mask_token_id=3, target_model_type="qwen3",
            tie_word_embeddings=False)
V2 = dict(conv_kernel_size=2, conv_group_size=8, selector_top_k=5, selector_rank=6)
VARIANTS = {
    "plain": {},
    "sliding": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6),
    "causal_sliding": dict(layer_types=["sliding_attention"] * 2, sliding_window=5, is_causal=True),
}


def _head(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, H, generator=g).to(dtype), torch.randn(V, H, generator=g).to(dtype)


def _pair(variant="plain", dtype=torch.float32, **v2):
    """A DFlash drafter and an untrained DFlash2 drafter holding the same DFlash weights and head."""
    torch.manual_seed(0)
    d1 = DFlashDrafter(DFlashConfig(**BASE, **VARIANTS[variant])).to(dtype).eval()
    d2 = DFlash2Drafter(DFlash2Config(**BASE, **VARIANTS[variant], **{**V2, **v2})).to(dtype).eval()
    missing, unexpected = d2.load_state_dict(d1.state_dict(), strict=False)
    assert not unexpected and all(".attention_conv." in k or ".mlp_conv." in k or k.startswith("candidate_selector.")
                                  for k in missing)
    for d in (d1, d2):
        d.load_frozen(*_head(0, dtype))
    return d1, d2


def _perturb(d2, scale=0.3, seed=5):
    """Move every DFlash2-only weight away from its identity init (so the convolution mixes slots)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in d2.named_parameters():
            if "_conv." in n or "candidate_selector.hidden_projection" in n:
                p.add_(scale * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))
    return d2


def _packed(seed=0, lens=(9, 20, 15), dtype=torch.float32, anchors_per_seq=3):
    gen = torch.Generator().manual_seed(seed)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    t = int(cu[-1])
    ids = torch.randint(4, V, (t,), generator=gen)
    lm = torch.ones(t, dtype=torch.uint8)
    anchors = sample_anchors(lm, cu, anchors_per_seq, B, gen)
    bb = build_block_batch(ids, lm, cu, anchors, B, 3)
    hidden = torch.randn(t, 2 * H, generator=gen).to(dtype)
    return ids, cu, bb, hidden


def _run(model, bb, cu, hidden, form, **extra):
    cfg = model.config
    t = hidden.shape[0]
    if form == "dense":
        m, f = layer_masks(cfg, build_attention_mask, bb.anchors, cu, B), None
    elif form == "structured":
        m, f = layer_masks(cfg, build_context_mask, bb.anchors, cu, B), B
    else:
        m, f = layer_masks(cfg, build_flex_mask, bb.anchors, bb.seq_start, t, B, tile=16), None
    return model(bb.block_input_ids, bb.block_positions, hidden, bb.ctx_positions, m, block_size=f, **extra)


# ---------------------------------------------------------------------------------------------- config
def test_config_fields_validation_and_round_trip():
    c = DFlash2Config(**BASE, **V2, output_multiplier=0.5, final_logit_softcapping=20)
    assert c.conv_num_groups == 4 and c.final_logit_softcapping == 20.0
    assert DFlash2Config.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    d = DFlash2Config(**BASE)
    assert (d.conv_kernel_size, d.conv_group_size, d.selector_top_k, d.selector_rank) == (2, 16, 16, 256)
    assert (d.output_multiplier, d.final_logit_softcapping, d.layer_types, d.sliding_window, d.is_causal) == \
        (1.0, None, None, None, False)
    bad = [
        (dict(conv_group_size=5), "conv_group_size"), (dict(conv_kernel_size=0), "conv_kernel_size"),
        (dict(selector_top_k=V + 1), "selector_top_k"), (dict(selector_top_k=0), "selector_top_k"),
        (dict(selector_rank=0), "selector_rank"), (dict(output_multiplier=0.0), "output_multiplier"),
        (dict(output_multiplier=float("inf")), "output_multiplier"),
        (dict(final_logit_softcapping=0.0), "final_logit_softcapping"),
        (dict(final_logit_softcapping=-1.0), "final_logit_softcapping"),
    ]
    for kw, field in bad:
        with pytest.raises(ValueError, match=field):
            DFlash2Config(**BASE, **{**V2, **kw})


@pytest.mark.parametrize("cls", [DFlashConfig, DFlash2Config])
def test_attention_variant_fields_are_validated(cls):
    ok = cls(**BASE, layer_types=["sliding_attention", "full_attention"], sliding_window=4, is_causal=True)
    assert ok.resolved_layer_types() == ["sliding_attention", "full_attention"] and not ok.plain_attention
    assert ok.attention_variants() == {"sliding_attention": {"window": 4, "causal": True},
                                       "full_attention": {"window": None, "causal": True}}
    plain = cls(**BASE)
    assert plain.plain_attention and plain.resolved_layer_types() == ["full_attention"] * 2
    assert cls(**BASE, sliding_window=100).plain_attention  # a window without sliding layers changes nothing
    bad = [
        (dict(layer_types=["full_attention"]), "layer_types"),
        (dict(layer_types=["full_attention", "chunked_attention"]), "layer_types"),
        (dict(layer_types="sliding_attention"), "layer_types"),
        (dict(layer_types=["sliding_attention"] * 2), "sliding_window"),
        (dict(layer_types=["sliding_attention"] * 2, sliding_window=0), "sliding_window"),
        (dict(layer_types=["sliding_attention"] * 2, sliding_window=B - 1), "sliding_window"),
        (dict(sliding_window=2.5), "sliding_window"),
        (dict(is_causal=None), "is_causal"),
    ]
    for kw, field in bad:
        with pytest.raises(ValueError, match=field):
            cls(**BASE, **kw)


def test_from_target_takes_the_new_fields():
    c = DFlashConfig.from_target(TARGET, [1, 3, 5], block_size=4, mask_token_id=3, num_draft_layers=2)
    assert (c.layer_types, c.sliding_window, c.is_causal) == (None, None, False)
    c = DFlashConfig.from_target(TARGET, [1, 3, 5], block_size=4, mask_token_id=3, num_draft_layers=2,
                                 sliding_window=64, layer_types="sliding_attention", is_causal=True)
    assert c.layer_types == ["sliding_attention"] * 2 and c.sliding_window == 64 and c.is_causal
    c2 = DFlash2Config.from_target(TARGET, [1, 3, 5], block_size=4, mask_token_id=3, num_draft_layers=2,
                                   layer_types=["full_attention", "sliding_attention"], sliding_window=8,
                                   conv_kernel_size=3, conv_group_size=32, selector_top_k=8, selector_rank=16,
                                   output_multiplier=0.25, final_logit_softcapping=30.0)
    assert isinstance(c2, DFlash2Config) and c2.hidden_size == 256 and c2.conv_num_groups == 8
    assert (c2.conv_kernel_size, c2.selector_top_k, c2.selector_rank) == (3, 8, 16)
    assert (c2.output_multiplier, c2.final_logit_softcapping) == (0.25, 30.0)
    with pytest.raises(ValueError, match="conv_group_size"):
        DFlash2Config.from_target(TARGET, [1, 3, 5], mask_token_id=3, conv_group_size=7)


# ---------------------------------------------------------------------------------------------- names, init
def test_parameter_names_and_shapes_match_the_public_header():
    k, g, r = V2["conv_kernel_size"], H // V2["conv_group_size"], V2["selector_rank"]
    _, d2 = _pair()
    sd = d2.trainable_state_dict()
    for i in range(2):
        for conv in ("attention_conv", "mlp_conv"):
            assert sd[f"layers.{i}.{conv}.base_kernel"].shape == (2, k, H)
            assert sd[f"layers.{i}.{conv}.kernel_projection.weight"].shape == (2 * k * g, H)
    assert sd["candidate_selector.hidden_projection.weight"].shape == (r, H)
    assert sd["candidate_selector.predecessor_codebook.weight"].shape == (V, r)
    assert sd["candidate_selector.successor_codebook.weight"].shape == (V, r)
    d1_names = set(DFlashDrafter(DFlashConfig(**BASE)).trainable_state_dict())
    extra = set(sd) - d1_names
    assert d1_names <= set(sd) and len(extra) == 2 * 4 + 3
    assert not any(n in sd for n in ("embed_tokens.weight", "lm_head.weight"))
    # the reference checkpoint's sizes (dflash2-safetensors-header.json): one conv is 26,624 + 11,075,584 values
    conv = GroupedDynamicCausalConv(6656, 2, 16)
    assert conv.base_kernel.shape == (2, 2, 6656) and conv.kernel_projection.weight.shape == (1664, 6656)
    assert sum(p.numel() for p in conv.parameters()) == 11_102_208


def test_identity_init_survives_reset_parameters_and_seeds_draw_dflash_weights():
    torch.manual_seed(7)
    d1 = DFlashDrafter(DFlashConfig(**BASE))
    torch.manual_seed(7)
    d2 = DFlash2Drafter(DFlash2Config(**BASE, **V2))
    sd1, sd2 = d1.state_dict(), d2.state_dict()
    for n, t in sd1.items():
        assert torch.equal(t, sd2[n]), n  # the new modules draw nothing before DFlash's weights
    _perturb(d2)
    d2.reset_parameters()
    for layer in d2.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            want = torch.zeros_like(conv.base_kernel)
            want[:, 0] = 1
            assert torch.equal(conv.base_kernel, want)
            assert not conv.kernel_projection.weight.any()
    sel = d2.candidate_selector
    assert not sel.hidden_projection.weight.any()
    assert 0.01 < float(sel.predecessor_codebook.weight.detach().std()) < 0.03  # N(0, initializer_range = 0.02)


def test_trainable_round_trip_includes_the_new_weights():
    _, d2 = _pair()
    _perturb(d2)
    sd = {k: v.clone() for k, v in d2.trainable_state_dict().items()}
    fresh = DFlash2Drafter(d2.config)
    fresh.load_trainable(sd, "test")
    for n, t in fresh.trainable_state_dict().items():
        assert torch.equal(t, sd[n]), n
    with pytest.raises(ValueError, match="missing"):
        fresh.load_trainable({k: v for k, v in sd.items() if "mlp_conv" not in k}, "test")
    with pytest.raises(ValueError, match="DFlash2Config"):
        DFlash2Drafter(DFlashConfig(**BASE))


# ---------------------------------------------------------------------------------------------- identity = DFlash
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@torch.no_grad()
def test_untrained_dflash2_computes_exactly_what_dflash_computes(variant):
    d1, d2 = _pair(variant)
    _, cu, bb, hidden = _packed(1)
    for form in ("dense", "structured", "flex"):
        h1, h2 = _run(d1, bb, cu, hidden, form), _run(d2, bb, cu, hidden, form)
        assert torch.equal(h1, h2), form
        assert torch.equal(d1.logits(h1), d2.logits(h2)), form
    s0 = int(cu[1])
    p = int(bb.anchors[(bb.anchors > s0 + 6) & (bb.anchors < int(cu[2]))][0])
    pos = torch.arange(p - s0)
    l1, _ = d1.draft_block(hidden[s0:p], pos, 7, p - s0)
    l2, _ = d2.draft_block(hidden[s0:p], pos, 7, p - s0)
    assert torch.equal(l1, l2)
    path, cand, q, cache = d2.propose_block(hidden[s0:p], pos, 7, p - s0)
    assert q is None and cache.length == p - s0 and cand.shape == (B - 1, V2["selector_top_k"])
    assert torch.equal(path, l1[1:].argmax(-1))  # the selector's scores are the unary logits at init
    hid, l3, _ = d2.draft_block_hidden(hidden[s0:p], pos, 7, p - s0)
    assert torch.equal(l3, l2) and hid.shape == (B, H)


# ---------------------------------------------------------------------------------------------- convolution
def _naive_conv(conv, u, x, phase, block):
    """out[t, c] = sum_k (base[p, k, c] + dyn[t, p, k, g(c)]) * u[t-k, c], zero when t mod B < k, by loops."""
    k_n, s = conv.kernel_size, conv.group_size
    dyn = (x @ conv.kernel_projection.weight.T).view(x.shape[0], 2, k_n, conv.num_groups)
    out = torch.zeros_like(u)
    for t in range(u.shape[0]):
        for k in range(k_n):
            if t % block < k:
                continue
            for c in range(u.shape[1]):
                out[t, c] += (conv.base_kernel[phase, k, c] + dyn[t, phase, k, c // s]) * u[t - k, c]
    return out


@torch.no_grad()
def test_conv_formula_identity_and_block_locality():
    torch.manual_seed(0)
    hs, blk = 8, 4
    conv = GroupedDynamicCausalConv(hs, 3, 4).double()
    x = torch.randn(3 * blk, hs, dtype=torch.float64)
    u = torch.randn(3 * blk, hs, dtype=torch.float64)
    y, d = conv.prepare(x, blk)
    assert torch.equal(y, x) and torch.equal(conv.finish(u, d, blk), u)  # identity, bit for bit
    conv.base_kernel.normal_()
    conv.kernel_projection.weight.normal_()
    y, d = conv.prepare(x, blk)
    assert torch.allclose(y, _naive_conv(conv, x, x, 0, blk), atol=1e-12)
    assert torch.allclose(conv.finish(u, d, blk), _naive_conv(conv, u, x, 1, blk), atol=1e-12)
    # one block (block_size None) = the reference's zero padding at the stream start only
    y1, _ = conv.prepare(x, None)
    assert torch.allclose(y1, _naive_conv(conv, x, x, 0, 10 ** 6), atol=1e-12)
    # which rows of u each output row depends on: itself and the 2 rows before it, inside its own block
    for t in range(3 * blk):
        for src in range(3 * blk):
            u2 = u.clone()
            u2[src] += 1.0
            changed = not torch.equal(conv.finish(u2, d, blk)[t], conv.finish(u, d, blk)[t])
            assert changed == (src // blk == t // blk and 0 <= t - src <= 2), (t, src)


@torch.no_grad()
def test_model_conv_never_crosses_a_block_boundary():
    _, d2 = _pair("plain")
    _perturb(d2)
    _, cu, bb, hidden = _packed(2)
    base = _run(d2, bb, cu, hidden, "dense").view(-1, B, H)
    for blk in range(bb.num_blocks):
        ids = bb.block_input_ids.clone()
        ids[blk * B] = (ids[blk * B] + 1 - 4) % (V - 4) + 4
        bb2 = type(bb)(**{**bb.__dict__, "block_input_ids": ids})
        out = _run(d2, bb2, cu, hidden, "dense").view(-1, B, H)
        for other in range(bb.num_blocks):
            assert torch.equal(out[other], base[other]) == (other != blk), (blk, other)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@torch.no_grad()
def test_trained_dflash2_forms_agree_and_draft_block_matches_training(variant):
    """With the convolutions and selector away from the identity: dense == structured == flex, and draft_block
    (one block, cached context) equals the block's rows of the packed training forward."""
    _, d2 = _pair(variant, dtype=torch.float64)
    _perturb(d2)
    _, cu, bb, hidden = _packed(3, dtype=torch.float64)
    dense = _run(d2, bb, cu, hidden, "dense")
    assert torch.allclose(dense, _run(d2, bb, cu, hidden, "structured"), atol=1e-10)
    assert torch.allclose(dense, _run(d2, bb, cu, hidden, "flex"), atol=1e-10)
    logits = d2.logits(dense).view(-1, B, V)
    for blk in range(bb.num_blocks):
        s = int(bb.block_seq[blk])
        s0, p = int(cu[s]), int(bb.anchors[blk])
        one, _ = d2.draft_block(hidden[s0:p], torch.arange(p - s0), int(bb.block_input_ids[blk * B]), p - s0)
        assert torch.allclose(one, logits[blk].float(), atol=1e-5), blk


# ---------------------------------------------------------------------------------------------- sliding window
def _brute_context_mask(anchors, cu, b, window, t):
    rows = []
    for a in anchors.tolist():
        s = max(i for i in range(len(cu) - 1) if int(cu[i]) <= a)
        for j in range(b):
            rows.append([int(cu[s]) <= c < a and (window is None or a + j - c < window) for c in range(t)])
    return torch.tensor(rows, dtype=torch.bool)


@pytest.mark.parametrize("window", [None, 4, 5, 9])
def test_window_masks_follow_the_definition(window):
    _, cu, bb, _ = _packed(4)
    t = int(cu[-1])
    want = _brute_context_mask(bb.anchors, cu, B, window, t)
    assert torch.equal(build_context_mask(bb.anchors, cu, B, window=window), want)
    dense = build_attention_mask(bb.anchors, cu, B, window=window, causal=True)
    assert torch.equal(dense[:, :t], want)
    q = bb.anchors.numel() * B
    r = torch.arange(q)
    assert torch.equal(dense[:, t:], (r[:, None] // B == r[None, :] // B) & (r[None, :] <= r[:, None]))
    with pytest.raises(ValueError, match="window"):
        build_context_mask(bb.anchors, cu, B, window=0)


@pytest.mark.parametrize("cls", [DFlashDrafter, DFlash2Drafter])
@torch.no_grad()
def test_context_outside_the_window_has_no_influence(cls):
    """In an all-sliding drafter a block changes with context inside its window and with nothing else; with one
    full layer it changes with all context before the anchor again."""
    w = 5
    kind = DFlash2Config if cls is DFlash2Drafter else DFlashConfig
    extra = V2 if cls is DFlash2Drafter else {}
    for types in (["sliding_attention"] * 2, ["sliding_attention", "full_attention"]):
        torch.manual_seed(0)
        model = cls(kind(**BASE, **extra, layer_types=types, sliding_window=w)).double().eval()
        model.load_frozen(*_head(0, torch.float64))
        if cls is DFlash2Drafter:
            _perturb(model)
        _, cu, bb, hidden = _packed(5, lens=(30,), dtype=torch.float64, anchors_per_seq=2)
        base = _run(model, bb, cu, hidden, "dense").view(-1, B, H)
        for blk, a in enumerate(bb.anchors.tolist()):
            for c in range(0, a):
                h2 = hidden.clone()
                h2[c] += 3.0
                changed = not torch.allclose(_run(model, bb, cu, h2, "dense").view(-1, B, H)[blk], base[blk],
                                             atol=1e-9)
                in_window = a - c < w  # slot j sees c > a + j - w: slot 0 reaches furthest back
                assert changed == (in_window or "full_attention" in types), (types, blk, a, c)


@pytest.mark.parametrize("variant", ["sliding", "causal_sliding"])
@torch.no_grad()
def test_draft_block_respects_window_and_causality(variant):
    d1, _ = _pair(variant, dtype=torch.float64)
    _, cu, bb, hidden = _packed(6, lens=(30,), dtype=torch.float64, anchors_per_seq=3)
    logits = d1.logits(_run(d1, bb, cu, hidden, "dense")).view(-1, B, V)
    blk = int(torch.argmax(bb.anchors))
    p = int(bb.anchors[blk])
    tok = int(bb.block_input_ids[blk * B])
    one, cache = d1.draft_block(hidden[:p], torch.arange(p), tok, p)
    assert torch.allclose(one, logits[blk].float(), atol=1e-5)
    w = d1.config.sliding_window
    far = hidden.clone()
    far[:p - w + 1] += 5.0  # only the full layer (variant "sliding") may see these
    two, _ = d1.draft_block(far[:p], torch.arange(p), tok, p)
    assert torch.allclose(two, one, atol=1e-6) == (variant == "causal_sliding")
    with pytest.raises(ValueError, match="sliding_window"):
        d1.draft_block(hidden[:p], torch.arange(p), tok, p, block_size=w + 1)


@torch.no_grad()
def test_forward_refuses_a_single_mask_for_sliding_or_causal_layers():
    d1, d2 = _pair("sliding")
    _, cu, bb, hidden = _packed(7)
    for model in (d1, d2):
        with pytest.raises(ValueError, match="layer_masks"):
            model(bb.block_input_ids, bb.block_positions, hidden, bb.ctx_positions,
                  build_attention_mask(bb.anchors, cu, B))
        with pytest.raises(ValueError, match="sliding_attention"):
            model(bb.block_input_ids, bb.block_positions, hidden, bb.ctx_positions,
                  {"full_attention": build_attention_mask(bb.anchors, cu, B)})
        wrong = {t: build_flex_mask(bb.anchors, bb.seq_start, hidden.shape[0], B, tile=16)
                 for t in ("full_attention", "sliding_attention")}
        with pytest.raises(ValueError, match="window"):
            model(bb.block_input_ids, bb.block_positions, hidden, bb.ctx_positions, wrong)
    plain, _ = _pair("plain")  # a plain drafter takes one mask as before, or the dict
    m = build_attention_mask(bb.anchors, cu, B)
    one = plain(bb.block_input_ids, bb.block_positions, hidden, bb.ctx_positions, m)
    assert torch.equal(one, plain(bb.block_input_ids, bb.block_positions, hidden, bb.ctx_positions,
                                  {"full_attention": m}))


# ---------------------------------------------------------------------------------------------- selector
def _selector(seed=0, k=4, r=3, hs=6, v=12, scale=1.0):
    torch.manual_seed(seed)
    sel = CandidateSelector(hs, v, r, k).double()
    with torch.no_grad():
        sel.hidden_projection.weight.normal_(0, scale)
        sel.predecessor_codebook.weight.normal_(0, scale)
        sel.successor_codebook.weight.normal_(0, scale)
    return sel


def _explicit_score(sel, hidden_row, logit_row, pred, tok):
    """``logit[tok] + sum_r P[pred, r] * (W h)[r] * S[tok, r]``, written out term by term."""
    w = sel.hidden_projection.weight.detach()
    z = [sum(float(w[r, c]) * float(hidden_row[c]) for c in range(w.shape[1])) for r in range(w.shape[0])]
    p, s = sel.predecessor_codebook.weight.detach(), sel.successor_codebook.weight.detach()
    return float(logit_row[tok]) + sum(float(p[pred, r]) * z[r] * float(s[tok, r]) for r in range(len(z)))


def _naive_walk(sel, hidden, logits, anchor):
    """The greedy walk by an independent loop: per slot, enumerate its top-K tokens and score each explicitly."""
    pred, path = anchor, []
    for i in range(logits.shape[0]):
        cands = sorted(range(logits.shape[1]), key=lambda t: -float(logits[i, t]))[:sel.top_k]
        best = max(cands, key=lambda t: _explicit_score(sel, hidden[i], logits[i], pred, t))
        path.append(best)
        pred = best
    return path


@pytest.mark.parametrize("seed", range(4))
def test_greedy_walk_equals_the_explicit_per_step_argmax(seed):
    sel = _selector(seed)
    g = torch.Generator().manual_seed(100 + seed)
    hidden = torch.randn(5, 6, generator=g, dtype=torch.float64)
    logits = torch.randn(5, 12, generator=g, dtype=torch.float64)
    path, cand, q = sel.select(hidden, logits, anchor=3)
    assert q is None and cand.shape == (5, 4)
    assert path.tolist() == _naive_walk(sel, hidden, logits, 3)
    # scores() is the same formula, vectorised
    pred = torch.cat([torch.tensor([3]), path[:-1]])
    unary = logits.gather(1, cand)
    sc = sel.scores(hidden, unary, cand, pred)
    for i, kk in itertools.product(range(5), range(4)):
        want = _explicit_score(sel, hidden[i], logits[i], int(pred[i]), int(cand[i, kk]))
        assert abs(float(sc[i, kk].detach()) - want) < 1e-5  # scores() returns float32


def test_two_slots_brute_force_over_all_pairs_and_greedy_is_not_viterbi():
    """L = 2: enumerate all K*K candidate pairs with the explicit score formula. The walk's first token is the
    argmax of slot 0 given the anchor; its second is the argmax of slot 1 given that first token, i.e. the best
    pair among those starting with the greedy first choice. It is *not* in general the pair with the best summed
    score (no Viterbi in the reference): a seed where the two differ is found and the walk still takes the greedy."""
    found_non_viterbi = False
    for seed in range(60):
        sel = _selector(seed, scale=1.5)
        g = torch.Generator().manual_seed(seed)
        hidden = torch.randn(2, 6, generator=g, dtype=torch.float64)
        logits = torch.randn(2, 12, generator=g, dtype=torch.float64)
        path, cand, _ = sel.select(hidden, logits, anchor=5)
        pairs = {(int(a), int(b)): (_explicit_score(sel, hidden[0], logits[0], 5, int(a)),
                                    _explicit_score(sel, hidden[1], logits[1], int(a), int(b)))
                 for a, b in itertools.product(cand[0].tolist(), cand[1].tolist())}
        first = max({a for a, _ in pairs}, key=lambda a: pairs[(a, int(cand[1, 0]))][0])
        second = max((b for a, b in pairs if a == first), key=lambda b: pairs[(first, b)][1])
        assert path.tolist() == [first, second], seed
        best_sum = max(pairs, key=lambda ab: sum(pairs[ab]))
        if best_sum != (first, second):
            found_non_viterbi = True
            assert sum(pairs[best_sum]) > sum(pairs[(first, second)])
    assert found_non_viterbi


def test_sampled_walk_distributions_and_reproducibility():
    sel = _selector(1)
    g = torch.Generator().manual_seed(9)
    hidden = torch.randn(4, 6, generator=g, dtype=torch.float64)
    logits = torch.randn(4, 12, generator=g, dtype=torch.float64)
    path, cand, q = sel.select(hidden, logits, 2, temperature=0.7, generator=torch.Generator().manual_seed(1))
    again, _, q2 = sel.select(hidden, logits, 2, temperature=0.7, generator=torch.Generator().manual_seed(1))
    assert torch.equal(path, again) and torch.equal(q, q2)
    assert q.dtype == torch.float32 and q.shape == (4, 4) and torch.allclose(q.sum(-1), torch.ones(4))
    pred = 2
    for i in range(4):
        assert int(path[i]) in cand[i].tolist()
        sc = torch.tensor([_explicit_score(sel, hidden[i], logits[i], pred, int(t)) for t in cand[i]],
                          dtype=torch.float64)
        assert torch.allclose(q[i].double(), torch.softmax(sc / 0.7, -1), atol=1e-6)
        pred = int(path[i])
    with pytest.raises(ValueError, match="temperature"):
        sel.select(hidden, logits, 2, temperature=-1.0)


def test_sampled_propose_block():
    _, d2 = _pair("plain")
    _perturb(d2)
    hidden = torch.randn(6, 2 * H)
    path, cand, q, cache = d2.propose_block(hidden, torch.arange(6), 5, 6, temperature=1.0,
                                            generator=torch.Generator().manual_seed(0))
    assert path.shape == (B - 1,) and q.shape == (B - 1, V2["selector_top_k"]) and cache.length == 6
    assert all(int(path[i]) in cand[i].tolist() for i in range(B - 1))


# ---------------------------------------------------------------------------------------------- logits
def test_output_multiplier_and_softcap():
    _, d2 = _pair("plain", output_multiplier=0.25, final_logit_softcapping=2.0)
    plain, _ = _pair("plain")
    h = torch.randn(7, H) * 5
    raw = plain.logits(h)
    assert torch.allclose(d2.logits(h), 2.0 * torch.tanh(0.25 * raw / 2.0), atol=1e-6)
    assert float(d2.logits(h).abs().max()) <= 2.0
    _, only_mult = _pair("plain", output_multiplier=0.5)
    assert torch.allclose(only_mult.logits(h), 0.5 * raw)
