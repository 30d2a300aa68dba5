"""The structured DFlash attention (context mask + own block) equals dense attention under the full mask."""

import pytest
import torch

from specring.shared.drafters.dflash_blocks import build_block_batch, sample_anchors
from specring.shared.models.dflash import DFlashConfig, DFlashDrafter
from specring.shared.models.draft_attention import (
    block_attention,
    build_attention_mask,
    build_context_mask,
)


def test_block_attention_matches_dense_sdpa():
    torch.manual_seed(0)
    hq, hkv, d, b = 4, 2, 8, 4
    cu = torch.tensor([0, 7, 12, 20])
    anchors = torch.tensor([0, 3, 5, 7, 10, 13, 18])
    ctx_mask = build_context_mask(anchors, cu, b)
    dense = build_attention_mask(anchors, cu, b)
    qn, c = anchors.numel() * b, int(cu[-1])
    q = torch.randn(hq, qn, d, dtype=torch.float64)
    kc, vc = torch.randn(hkv, c, d, dtype=torch.float64), torch.randn(hkv, c, d, dtype=torch.float64)
    kb, vb = torch.randn(hkv, qn, d, dtype=torch.float64), torch.randn(hkv, qn, d, dtype=torch.float64)
    got = block_attention(q, kc, vc, kb, vb, ctx_mask, b)
    k = torch.cat([kc, kb], 1).repeat_interleave(hq // hkv, 0)
    v = torch.cat([vc, vb], 1).repeat_interleave(hq // hkv, 0)
    want = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=dense[None, None])[0]
    assert torch.allclose(got, want, atol=1e-10)
    # a block anchored at a sequence start sees no context at all, only itself: still finite
    assert torch.isfinite(got).all()


def test_drafter_structured_forward_equals_dense_forward():
    torch.manual_seed(1)
    cfg = DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=50,
                       max_position_embeddings=128, target_layer_ids=[0, 1], num_target_layers=2, block_size=4,
                       mask_token_id=3, target_model_type="qwen3", tie_word_embeddings=True)
    model = DFlashDrafter(cfg).double()
    model.load_frozen(torch.randn(50, 32, dtype=torch.float64), None)
    cu = torch.tensor([0, 9, 20], dtype=torch.int32)
    ids = torch.randint(4, 50, (20,))
    lm = torch.ones(20, dtype=torch.uint8)
    anchors = sample_anchors(lm, cu, 3, 4, torch.Generator().manual_seed(0))
    bb = build_block_batch(ids, lm, cu, anchors, 4, 3)
    hidden = torch.randn(20, 64, dtype=torch.float64)
    dense = model(bb.block_input_ids, bb.block_positions, hidden, bb.ctx_positions,
                  build_attention_mask(bb.anchors, cu, 4))
    structured = model(bb.block_input_ids, bb.block_positions, hidden, bb.ctx_positions,
                       build_context_mask(bb.anchors, cu, 4), block_size=4)
    assert torch.allclose(dense, structured, atol=1e-9)


def test_chunked_loss_backward_equals_one_shot():
    """block_loss in chunks with per-chunk backward gives the same loss, statistics and gradient."""
    from specring.shared.drafters.dflash_blocks import IGNORE, block_loss, loss_weights
    torch.manual_seed(2)
    head = torch.randn(40, 8, dtype=torch.float64)
    hidden = torch.randn(6 * 4, 8, dtype=torch.float64)
    labels = torch.randint(0, 40, (6, 4))
    labels[:, 0] = IGNORE
    labels[2, 3] = IGNORE
    w = loss_weights(4, 2.0).double()
    fn = lambda x: x @ head.T  # noqa: E731
    h1 = hidden.clone().requires_grad_(True)
    one = block_loss(fn, h1, labels, w)
    one.weighted_ce.backward()
    h2 = hidden.clone().requires_grad_(True)
    chunked = block_loss(fn, h2, labels, w, chunk_rows=5, backward=True)
    assert torch.allclose(one.weighted_ce.detach(), chunked.weighted_ce)
    assert torch.allclose(h1.grad, h2.grad)
    assert torch.equal(one.correct, chunked.correct) and torch.equal(one.accept_sum, chunked.accept_sum)


def _flex_case(seed: int, block_size: int, tile: int):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 60, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen)
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    t = int(cu[-1])
    lm = (torch.rand(t, generator=gen) < 0.85).to(torch.uint8)
    ids = torch.randint(4, 50, (t,), generator=gen)
    anchors = sample_anchors(lm, cu, 7, block_size, gen)
    return ids, lm, cu, anchors


@pytest.mark.parametrize("seed,block_size,tile", [(0, 4, 16), (1, 4, 8), (2, 3, 16), (3, 8, 16), (4, 5, 8)])
def test_flex_mask_equals_the_dense_mask_and_its_tiles_cover_it(seed, block_size, tile):
    """The mask function reproduces build_attention_mask on the real rows/columns; every allowed element lies
    in a listed tile; every tile listed as full is allowed everywhere on the real rows."""
    from specring.shared.models.draft_attention import build_flex_mask
    ids, lm, cu, anchors = _flex_case(seed, block_size, tile)
    if anchors.numel() == 0:
        pytest.skip("no anchors drawn")
    bb = build_block_batch(ids, lm, cu, anchors, block_size, 3)
    fm = build_flex_mask(bb.anchors, bb.seq_start, int(cu[-1]), block_size, tile=tile)
    t, q = int(cu[-1]), anchors.numel() * block_size
    assert fm.q_len % tile == 0 and fm.ctx_len % tile == 0 and fm.q_len >= q and fm.ctx_len >= t
    qi = torch.arange(fm.q_len)[:, None]
    ki = torch.arange(fm.ctx_len + fm.q_len)[None, :]
    dense = fm.block_mask.mask_mod(0, 0, qi, ki)
    want = build_attention_mask(bb.anchors, cu, block_size)
    real_cols = torch.cat([torch.arange(t), fm.ctx_len + torch.arange(q)])
    assert torch.equal(dense[:q][:, real_cols], want)
    pad_cols = torch.ones(fm.ctx_len + fm.q_len, dtype=torch.bool)
    pad_cols[real_cols] = False
    assert not dense[:q][:, pad_cols].any()
    assert dense.any(dim=1).all(), "every row (padding too) sees at least its own block"
    bm = fm.block_mask
    nk = (fm.ctx_len + fm.q_len) // tile
    for i in range(fm.q_len // tile):
        listed = torch.zeros(nk, dtype=torch.bool)
        listed[bm.kv_indices[0, 0, i, :int(bm.kv_num_blocks[0, 0, i])].long()] = True
        full = bm.full_kv_indices[0, 0, i, :int(bm.full_kv_num_blocks[0, 0, i])].long()
        assert not listed[full].any(), "a tile is both partial and full"
        rows = dense[i * tile:(i + 1) * tile]
        for j in range(nk):
            cols = rows[:, j * tile:(j + 1) * tile]
            if j in full.tolist():
                real = min(tile, q - i * tile)
                assert cols[:real].all(), f"tile ({i},{j}) listed full but not all allowed"
            elif not listed[j]:
                assert not cols.any(), f"tile ({i},{j}) holds allowed elements but is not listed"


def test_drafter_flex_forward_equals_dense_forward():
    """Forward only: flex attention has no CPU backward (benchmarks/trainer.py --check compares gradients on
    CUDA)."""
    from specring.shared.models.draft_attention import build_flex_mask
    torch.manual_seed(3)
    cfg = DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=50,
                       max_position_embeddings=256, target_layer_ids=[0, 1], num_target_layers=2, block_size=4,
                       mask_token_id=3, target_model_type="qwen3", tie_word_embeddings=True)
    model = DFlashDrafter(cfg).double()
    model.load_frozen(torch.randn(50, 32, dtype=torch.float64), None)
    ids, lm, cu, anchors = _flex_case(5, 4, 16)
    t = int(cu[-1])
    bb = build_block_batch(ids, lm, cu, anchors, 4, 3)
    hidden = torch.randn(t, 64, dtype=torch.float64)
    fm = build_flex_mask(bb.anchors, bb.seq_start, t, 4, tile=16)
    with torch.no_grad():
        dense = model(bb.block_input_ids, bb.block_positions, hidden, bb.ctx_positions,
                      build_attention_mask(bb.anchors, cu, 4))
        flex = model(bb.block_input_ids, bb.block_positions, hidden, bb.ctx_positions, fm)
    assert flex.shape == dense.shape
    assert torch.allclose(dense, flex, atol=1e-9)


# ---------------------------------------------------------------------------------------------- attention variants
def test_causal_block_attention_matches_dense_sdpa():
    torch.manual_seed(4)
    hq, hkv, d, b = 4, 2, 8, 4
    cu = torch.tensor([0, 7, 12, 20])
    anchors = torch.tensor([0, 3, 5, 7, 10, 13, 18])
    ctx_mask = build_context_mask(anchors, cu, b, window=5)
    dense = build_attention_mask(anchors, cu, b, window=5, causal=True)
    qn, c = anchors.numel() * b, int(cu[-1])
    q = torch.randn(hq, qn, d, dtype=torch.float64)
    kc, vc = torch.randn(hkv, c, d, dtype=torch.float64), torch.randn(hkv, c, d, dtype=torch.float64)
    kb, vb = torch.randn(hkv, qn, d, dtype=torch.float64), torch.randn(hkv, qn, d, dtype=torch.float64)
    got = block_attention(q, kc, vc, kb, vb, ctx_mask, b, causal=True)
    k = torch.cat([kc, kb], 1).repeat_interleave(hq // hkv, 0)
    v = torch.cat([vc, vb], 1).repeat_interleave(hq // hkv, 0)
    want = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=dense[None, None])[0]
    assert torch.allclose(got, want, atol=1e-6)  # block_attention's softmax is float32
    assert not torch.allclose(got, block_attention(q, kc, vc, kb, vb, ctx_mask, b), atol=1e-3)


@pytest.mark.parametrize("seed,block_size,tile,window,causal", [
    (0, 4, 16, 4, False), (1, 4, 8, 5, True), (2, 3, 16, 17, False), (3, 8, 16, 9, True), (4, 5, 8, 40, True),
    (5, 4, 8, None, True), (6, 4, 16, 1000, False)])
def test_windowed_causal_flex_mask_equals_the_dense_mask_and_its_tiles_cover_it(seed, block_size, tile, window,
                                                                                 causal):
    """As the test above, for the sliding-window (``window``) and causal-block (``causal``) variants: the mask
    function reproduces build_attention_mask(window, causal) on the real rows, every allowed element lies in a
    listed tile, every tile listed as full is allowed everywhere on its real rows."""
    from specring.shared.models.draft_attention import build_flex_mask
    ids, lm, cu, anchors = _flex_case(seed, block_size, tile)
    if anchors.numel() == 0:
        pytest.skip("no anchors drawn")
    bb = build_block_batch(ids, lm, cu, anchors, block_size, 3)
    fm = build_flex_mask(bb.anchors, bb.seq_start, int(cu[-1]), block_size, tile=tile, window=window, causal=causal)
    assert (fm.block_size, fm.window, fm.causal) == (block_size, window, causal)
    t, q = int(cu[-1]), anchors.numel() * block_size
    qi = torch.arange(fm.q_len)[:, None]
    ki = torch.arange(fm.ctx_len + fm.q_len)[None, :]
    dense = fm.block_mask.mask_mod(0, 0, qi, ki)
    want = build_attention_mask(bb.anchors, cu, block_size, window=window, causal=causal)
    real_cols = torch.cat([torch.arange(t), fm.ctx_len + torch.arange(q)])
    assert torch.equal(dense[:q][:, real_cols], want)
    pad_cols = torch.ones(fm.ctx_len + fm.q_len, dtype=torch.bool)
    pad_cols[real_cols] = False
    assert not dense[:q][:, pad_cols].any()
    bm = fm.block_mask
    nk = (fm.ctx_len + fm.q_len) // tile
    fulls = 0
    for i in range(fm.q_len // tile):
        listed = torch.zeros(nk, dtype=torch.bool)
        listed[bm.kv_indices[0, 0, i, :int(bm.kv_num_blocks[0, 0, i])].long()] = True
        full = bm.full_kv_indices[0, 0, i, :int(bm.full_kv_num_blocks[0, 0, i])].long().tolist()
        assert not listed[full].any(), "a tile is both partial and full"
        rows = dense[i * tile:(i + 1) * tile]
        real = max(0, min(tile, q - i * tile))
        for j in range(nk):
            cols = rows[:, j * tile:(j + 1) * tile]
            if j in full:
                fulls += 1
                assert cols[:real].all(), f"tile ({i},{j}) listed full but not all allowed"
            elif not listed[j]:
                assert not cols[:real].any(), f"tile ({i},{j}) holds allowed elements but is not listed"
    if window is not None and window < tile:
        assert fulls == 0  # no tile of context can be visible to every row of a tile through a narrow window


def test_drafter_forms_agree_with_window_and_causal_block():
    """dense == structured == flex for a drafter with a sliding and a full layer and a causal block."""
    from specring.shared.models.dflash import layer_masks
    from specring.shared.models.draft_attention import build_flex_mask
    torch.manual_seed(5)
    cfg = DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=50,
                       max_position_embeddings=256, target_layer_ids=[0, 1], num_target_layers=2, block_size=4,
                       mask_token_id=3, target_model_type="qwen3", tie_word_embeddings=True,
                       layer_types=["sliding_attention", "full_attention"], sliding_window=6, is_causal=True)
    model = DFlashDrafter(cfg).double()
    model.load_frozen(torch.randn(50, 32, dtype=torch.float64), None)
    ids, lm, cu, anchors = _flex_case(7, 4, 16)
    t = int(cu[-1])
    bb = build_block_batch(ids, lm, cu, anchors, 4, 3)
    hidden = torch.randn(t, 64, dtype=torch.float64)
    run = lambda m, f=None: model(bb.block_input_ids, bb.block_positions, hidden, bb.ctx_positions, m,  # noqa: E731
                                  block_size=f)
    with torch.no_grad():
        dense = run(layer_masks(cfg, build_attention_mask, bb.anchors, cu, 4))
        structured = run(layer_masks(cfg, build_context_mask, bb.anchors, cu, 4), 4)
        flex = run(layer_masks(cfg, build_flex_mask, bb.anchors, bb.seq_start, t, 4, tile=16))
        unrestricted = build_attention_mask(bb.anchors, cu, 4)
        plain = run({"full_attention": unrestricted, "sliding_attention": unrestricted})
    assert torch.allclose(dense, structured, atol=1e-9) and torch.allclose(dense, flex, atol=1e-9)
    assert not torch.allclose(dense, plain, atol=1e-4)
