"""The drafter contract and registry (shared/drafters/): named step statistics, the D-PACE weights, the DFlash2
selector's training targets, and dispatch by family (issue 22)."""

from __future__ import annotations

import math

import pytest
import torch

from specring.shared.drafters import NAMES, family_of, get_family
from specring.shared.drafters.contract import COMMON_STATS, StepStats
from specring.shared.drafters.dflash2 import selector_targets
from specring.shared.drafters.dflash_blocks import IGNORE, block_loss, dpace_weights, loss_weights
from specring.shared.models.dflash import DFlashConfig
from specring.shared.models.dflash2 import DFlash2Config
from specring.shared.models.eagle3 import Eagle3Config
from specring.shared.transport.slot_batch import SlotBatch


def test_step_stats_are_named_sums_in_one_buffer():
    layout = {**{k: 1 for k in COMMON_STATS}, "correct": 3}
    a, b = StepStats(layout), StepStats(layout)
    a["loss_sum"] += 2.0
    a["correct"] += torch.tensor([1.0, 0.0, 2.0], dtype=torch.float64)
    b["loss_sum"] += 0.5
    b["correct"][1] += 4
    a.add(b)
    host = a.host()
    assert host["loss_sum"] == 2.5 and host["correct"] == [1.0, 4.0, 2.0]
    assert a.flat().numel() == len(COMMON_STATS) + 3            # what all_reduce sums: one float64 buffer
    a.flat().mul_(2)                                            # reducing the buffer updates every statistic
    assert a.host()["loss_sum"] == 5.0
    with pytest.raises(KeyError, match="no statistic 'nope'"):
        a["nope"]
    with pytest.raises(ValueError, match="lacks the common statistics"):
        StepStats({"correct": 3})


def test_dpace_weights_by_hand():
    # CE 0, ln 2, ln 4 -> q = 1, 1/2, 1/4; alpha 0.5 -> q' = 1, 3/4, 5/8; prefix products 1, 3/4, 15/32
    ce = torch.tensor([[0.0, math.log(2), math.log(4)]])
    w = dpace_weights(ce, torch.ones(1, 3, dtype=torch.bool), 0.5)
    assert torch.allclose(w, torch.tensor([[1 + 0.75 + 15 / 32, 0.75 + 15 / 32, 15 / 32]]))
    # an unlabelled slot cannot be accepted: q = 0 there (q' = alpha) and its own weight is 0
    w = dpace_weights(ce, torch.tensor([[True, False, True]]), 0.5)
    assert torch.allclose(w, torch.tensor([[1 + 0.5 + 0.5 * 0.625, 0.0, 0.5 * 0.625]]))
    # alpha 1: every q' is 1, the weights count the slots from j to the end
    assert torch.equal(dpace_weights(ce, torch.ones(1, 3, dtype=torch.bool), 1.0), torch.tensor([[3.0, 2.0, 1.0]]))
    with pytest.raises(ValueError, match="dpace_alpha"):
        dpace_weights(ce, torch.ones(1, 3, dtype=torch.bool), 1.5)


def test_block_loss_dpace_weighs_each_slot_by_its_dpace_weight():
    torch.manual_seed(0)
    a, b, h, v = 3, 4, 8, 11
    head = torch.randn(v, h)
    hidden = torch.randn(a * b, h)
    labels = torch.randint(0, v, (a, b))
    labels[:, 0] = IGNORE
    labels[1, 3] = IGNORE
    out = block_loss(lambda x: x @ head.T, hidden, labels, loss_weights(b, 7.0), loss="dpace", dpace_alpha=0.5)
    logits = (hidden.view(a, b, h)[:, 1:] @ head.T).reshape(-1, v)
    ce = torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1), reduction="none",
                                           ignore_index=IGNORE).view(a, b - 1)
    w = dpace_weights(ce, labels[:, 1:] != IGNORE, 0.5)
    assert torch.allclose(out.weighted_ce, (ce * w).sum()) and torch.allclose(out.weight_sum, w.sum())
    with pytest.raises(ValueError, match="loss: must be ce or dpace"):
        block_loss(lambda x: x @ head.T, hidden, labels, loss_weights(b, 7.0), loss="mse")


def test_selector_targets_insert_the_gold_token_when_the_top_k_misses_it():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0],     # gold 1 is in the top 3
                           [5.0, 4.0, 3.0, 2.0, 1.0],     # gold 4 is not: it replaces the last candidate
                           [5.0, 4.0, 3.0, 2.0, 1.0]])    # unlabelled: the top 3 as they are
    gold = torch.tensor([1, 4, IGNORE])
    cand, target, in_top = selector_targets(logits, gold, 3)
    assert cand[0].tolist() == [0, 1, 2] and int(target[0]) == 1 and bool(in_top[0])
    assert cand[1].tolist() == [0, 1, 4] and int(target[1]) == 2 and not bool(in_top[1])
    assert cand[2].tolist() == [0, 1, 2] and not bool(in_top[2])


def _tiny(cls, **kw):
    return cls(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
               head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=40, max_position_embeddings=256,
               target_layer_ids=[0], num_target_layers=1, block_size=4, **kw)


def test_the_registry_finds_each_family_by_name_config_and_model():
    assert set(NAMES) == {"dflash", "dflash2", "eagle3"}
    d1 = _tiny(DFlashConfig)
    d2 = _tiny(DFlash2Config, conv_group_size=8, selector_rank=4, selector_top_k=4)
    assert family_of(d1).name == "dflash" and family_of(d2).name == "dflash2"   # the most derived class wins
    assert family_of(get_family("dflash2").build(d2)).name == "dflash2"
    assert get_family("eagle3").config_cls is Eagle3Config
    with pytest.raises(ValueError, match="unknown drafter family 'medusa'"):
        get_family("medusa")
    with pytest.raises(TypeError):
        family_of(object())


def test_the_selector_loss_is_the_k_way_cross_entropy_of_the_scores_by_hand():
    """DFlash2's chunk objective on one block of B=3: candidates from the unary logits (gold inserted), the
    gold previous token (the anchor for slot 1) as predecessor, CE over the K scores, weighted like the slot."""
    from types import SimpleNamespace

    from specring.shared.config.run_config import TrainerConfig
    from specring.shared.drafters.contract import ObjectiveContext

    torch.manual_seed(0)
    dcfg = _tiny(DFlash2Config, conv_group_size=8, selector_rank=4, selector_top_k=3)
    dcfg.block_size = 3
    fam = get_family("dflash2")
    model = fam.build(dcfg)
    with torch.no_grad():  # a selector that is not the identity, so the scores differ from the unary logits
        model.candidate_selector.hidden_projection.weight.normal_()
    tc = TrainerConfig(block_size=3, selector_loss_alpha=0.5, label_source="data")
    ctx = ObjectiveContext(model=model, tcfg=tc, dcfg=dcfg, device=torch.device("cpu"), attention="structured",
                           max_mask_elems=2 ** 20, loss_chunk_rows=64)
    stats = StepStats(fam.stats_layout(dcfg, tc))
    bb = SimpleNamespace(block_input_ids=torch.tensor([7, 0, 0]))      # anchor 7, two mask slots
    extra = fam.chunk_objective(ctx, stats, bb)
    logits = torch.randn(2, 40)
    hidden = torch.randn(2, 32)
    lab = torch.tensor([[int(logits[0].argmax()), int(logits[1].argmin())]])   # slot 2's gold is not in the top 3
    w = loss_weights(3, tc.resolved_gamma())[1:]
    loss = extra(logits, hidden, lab, 0, 1, w[None, :])
    sel = model.candidate_selector
    expected = 0.0
    for j, prev in enumerate([7, int(lab[0, 0])]):
        cand = logits[j].topk(3).indices.clone()
        gold = int(lab[0, j])
        if gold not in cand.tolist():
            cand[-1] = gold
        scores = sel.scores(hidden[j:j + 1], logits[j:j + 1].gather(1, cand[None]), cand[None], torch.tensor([prev]))
        ce = torch.nn.functional.cross_entropy(scores, torch.tensor([cand.tolist().index(gold)]))
        expected += float(w[j]) * ce.item()
    assert abs(loss.item() - 0.5 * expected) < 1e-5
    host = stats.host()
    assert host["topk_hit"] == [0.0, 1.0, 0.0] and host["selector_loss_sum"] == [pytest.approx(loss.item())]



def test_with_dpace_the_selector_is_weighted_like_the_slot_cross_entropy():
    """DFlash2 + D-PACE: the selector loss uses each slot's D-PACE weight, not the decay (a mixed normaliser
    over-weighted it), so an untrained DFlash2 reports DFlash's loss under D-PACE too."""
    from specring.shared.config.run_config import TrainerConfig
    from specring.shared.drafters.contract import ObjectiveContext

    torch.manual_seed(0)
    b = 4
    d1 = _tiny(DFlashConfig)
    d2 = _tiny(DFlash2Config, conv_group_size=8, selector_rank=4, selector_top_k=4)
    m1, m2 = get_family("dflash").build(d1), get_family("dflash2").build(d2)
    head = torch.randn(40, 32)
    for m in (m1, m2):
        m.load_frozen(torch.randn(40, 32, generator=torch.Generator().manual_seed(1)), head)
    m2.load_trainable(m1.trainable_state_dict() | {k: v for k, v in m2.trainable_state_dict().items()
                                                   if k not in m1.trainable_state_dict()}, "test")
    ids = torch.randint(0, 40, (24,))
    batch = SlotBatch(hidden=torch.randn(24, 32), input_ids=ids.int(), loss_mask=torch.ones(24, dtype=torch.uint8),
                      cu_seqlens=torch.tensor([0, 12, 24], dtype=torch.int32))
    out = {}
    for name, m, dc in (("dflash", m1, d1), ("dflash2", m2, d2)):
        tc = TrainerConfig(block_size=b, num_anchors=4, loss="dpace", dpace_alpha=0.0, label_source="data",
                           selector_loss_alpha=1.0)
        fam = get_family(name)
        ctx = ObjectiveContext(model=m, tcfg=tc, dcfg=dc, device=torch.device("cpu"), attention="structured",
                               max_mask_elems=2 ** 20, loss_chunk_rows=64)
        out[name] = fam.step_metrics(fam.objective(ctx, batch, [3], 24, False).host())
    assert out["dflash2"]["loss"] == pytest.approx(out["dflash"]["loss"], rel=1e-5)
    # an untrained selector scores its K candidates by their unary logits, and a K-way cross-entropy over a subset
    # holding the gold token is at most the full one: with the same slot weights the selector loss is at most the
    # block loss (weighted by the decay over D-PACE's normaliser it was orders of magnitude larger at alpha 0)
    assert 0 < out["dflash2"]["selector_loss"] <= out["dflash"]["loss"] + 1e-6, out
