"""Anchors, blocks, the DFlash attention mask, labels and loss weights (shared/drafters/dflash_blocks.py)."""

import math

import pytest
import torch

from specring.shared.drafters.dflash_blocks import (
    IGNORE,
    block_loss,
    build_block_batch,
    eligible_anchors,
    loss_weights,
    sample_anchors,
    split_sequences,
)
from specring.shared.models.draft_attention import build_attention_mask


def _random_packed(gen: torch.Generator, num_seqs: int, max_len: int = 12):
    lens = torch.randint(2, max_len + 1, (num_seqs,), generator=gen)
    cu = torch.zeros(num_seqs + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    t = int(cu[-1])
    ids = torch.randint(4, 100, (t,), generator=gen, dtype=torch.int32)
    lm = (torch.rand(t, generator=gen) < 0.8).to(torch.uint8)
    return ids, lm, cu


def _reference_mask(anchors, cu, block_size):
    """Brute force: one loop per (query, key) pair, written from the rules, not from the implementation."""
    t = int(cu[-1])
    bounds = [(int(cu[s]), int(cu[s + 1])) for s in range(len(cu) - 1)]

    def seq_of(pos):
        return next(i for i, (a, b) in enumerate(bounds) if a <= pos < b)

    q = len(anchors) * block_size
    ref = torch.zeros(q, t + q, dtype=torch.bool)
    for qi in range(q):
        blk = qi // block_size
        p = int(anchors[blk])
        for c in range(t):
            ref[qi, c] = seq_of(c) == seq_of(p) and c < p
        for j in range(q):
            ref[qi, t + j] = j // block_size == blk
    return ref


@pytest.mark.parametrize("seed", range(8))
def test_mask_matches_brute_force_on_random_packed_batches(seed):
    gen = torch.Generator().manual_seed(seed)
    ids, lm, cu = _random_packed(gen, num_seqs=int(torch.randint(2, 5, (1,), generator=gen)))
    # every sequence's last eligible position is forced in, so blocks run past sequence ends
    ok = eligible_anchors(lm, cu)
    anchors = sample_anchors(lm, cu, num_anchors=3, block_size=4, generator=gen)
    extra = [int(torch.nonzero(ok[int(cu[s]):int(cu[s + 1])]).max()) + int(cu[s])
             for s in range(len(cu) - 1) if ok[int(cu[s]):int(cu[s + 1])].any()]
    anchors = torch.tensor(sorted(set(anchors.tolist()) | set(extra)), dtype=torch.long)
    assert anchors.numel() > 0
    mask = build_attention_mask(anchors, cu, block_size=4)
    ref = _reference_mask(anchors, cu, 4)
    assert mask.dtype == torch.bool and mask.shape == ref.shape
    assert torch.equal(mask, ref)
    # the two properties that matter most, stated directly
    t = int(cu[-1])
    for qi in range(mask.shape[0]):
        p = int(anchors[qi // 4])
        assert not mask[qi, p], "a draft token sees its own anchor's target state"
        s = int(torch.searchsorted(cu[1:].long(), torch.tensor(p), right=True))
        others = torch.ones(t, dtype=torch.bool)
        others[int(cu[s]):int(cu[s + 1])] = False
        assert not mask[qi, :t][others].any(), "a draft token sees another sequence"


def test_labels_and_weights_hand_worked():
    # two sequences: [10 11 12 13 14] and [20 21 22]; loss_mask 0 at token 12 and at token 20
    ids = torch.tensor([10, 11, 12, 13, 14, 20, 21, 22], dtype=torch.int32)
    lm = torch.tensor([1, 1, 0, 1, 1, 0, 1, 1], dtype=torch.uint8)
    cu = torch.tensor([0, 5, 8], dtype=torch.int32)
    assert eligible_anchors(lm, cu).nonzero().flatten().tolist() == [0, 3, 6]
    bb = build_block_batch(ids, lm, cu, torch.tensor([0, 3, 6]), block_size=4, mask_token_id=99)
    assert bb.block_input_ids.view(3, 4).tolist() == [[10, 99, 99, 99], [13, 99, 99, 99], [21, 99, 99, 99]]
    assert bb.block_positions.view(3, 4).tolist() == [[0, 1, 2, 3], [3, 4, 5, 6], [1, 2, 3, 4]]
    assert bb.labels.tolist() == [
        [IGNORE, 11, IGNORE, 13],      # slot 2 -> token 12 has loss_mask 0
        [IGNORE, 14, IGNORE, IGNORE],  # slots 2, 3 run past the end of sequence 0
        [IGNORE, 22, IGNORE, IGNORE],  # slot 2 would be sequence 1's end + 1
    ]
    assert bb.block_seq.tolist() == [0, 0, 1]
    assert bb.ctx_positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    w = loss_weights(4, gamma=2.0)
    assert w[0] == 0
    assert torch.allclose(w[1:], torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0)]))
    assert torch.allclose(loss_weights(16, 7.0)[15], torch.tensor(math.exp(-2.0)))


def test_block_loss_hand_worked():
    # 2 blocks of 4, vocab 5, hidden = one-hot logits so the "head" is the identity
    labels = torch.tensor([[IGNORE, 1, 2, 3], [IGNORE, 4, IGNORE, IGNORE]])
    preds = torch.tensor([[0, 1, 0, 3], [0, 4, 0, 0]])
    hidden = torch.nn.functional.one_hot(preds.flatten(), 5).float() * 50.0
    hidden.requires_grad_(True)
    w = torch.tensor([0.0, 1.0, 0.5, 0.25])
    out = block_loss(lambda h: h, hidden, labels, w)
    assert out.weight_sum.item() == pytest.approx(1.0 + 0.5 + 0.25 + 1.0)
    assert out.correct.tolist() == [0, 2, 0, 1]
    assert out.counted.tolist() == [0, 2, 1, 1]
    # block 0: slot 1 right, slot 2 wrong -> 1 + 1; block 1: slot 1 right, slot 2 unlabelled -> 1 + 1
    assert out.accept_sum.item() == 4.0
    # only the wrong slot (block 0 slot 2, weight 0.5) has a large CE: 50 nats
    assert out.weighted_ce.item() == pytest.approx(0.5 * 50.0, rel=1e-3)
    out.weighted_ce.backward()
    assert hidden.grad[0].abs().sum() == 0 and hidden.grad[4].abs().sum() == 0  # slot 0 rows: no gradient


def test_sample_anchors_rules():
    gen = torch.Generator().manual_seed(0)
    ids, lm, cu = _random_packed(gen, num_seqs=6, max_len=40)
    ok = eligible_anchors(lm, cu)
    a1 = sample_anchors(lm, cu, num_anchors=5, block_size=16, generator=torch.Generator().manual_seed(3))
    a2 = sample_anchors(lm, cu, num_anchors=5, block_size=16, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a1, a2)
    assert a1.dtype == torch.long and torch.equal(a1, a1.sort().values)
    assert len(set(a1.tolist())) == a1.numel()
    assert bool(ok[a1].all())
    for s in range(len(cu) - 1):
        inside = ((a1 >= cu[s]) & (a1 < cu[s + 1])).sum().item()
        assert inside == min(5, int(ok[int(cu[s]):int(cu[s + 1])].sum()))
        assert not ok[int(cu[s + 1]) - 1]  # last token of a sequence is never an anchor
    allp = sample_anchors(lm, cu, num_anchors=10_000, block_size=16)
    assert torch.equal(allp, ok.nonzero().flatten())


def test_build_block_batch_rejects_bad_anchor():
    ids = torch.arange(6, dtype=torch.int32)
    lm = torch.ones(6, dtype=torch.uint8)
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="anchors"):
        build_block_batch(ids, lm, cu, torch.tensor([2]), 4, 0)  # last token of sequence 0
    with pytest.raises(ValueError, match="cu_seqlens"):
        build_block_batch(ids, lm, torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([0]), 4, 0)


def test_split_sequences_covers_all_and_respects_budget():
    gen = torch.Generator().manual_seed(1)
    ids, lm, cu = _random_packed(gen, num_seqs=9, max_len=30)
    anchors = sample_anchors(lm, cu, 4, 4, gen)
    budget = 3000
    groups = split_sequences(cu, anchors, 4, budget)
    assert groups[0][0] == 0 and groups[-1][1] == 9
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:]))
    for s0, s1 in groups:
        t = int(cu[s1] - cu[s0])
        q = int(((anchors >= cu[s0]) & (anchors < cu[s1])).sum()) * 4
        assert s1 - s0 == 1 or q * (t + 4) <= budget  # scores of the structured attention: Q * (T + B)
    assert split_sequences(cu, anchors, 4, 10**12) == [(0, 9)]
    for s0, s1 in split_sequences(cu, anchors, 4, budget, dense=True):  # dense mask: Q * (T + Q)
        t = int(cu[s1] - cu[s0])
        q = int(((anchors >= cu[s0]) & (anchors < cu[s1])).sum()) * 4
        assert s1 - s0 == 1 or q * (t + q) <= budget


def test_target_label_source_takes_the_targets_next_token_of_the_previous_position():
    ids = torch.tensor([10, 11, 12, 13, 14, 20, 21, 22], dtype=torch.int32)
    nxt = torch.tensor([31, 32, 33, 34, 35, 41, 42, 43], dtype=torch.int32)  # target's choice after each position
    lm = torch.tensor([1, 1, 0, 1, 1, 0, 1, 1], dtype=torch.uint8)
    cu = torch.tensor([0, 5, 8], dtype=torch.int32)
    data = build_block_batch(ids, lm, cu, torch.tensor([0, 3, 6]), block_size=4, mask_token_id=99)
    tgt = build_block_batch(ids, lm, cu, torch.tensor([0, 3, 6]), block_size=4, mask_token_id=99, next_token_ids=nxt)
    assert tgt.labels.tolist() == [
        [IGNORE, 31, IGNORE, 33],      # slot k of anchor p: the target's token after p+k-1; same slots labelled
        [IGNORE, 34, IGNORE, IGNORE],
        [IGNORE, 42, IGNORE, IGNORE],
    ]
    assert torch.equal(tgt.labels == IGNORE, data.labels == IGNORE)
    assert torch.equal(tgt.block_input_ids, data.block_input_ids)


def test_block_loss_distillation_term_is_the_kl_to_the_renormalised_topk():
    labels = torch.tensor([[IGNORE, 1, 2]])
    logits = torch.tensor([[0.0, 0, 0, 0], [2.0, 1.0, 0.0, -1.0], [0.5, 0.0, 3.0, 0.0]])
    w = torch.tensor([0.0, 1.0, 0.5])
    tk_ids = torch.tensor([[[0, 1], [0, 1], [2, 3]]])
    tk_lp = torch.log(torch.tensor([[[0.5, 0.5], [0.6, 0.2], [0.9, 0.05]]]))
    plain = block_loss(lambda h: h, logits, labels, w)
    dist = block_loss(lambda h: h, logits, labels, w, topk_ids=tk_ids, topk_logprobs=tk_lp, distill_weight=2.0)
    logq = torch.log_softmax(logits, -1)
    want = 0.0
    for row, wk in ((1, 1.0), (2, 0.5)):
        p = torch.softmax(tk_lp[0, row], -1)
        want += wk * float((p * (p.log() - logq[row, tk_ids[0, row]])).sum())
    assert dist.weighted_ce.item() == pytest.approx(plain.weighted_ce.item() + 2.0 * want, rel=1e-5)
