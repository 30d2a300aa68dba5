"""The structured DFlash attention (context mask + own block) equals dense attention under the full mask."""

import torch

from consumer.blocks import build_attention_mask, build_block_batch, build_context_mask, sample_anchors
from consumer.dflash import DFlashConfig, DFlashDrafter, block_attention


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
    from consumer.blocks import IGNORE, block_loss, loss_weights
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
