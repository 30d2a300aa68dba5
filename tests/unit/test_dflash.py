"""The DFlash drafter (shared/models/dflash.py): config, frozen target head, forward semantics, inference cache."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import specring.shared.models.dflash as dflash
from specring.shared.drafters.dflash_blocks import build_block_batch
from specring.shared.models.dflash import DFlashConfig, DFlashDrafter, build_drafter
from specring.shared.models.draft_attention import build_attention_mask
from specring.shared.models.layer_ids import default_target_layer_ids
from tests.support import TARGET


def _target_tensor(name):
    index = json.loads((TARGET / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(TARGET / index[name]), framework="pt") as f:
        return f.get_tensor(name)


@pytest.fixture(scope="module")
def cfg():
    return DFlashConfig.from_target(TARGET, [1, 3, 5], block_size=4, num_draft_layers=2)


@pytest.fixture(scope="module")
def drafter(cfg):
    torch.manual_seed(0)
    return build_drafter(cfg, TARGET).eval()


def test_default_layer_ids():
    assert default_target_layer_ids(8, 5) == [1, 2, 3, 4, 5]
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(8, 1) == [4]
    assert default_target_layer_ids(8, 2) == [1, 5]
    # more layers than the 8-layer target can spread: as many distinct ones as it has (1..5), as the producer
    wide = DFlashConfig.from_target(TARGET, None, mask_token_id=3, num_target_layers=9)
    assert wide.target_layer_ids == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="duplicate"):
        DFlashConfig.from_target(TARGET, [1, 3, 1], mask_token_id=3)


def test_config_from_target(cfg, tmp_path):
    assert ((cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads)
            == (256, 768, 4, 2))
    assert (cfg.head_dim, cfg.vocab_size, cfg.rope_theta, cfg.rms_norm_eps) == (64, 8192, 10000.0, 1e-6)
    assert cfg.num_hidden_layers == 2 and cfg.num_target_layers == 3 and cfg.target_layer_ids == [1, 3, 5]
    assert cfg.tie_word_embeddings and cfg.target_model_type == "qwen3"
    assert cfg.mask_token_id == 3  # fixture tokenizer has no mask token: its pad token <|pad|>
    assert DFlashConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    # transformers-4 style config: plain rope_theta; default layer ids; draft layers = captured layers
    raw = json.loads((TARGET / "config.json").read_text())
    raw.pop("rope_parameters")
    raw["rope_theta"] = 1e6
    (tmp_path / "config.json").write_text(json.dumps(raw))
    c2 = DFlashConfig.from_target(tmp_path, None, block_size=16, mask_token_id=7, num_target_layers=2)
    assert c2.rope_theta == 1e6 and c2.target_layer_ids == [1, 5] and c2.num_hidden_layers == 2
    with pytest.raises(ValueError, match="target_layer_ids"):
        DFlashConfig.from_target(tmp_path, [1, 8], mask_token_id=7)


def test_parameter_names_match_public_dflash_layout(drafter):
    names = set(drafter.trainable_state_dict())
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(2):
        p = f"layers.{i}."
        expected |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        expected |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
        expected |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        expected |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
    assert names == expected
    assert drafter.fc.weight.shape == (256, 3 * 256)


def test_head_is_the_targets_bit_for_bit_frozen_and_gets_no_gradient(cfg, drafter):
    embed = _target_tensor("model.embed_tokens.weight")
    assert drafter.embed_tokens.weight.dtype == embed.dtype == torch.bfloat16
    assert torch.equal(drafter.embed_tokens.weight.view(torch.int16), embed.view(torch.int16))
    assert drafter.lm_head.weight is drafter.embed_tokens.weight  # tied in the fixture
    assert not drafter.embed_tokens.weight.requires_grad
    d = build_drafter(cfg, TARGET).train()
    q, c = 8, 6
    ids = torch.randint(0, 8192, (q,))
    h = d(ids, torch.arange(c, c + q), torch.randn(c, 3 * 256), torch.arange(c), None)
    d.logits(h).logsumexp(-1).sum().backward()
    assert d.embed_tokens.weight.grad is None and d.lm_head.weight.grad is None
    assert d.fc.weight.grad is not None and d.fc.weight.grad.abs().sum() > 0
    assert torch.equal(d.lm_head.weight.view(torch.int16), embed.view(torch.int16))


def test_head_loading_reads_only_those_tensors(cfg, monkeypatch):
    import safetensors

    asked = []
    real = safetensors.safe_open

    class Spy:
        def __init__(self, *a, **k):
            self.f = real(*a, **k)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            asked.append(name)
            return self.f.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    DFlashDrafter(cfg).load_target_head(TARGET)
    assert asked == ["model.embed_tokens.weight"]


def test_untied_target_gets_its_own_head(cfg, tmp_path):
    for f in TARGET.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, tmp_path / f.name)
    embed = _target_tensor("model.embed_tokens.weight")
    head = (embed.float() * 0.5).to(torch.bfloat16)
    save_file({"model.embed_tokens.weight": embed, "lm_head.weight": head}, str(tmp_path / "model.safetensors"))
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["tie_word_embeddings"] = False
    (tmp_path / "config.json").write_text(json.dumps(raw))
    c = DFlashConfig.from_target(tmp_path, [1, 3, 5], block_size=4, num_draft_layers=1)
    d = build_drafter(c, tmp_path)
    assert not c.tie_word_embeddings and d.lm_head.weight is not d.embed_tokens.weight
    assert torch.equal(d.lm_head.weight, head) and torch.equal(d.embed_tokens.weight, embed)
    (tmp_path / "model.safetensors").unlink()
    save_file({"model.embed_tokens.weight": embed}, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match="lm_head"):
        build_drafter(c, tmp_path)


def test_forward_refuses_without_target_head(cfg):
    d = DFlashDrafter(cfg)
    with pytest.raises(RuntimeError, match="load_target_head"):
        d(torch.zeros(4, dtype=torch.long), torch.arange(4), torch.zeros(2, 768), torch.arange(2), None)


def _packed_problem(gen):
    cu = torch.tensor([0, 9, 14, 26], dtype=torch.int32)
    t = int(cu[-1])
    ids = torch.randint(4, 8192, (t,), generator=gen).to(torch.int32)
    lm = torch.ones(t, dtype=torch.uint8)
    anchors = torch.tensor([2, 7, 9, 12, 14, 20, 24])
    hidden = torch.randn(t, 3 * 256, generator=gen)
    return ids, lm, cu, anchors, hidden


@torch.no_grad()
def test_forward_respects_the_mask(drafter):
    """A block's output changes with context before its anchor and with nothing else."""
    gen = torch.Generator().manual_seed(0)
    ids, lm, cu, anchors, hidden = _packed_problem(gen)
    bb = build_block_batch(ids, lm, cu, anchors, 4, drafter.config.mask_token_id)
    mask = build_attention_mask(anchors, cu, 4)
    def run(h):
        return drafter(bb.block_input_ids, bb.block_positions, h, bb.ctx_positions, mask).view(-1, 4, 256)
    base = run(hidden)
    for blk, p in enumerate(anchors.tolist()):
        s = int(bb.block_seq[blk])
        for c, expect_change in ((p, False), (p - 1, p - 1 >= int(cu[s])), (int(cu[-1]) - 1, False)):
            if c == int(cu[-1]) - 1 and s == len(cu) - 2:
                continue
            h2 = hidden.clone()
            h2[c] += 3.0
            changed = not torch.allclose(run(h2)[blk], base[blk], atol=1e-6)
            assert changed == expect_change, (blk, p, c)


@torch.no_grad()
def test_draft_block_matches_training_forward_and_cache_is_incremental(drafter):
    gen = torch.Generator().manual_seed(1)
    ids, lm, cu, anchors, hidden = _packed_problem(gen)
    bb = build_block_batch(ids, lm, cu, anchors, 4, drafter.config.mask_token_id)
    mask = build_attention_mask(anchors, cu, 4)
    train_logits = drafter.logits(drafter(bb.block_input_ids, bb.block_positions, hidden, bb.ctx_positions,
                                          mask)).view(-1, 4, drafter.config.vocab_size)
    blk = 5  # anchor 20 in sequence 2 (packed 14..25): context 14..19, positions 0..5
    p = int(anchors[blk])
    s0 = int(cu[2])
    pos = torch.arange(p - s0)
    one, _ = drafter.draft_block(hidden[s0:p], pos, int(ids[p]), p - s0)
    assert torch.allclose(one, train_logits[blk], atol=1e-4)
    # feed the same context in two pieces through the cache
    _, cache = drafter.draft_block(hidden[s0:s0 + 2], pos[:2], int(ids[s0 + 2]), 2)
    two, cache = drafter.draft_block(hidden[s0 + 2:p], pos[2:], int(ids[p]), p - s0, cache)
    assert cache.length == p - s0
    assert torch.allclose(two, one, atol=1e-4)
    # crop rolls back context; a cache reaching the anchor is refused
    cache.crop(2)
    three, _ = drafter.draft_block(hidden[s0 + 2:p], pos[2:], int(ids[p]), p - s0, cache)
    assert torch.allclose(three, one, atol=1e-4)
    with pytest.raises(ValueError, match="anchor_pos"):
        drafter.draft_block(hidden[s0:p], pos, int(ids[p]), 1)


def test_rope_matches_hf_qwen3():
    """Our RoPE equals transformers' Qwen3 rotary embedding + apply_rotary_pos_emb."""
    from transformers import AutoConfig
    from transformers.models.qwen3 import modeling_qwen3 as mq

    conf = AutoConfig.from_pretrained(str(TARGET))
    rot = mq.Qwen3RotaryEmbedding(conf)
    pos = torch.tensor([[0, 3, 17, 100]])
    x = torch.randn(1, 4, 4, 64)
    cos, sin = rot(x, pos)
    ref, _ = mq.apply_rotary_pos_emb(x, x, cos, sin)
    c2, s2 = dflash.rope_cos_sin(pos[0], 64, 10000.0)
    ours = dflash.apply_rope(x[0], c2, s2)
    assert torch.allclose(ours, ref[0], atol=1e-5)


@torch.no_grad()
def test_decoder_layer_matches_hf_qwen3_layer(cfg):
    """Without context and with a causal mask, a draft layer is exactly a Qwen3 decoder layer: this pins
    RMSNorm, q/k norm, RoPE, GQA, SwiGLU and the residual structure to the target family's definition."""
    from transformers import AutoConfig
    from transformers.models.qwen3 import modeling_qwen3 as mq

    conf = AutoConfig.from_pretrained(str(TARGET))
    conf._attn_implementation = "sdpa"
    torch.manual_seed(0)
    ours = dflash.DFlashDecoderLayer(cfg)
    for p in ours.parameters():
        p.normal_(0, 0.05) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    ref = mq.Qwen3DecoderLayer(conf, layer_idx=0)
    ref.load_state_dict(ours.state_dict(), strict=True)
    q = 7
    x = torch.randn(1, q, 256)
    pos = torch.arange(10, 10 + q)
    causal = torch.ones(q, q, dtype=torch.bool).tril()
    cos, sin = mq.Qwen3RotaryEmbedding(conf)(x, pos[None])
    want = ref(x, attention_mask=causal[None, None], position_ids=pos[None], position_embeddings=(cos, sin))
    want = want[0] if isinstance(want, tuple) else want
    c2, s2 = dflash.rope_cos_sin(pos, 64, cfg.rope_theta)
    empty = torch.empty(2, 0, 64)
    got = ours(x[0], (empty, empty), c2, s2, causal)
    assert torch.allclose(got, want[0], atol=1e-5), (got - want[0]).abs().max()
