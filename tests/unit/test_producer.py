"""Unit tests of producers/producer.py: the Producer stepped in-process (no sockets, no child processes).

Each test writes into a real ring segment created in /dev/shm by this process and removed in the
fixture's teardown. References are plain Hugging Face forwards of each sequence alone
(``output_hidden_states``), compared per layer with ``hidden_states[id + 1]``.
"""

from __future__ import annotations

import pytest
import torch

from specring.producers.producer import Producer
from specring.shared.config.run_config import DEFAULT_TARGET, ProducerConfig
from specring.shared.errors import ConfigError
from specring.shared.models.target import load_target
from specring.shared.process import faults
from specring.shared.transport import layout, messages, ring
from specring.shared.transport.ring import EMPTY, PUBLISHED, Ring
from tests.support import temp_ring

H = 256
PAD = 3
# fp32 on CPU: padding changes the attention's reduction order, so equal up to rounding (|h| ~ 1..30)
ATOL, RTOL = 1e-4, 1e-5


@pytest.fixture(scope="module")
def model():
    m, _ = load_target(DEFAULT_TARGET, "cpu")
    return m


@pytest.fixture
def slot_ring():
    with temp_ring(3, 1 << 21) as r:
        yield r


def sequences(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 8192, (n,), generator=g) for n in lengths]


def make_batch(seqs, pad_to, batch_id, loss_seed=1):
    """Right-padded batch in the shape of shared.data.dataset.collate's output, plus the batch id."""
    b = len(seqs)
    g = torch.Generator().manual_seed(loss_seed)
    ids = torch.full((b, pad_to), PAD, dtype=torch.int64)
    am = torch.zeros((b, pad_to), dtype=torch.int64)
    lm = torch.zeros((b, pad_to), dtype=torch.uint8)
    for r, s in enumerate(seqs):
        ids[r, :len(s)] = s
        am[r, :len(s)] = 1
        lm[r, :len(s)] = torch.randint(0, 2, (len(s),), generator=g, dtype=torch.uint8)
    return {"input_ids": ids, "attention_mask": am, "loss_mask": lm,
            "lengths": torch.tensor([len(s) for s in seqs]), "batch_id": batch_id}


def reference(model, seq, layer_ids):
    """[len(seq), n*H]: hidden_states[id+1] of a plain forward of ``seq`` alone, concatenated."""
    with torch.inference_mode():
        hs = model.model(input_ids=seq[None], output_hidden_states=True, use_cache=False).hidden_states
    return torch.cat([hs[i + 1][0] for i in layer_ids], dim=1)


def read_slot(r: Ring, msg: messages.SlotReady) -> dict:
    return {k: v.clone() for k, v in layout.read_tensors(r.payload(msg.slot), msg.descriptor).items()}


# ------------------------------------------------------------------------------------------ correctness
@pytest.mark.parametrize("layer_ids", [[1, 2, 3, 4, 5], [7, 0], [6]])
def test_padded_batch_slot_matches_plain_forward_of_each_sequence(model, slot_ring, layer_ids):
    seqs = sequences([5, 17, 11, 1])
    batch = make_batch(seqs, pad_to=24, batch_id=42)
    p = Producer(model, layer_ids, slot_ring, generation=3, device="cpu", index=1)
    msg = p.run_batch(batch, slot=2, seq=9)

    assert isinstance(msg, messages.SlotReady)
    assert (msg.producer, msg.generation, msg.slot, msg.batch_id, msg.seq) == (1, 3, 2, 42, 9)
    assert msg.num_tokens == 34 and msg.checksum == 0
    h = slot_ring.header(2)
    assert (h.state, h.generation, h.batch_id, h.seq, h.payload_len) == (PUBLISHED, 3, 42, 9, msg.payload_bytes)
    assert msg.payload_bytes == p.payload_bytes(34, 4)

    t = read_slot(slot_ring, msg)
    assert [d[0] for d in msg.descriptor] == ["hidden", "input_ids", "loss_mask", "cu_seqlens", "batch_id",
                                              "layer_ids"]
    n = len(layer_ids)
    assert t["hidden"].dtype == torch.float32 and t["hidden"].shape == (34, n * H)
    assert t["input_ids"].dtype == torch.int32 and t["loss_mask"].dtype == torch.uint8
    assert t["cu_seqlens"].tolist() == [0, 5, 22, 33, 34]
    assert t["batch_id"].tolist() == [42] and t["layer_ids"].tolist() == layer_ids
    cu = t["cu_seqlens"].tolist()
    for b, s in enumerate(seqs):
        rows = slice(cu[b], cu[b + 1])
        assert torch.equal(t["input_ids"][rows], s.to(torch.int32))
        assert torch.equal(t["loss_mask"][rows], batch["loss_mask"][b, :len(s)])
        ref = reference(model, s, layer_ids)
        for k, lid in enumerate(layer_ids):
            torch.testing.assert_close(t["hidden"][rows, k * H:(k + 1) * H], ref[:, k * H:(k + 1) * H],
                                       atol=ATOL, rtol=RTOL, msg=f"sequence {b} layer {lid}")


def test_same_sample_same_states_in_any_batch_and_any_run(model, slot_ring):
    ids = [1, 4, 6]
    s = sequences([13], seed=7)[0]
    others = sequences([3, 30, 8], seed=8)
    p = Producer(model, ids, slot_ring, generation=1, device="cpu")

    def states_of_s(batch, row):
        msg = p.run_batch(batch, slot=0, seq=0)
        t = read_slot(slot_ring, msg)
        cu = t["cu_seqlens"].tolist()
        return t["hidden"][cu[row]:cu[row + 1]]

    alone = states_of_s(make_batch([s], 13, 1), 0)
    short_batch = states_of_s(make_batch([others[0], s], 16, 2), 1)
    long_batch = states_of_s(make_batch([others[1], others[2], s], 40, 3), 2)
    again = states_of_s(make_batch([others[1], others[2], s], 40, 4), 2)
    torch.testing.assert_close(short_batch, alone, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(long_batch, alone, atol=ATOL, rtol=RTOL)
    assert torch.equal(again, long_batch), "the same batch run twice must give bit-identical states"
    torch.testing.assert_close(alone, reference(model, s, ids), atol=ATOL, rtol=RTOL)


def test_early_stop_and_full_depth_write_identical_slots(model, slot_ring):
    batch = make_batch(sequences([9, 4]), 9, 5)
    out = []
    for stop in (True, False):
        p = Producer(model, [2, 3], slot_ring, generation=1, device="cpu", stop_early=stop)
        out.append(read_slot(slot_ring, p.run_batch(batch, slot=1, seq=0))["hidden"])
    assert torch.equal(out[0], out[1])


def test_submit_then_complete_keeps_batches_apart(model, slot_ring):
    """Two batches in flight (the process's pipelining): each slot holds its own batch."""
    p = Producer(model, [1, 5], slot_ring, generation=2, device="cpu")
    sa, sb = sequences([6], seed=11)[0], sequences([10], seed=12)[0]
    pa = p.submit(make_batch([sa], 6, 10), slot=0, seq=0)
    pb = p.submit(make_batch([sb], 12, 11), slot=1, seq=1)
    ma, mb = p.complete(pa), p.complete(pb)
    assert (ma.batch_id, mb.batch_id, ma.slot, mb.slot) == (10, 11, 0, 1)
    torch.testing.assert_close(read_slot(slot_ring, ma)["hidden"], reference(model, sa, [1, 5]), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(read_slot(slot_ring, mb)["hidden"], reference(model, sb, [1, 5]), atol=ATOL, rtol=RTOL)
    assert p.stats.batches == 2 and p.stats.tokens == 16 and p.current_batch == -1


def test_checksum_is_recorded_and_verifies(model, slot_ring):
    p = Producer(model, [2], slot_ring, generation=4, device="cpu", checksum=True)
    msg = p.run_batch(make_batch(sequences([7, 3]), 8, 77), slot=1, seq=5)
    assert msg.checksum != 0
    h = slot_ring.verify(1, 77, 4)
    assert h.checksum == msg.checksum


# ------------------------------------------------------------------------------------------ bad batches
def test_injected_nonfinite_batch_is_reported_and_not_published(model, slot_ring):
    p = Producer(model, [1, 3], slot_ring, generation=2, device="cpu", inject_nonfinite=[7])
    msg = p.run_batch(make_batch(sequences([5, 9]), 9, 7), slot=0, seq=0)
    assert isinstance(msg, messages.BadBatch)
    assert (msg.batch_id, msg.slot, msg.generation) == (7, 0, 2)
    assert "batch 7" in msg.reason and "non-finite" in msg.reason and "[1]" in msg.reason
    assert slot_ring.header(0).state == EMPTY
    assert (p.stats.bad_batches, p.stats.batches, p.stats.tokens) == (1, 0, 0)
    ok = p.run_batch(make_batch(sequences([5, 9]), 9, 8), slot=0, seq=1)
    assert isinstance(ok, messages.SlotReady) and slot_ring.header(0).state == PUBLISHED
    assert torch.isfinite(read_slot(slot_ring, ok)["hidden"]).all()


def test_real_nonfinite_hidden_states_are_caught(model, slot_ring):
    """Not injected: an infinite weight in layer 3 makes layers 3+ non-finite; layer 1 stays finite."""
    w = model.model.layers[3].mlp.down_proj.weight
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            w[0, 0] = float("inf")
        p = Producer(model, [1, 3], slot_ring, generation=1, device="cpu")
        msg = p.run_batch(make_batch(sequences([4]), 4, 99), slot=2, seq=0)
    finally:
        with torch.no_grad():
            w.copy_(saved)
    assert isinstance(msg, messages.BadBatch)
    assert "layers [3]" in msg.reason and "batch 99" in msg.reason
    assert slot_ring.header(2).state == EMPTY


def test_a_batch_too_large_for_the_slot_is_bad_and_the_slot_untouched(model):
    small = Ring.create(ring.segment_name(ring.new_run_id(), "ut"), num_slots=2, slot_bytes=4096)
    try:
        p = Producer(model, [1, 2, 3], small, generation=1, device="cpu")
        msg = p.run_batch(make_batch(sequences([20]), 20, 5), slot=1, seq=0)
        assert isinstance(msg, messages.BadBatch)
        assert "does not fit in a slot of 4096 bytes" in msg.reason
        assert small.header(1).state == EMPTY and small.header(1).batch_id == 0
    finally:
        small.close()
        small.unlink()


def test_malformed_batches_raise_naming_the_problem(model, slot_ring):
    p = Producer(model, [1], slot_ring, generation=1, device="cpu")
    batch = make_batch(sequences([3, 5]), 6, 1)
    left = dict(batch, attention_mask=batch["attention_mask"].flip(1))
    with pytest.raises(ValueError, match="right padding"):
        p.run_batch(left, slot=0, seq=0)
    with pytest.raises(ValueError, match="missing"):
        p.run_batch({k: v for k, v in batch.items() if k != "loss_mask"}, slot=0, seq=0)
    with pytest.raises(ValueError, match=r"lengths \[3, 7\]"):
        p.run_batch(dict(batch, lengths=torch.tensor([3, 7])), slot=0, seq=0)
    assert slot_ring.header(0).state == EMPTY


# ------------------------------------------------------------------------------------------ config
def test_from_config_builds_with_default_ids_and_env_injection(slot_ring, monkeypatch):
    monkeypatch.setenv(faults.INJECT_NONFINITE_ENV, "12, 13")
    cfg = ProducerConfig(devices=["cpu"], num_target_layers=3)
    p = Producer.from_config(cfg, 0, slot_ring, generation=5, checksum=True)
    assert p.layer_ids == [1, 3, 5] and p.inject_nonfinite == {12, 13} and p.checksum
    assert p.hf_config.pad_token_id == 3 and p.generation == 5
    msg = p.run_batch(make_batch(sequences([4]), 4, 13), slot=0, seq=0)
    assert isinstance(msg, messages.BadBatch)


def test_from_config_names_bad_ids_and_indices(slot_ring):
    with pytest.raises(ConfigError, match=r"\[8, 9\]"):
        Producer.from_config(ProducerConfig(devices=["cpu"], target_layer_ids=[1, 8, 9]), 0, slot_ring, 1)
    with pytest.raises(ConfigError, match="producer index 2"):
        Producer.from_config(ProducerConfig(devices=["cpu", "cpu"]), 2, slot_ring, 1)


def test_parse_batch_ids():
    assert faults.parse_batch_ids(None) == set() and faults.parse_batch_ids(" ") == set()
    assert faults.parse_batch_ids("3, 17,42,") == {3, 17, 42}
    with pytest.raises(ConfigError, match="'x'"):
        faults.parse_batch_ids("3,x")


def test_slow_write_env_is_parsed_and_checked(monkeypatch):
    monkeypatch.delenv(faults.SLOW_WRITE_ENV, raising=False)
    assert faults.slow_write_s() == 0.0
    monkeypatch.setenv(faults.SLOW_WRITE_ENV, "0.25")
    assert faults.slow_write_s() == 0.25
    for bad in ("soon", "-1"):
        monkeypatch.setenv(faults.SLOW_WRITE_ENV, bad)
        with pytest.raises(ConfigError, match=faults.SLOW_WRITE_ENV):
            faults.slow_write_s()


def test_slow_write_holds_the_slot_before_publishing(model, slot_ring):
    p = Producer(model, [1], slot_ring, generation=1, device="cpu", slow_write_s=0.3)
    pending = p.submit(make_batch(sequences([4]), 4, 1), slot=0, seq=0)
    assert slot_ring.header(0).state == ring.WRITING, "written but not yet published"
    msg = p.complete(pending)
    assert isinstance(msg, messages.SlotReady) and slot_ring.header(0).state == PUBLISHED


# ------------------------------------------------------------------------------------------ target labels
def test_target_labels_equal_the_argmax_of_a_plain_transformers_forward(model, slot_ring):
    """label_source=target: target_ids[t] is the argmax of the full causal LM's logits at t (each sequence
    forwarded alone, no padding), and the top-K log-probabilities are the log-softmax of those logits."""
    seqs = sequences([9, 23, 4], seed=7)
    batch = make_batch(seqs, pad_to=24, batch_id=7)
    p = Producer(model, [1, 3], slot_ring, generation=1, device="cpu", label_source="target", topk=4)
    msg = p.run_batch(batch, slot=0, seq=0)
    assert isinstance(msg, messages.SlotReady), msg
    got = read_slot(slot_ring, msg)
    assert got["target_ids"].dtype == torch.int32 and got["target_topk_logprobs"].shape == (36, 4)
    with torch.inference_mode():
        logits = torch.cat([model(input_ids=s[None], use_cache=False).logits[0] for s in seqs]).float()
    want = logits.argmax(-1)
    # argmax ties under padding's different reduction order are possible in principle: demand near-total agreement
    # and exact agreement wherever the top two logits are clearly apart
    top2 = logits.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-3
    assert torch.equal(got["target_ids"].long()[clear], want[clear])
    assert clear.float().mean() > 0.9
    lp = torch.log_softmax(logits, -1)
    assert torch.allclose(got["target_topk_logprobs"], lp.topk(4, dim=-1).values, atol=1e-3)
    assert torch.equal(got["target_topk_ids"][:, 0].long()[clear], want[clear])
    # the hidden states are unchanged by running the full depth
    ref = torch.cat([reference(model, s, [1, 3]) for s in seqs])
    assert torch.allclose(got["hidden"], ref, atol=ATOL, rtol=RTOL)
    assert msg.payload_bytes == p.payload_bytes(36, 3)


def test_data_label_slots_carry_no_target_fields(model, slot_ring):
    p = Producer(model, [1], slot_ring, generation=1, device="cpu")
    msg = p.run_batch(make_batch(sequences([5]), pad_to=8, batch_id=1), slot=0, seq=0)
    assert "target_ids" not in read_slot(slot_ring, msg)


def test_warm_up_runs_the_extreme_shapes_and_writes_nothing(model, slot_ring):
    """Producer.warm_up: the longest and the widest batch through the target, no slot touched, no figure moved."""
    p = Producer(model, [2, 3], slot_ring, generation=1, device="cpu")
    seen = []
    hook = p.base.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(tuple(kwargs["input_ids"].shape)),
                                            with_kwargs=True)
    try:
        shapes = p.warm_up(max_tokens=256, max_batch_size=4, pad_id=PAD)
        assert shapes == [(1, 256), (4, 64)] and seen == shapes
        assert p.warm_up(max_tokens=40, max_batch_size=4) == [(1, 40)]  # 10 tokens a row: not worth a shape
    finally:
        hook.remove()
    assert all(slot_ring.header(i).state == EMPTY for i in range(slot_ring.num_slots))
    assert p.stats.batches == 0 and p.stats.tokens == 0


def test_warm_up_out_of_memory_is_a_start_up_error_naming_the_flag(model, slot_ring, monkeypatch):
    p = Producer(model, [2], slot_ring, generation=1, device="cpu")

    def oom(*a, **k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    monkeypatch.setattr(p, "forward", oom)
    with pytest.raises(ConfigError, match=r"data.max_tokens.*1 x 8192 tokens.*--max-tokens"):
        p.warm_up(max_tokens=8192, max_batch_size=1)
