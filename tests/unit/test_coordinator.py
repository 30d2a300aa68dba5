"""The coordinator's ledger in-process: exactly once, plan order, fencing, back-pressure, reclaiming."""

import random

import pytest

from specring.shared.data.dataset import Batch
from specring.shared.transport import messages as m
from specring.supervisor.coordinator import (
    FREE,
    READING,
    READY,
    WRITING,
    Coordinator,
)


def order(n, start=0):
    return [Batch(batch_id=start + i, epoch=0, sample_ids=(i,), pad_to=8) for i in range(n)]


def ready(lease: m.Lease, producer: int) -> m.SlotReady:
    return m.SlotReady(producer=producer, generation=lease.generation, slot=lease.slot, batch_id=lease.batch_id,
                       seq=0, descriptor=[], payload_bytes=0, num_tokens=8)


def test_leases_respect_free_slots_and_plan_order():
    co = Coordinator(order(10), num_producers=2, num_slots=2, num_consumers=1)
    for c in range(1):
        co.on_hello("consumer", c, 1)
    assert co.pump() == []  # no producer has said hello
    co.on_hello("producer", 0, 1)
    out = co.pump()
    assert [(r, i, msg.batch_id) for r, i, msg in out] == [("producer", 0, 0), ("producer", 0, 1)]
    assert co.pump() == []  # ring full: back-pressure
    co.on_hello("producer", 1, 1)
    assert [msg.batch_id for _, _, msg in co.pump()] == [2, 3]
    assert co.occupancy(0) == {FREE: 0, WRITING: 2, READY: 0, READING: 0}


def test_delivery_waits_for_plan_order_and_round_robins_consumers():
    co = Coordinator(order(4), num_producers=2, num_slots=2, num_consumers=2)
    for c in range(2):
        co.on_hello("consumer", c, 1)
    co.on_hello("producer", 0, 1)
    co.on_hello("producer", 1, 1)
    leases = {msg.batch_id: (i, msg) for _, i, msg in co.pump()}
    p, l1 = leases[1]
    assert co.on_slot_ready(ready(l1, p))
    assert co.pump() == []  # batch 0 is not ready yet: nothing overtakes it
    p0, l0 = leases[0]
    co.on_slot_ready(ready(l0, p0))
    out = co.pump()
    assert [(r, i, msg.batch_id) for r, i, msg in out] == [("consumer", 0, 0), ("consumer", 1, 1)]


def test_stale_generation_is_rejected_and_death_requeues_writing_slots():
    co = Coordinator(order(6), num_producers=1, num_slots=3, num_consumers=1)
    for c in range(1):
        co.on_hello("consumer", c, 1)
    co.on_hello("producer", 0, 1)
    leases = [msg for _, _, msg in co.pump()]
    assert [lease.batch_id for lease in leases] == [0, 1, 2]
    co.on_slot_ready(ready(leases[0], 0))            # batch 0 published
    gen = co.producer_died(0)                         # batches 1, 2 were being written
    assert gen == 2
    assert co.occupancy(0) == {FREE: 2, WRITING: 0, READY: 1, READING: 0}
    assert not co.on_slot_ready(ready(leases[1], 0))  # the dead incarnation's late message is fenced
    assert co.rejected["stale_generation"] == 1
    out = co.pump()                                   # READY batch 0 still goes to the consumer
    assert [(r, msg.batch_id) for r, _, msg in out] == [("consumer", 0)]
    co.on_hello("producer", 0, 1)                     # old generation's hello: ignored
    assert co.pump() == []
    co.on_hello("producer", 0, 2)
    relet = [msg for _, _, msg in co.pump()]
    assert [lease.batch_id for lease in relet] == [1, 2] and all(lease.generation == 2 for lease in relet)


def test_unreleased_credit_limits_deliveries():
    co = Coordinator(order(6), num_producers=1, num_slots=6, num_consumers=1, max_unreleased=2)
    for c in range(1):
        co.on_hello("consumer", c, 1)
    co.on_hello("producer", 0, 1)
    for _, _, lease in co.pump():
        co.on_slot_ready(ready(lease, 0))
    out = co.pump()
    assert [msg.batch_id for _, _, msg in out] == [0, 1]
    first = out[0][2]
    assert co.on_slot_released(m.SlotReleased(producer=0, generation=1, slot=first.slot, batch_id=0))
    assert [msg.batch_id for _, _, msg in co.pump()] == [2]
    # releasing twice is rejected, never double-frees
    assert not co.on_slot_released(m.SlotReleased(producer=0, generation=1, slot=first.slot, batch_id=0))


def test_bad_batch_from_producer_is_skipped_and_counted():
    co = Coordinator(order(3), num_producers=1, num_slots=3, num_consumers=1)
    for c in range(1):
        co.on_hello("consumer", c, 1)
    co.on_hello("producer", 0, 1)
    leases = [msg for _, _, msg in co.pump()]
    co.on_bad_batch(m.BadBatch(producer=0, generation=1, slot=leases[0].slot, batch_id=0, reason="nan"),
                    from_consumer=False)
    co.on_slot_ready(ready(leases[1], 0))
    assert [msg.batch_id for _, _, msg in co.pump() if isinstance(msg, m.SlotReady)] == [1]
    assert co.bad == {0: "nan"}


def test_resume_skips_trained_batches():
    co = Coordinator(order(5), num_producers=1, num_slots=5, num_consumers=1, trained={0, 1, 3})
    for c in range(1):
        co.on_hello("consumer", c, 1)
    co.on_hello("producer", 0, 1)
    assert [msg.batch_id for _, _, msg in co.pump()] == [2, 4]
    assert co.trained_before == 3


def test_duplicate_batch_ids_refused():
    with pytest.raises(ValueError, match="duplicate"):
        Coordinator(order(3) + order(1), num_producers=1, num_slots=2, num_consumers=1)


@pytest.mark.parametrize("seed", range(20))
def test_random_deaths_keep_exactly_once_and_order(seed):
    """Simulated run: producers die at random; every batch is trained exactly once, in plan order per rank."""
    rng = random.Random(seed)
    n_batches, n_prod, n_cons = 60, 3, 2
    co = Coordinator(order(n_batches), num_producers=n_prod, num_slots=2, num_consumers=n_cons)
    for c in range(n_cons):
        co.on_hello("consumer", c, 1)
    alive = {p: True for p in range(n_prod)}
    gens = {p: 1 for p in range(n_prod)}
    for p in range(n_prod):
        co.on_hello("producer", p, 1)
    writing: list[tuple[int, m.Lease]] = []
    per_consumer: dict[int, list[int]] = {c: [] for c in range(n_cons)}
    held: list[m.SlotReady] = []
    step = 0
    for _ in range(5000):
        for role, idx, msg in co.pump():
            if role == "producer":
                writing.append((idx, msg))
            else:
                per_consumer[idx].append(msg.batch_id)
                held.append(msg)
        r = rng.random()
        if r < 0.45 and writing:
            p, lease = writing.pop(rng.randrange(len(writing)))
            co.on_slot_ready(ready(lease, p))  # may be stale: fenced
        elif r < 0.8 and held:
            msg = held.pop(0)
            co.on_slot_released(m.SlotReleased(producer=msg.producer, generation=msg.generation, slot=msg.slot,
                                               batch_id=msg.batch_id))
            step += 1
            co.on_trained(m.Trained(consumer=0, step=step, batch_ids=[msg.batch_id], loss=1.0, num_tokens=8))
        elif r < 0.85:
            p = rng.randrange(n_prod)
            if alive[p]:
                alive[p] = False
                gens[p] = co.producer_died(p)
        else:
            for p in range(n_prod):
                if not alive[p]:
                    alive[p] = True
                    co.on_hello("producer", p, gens[p])
        if co.done:
            break
    assert co.done, f"seed {seed}: run did not finish"
    assert co.duplicates == 0 and co.lost() == []
    delivered = sorted(b for v in per_consumer.values() for b in v)
    assert delivered == list(range(n_batches))
    for c, got in per_consumer.items():
        assert got == list(range(c, n_batches, n_cons)), f"consumer {c} got {got}"


def test_deliveries_wait_for_the_consumers_hello_and_a_failed_send_changes_nothing():
    co = Coordinator(order(3), num_producers=1, num_slots=3, num_consumers=1)
    co.on_hello("producer", 0, 1)
    for _, _, lease in co.pump():
        co.on_slot_ready(ready(lease, 0))
    assert co.pump() == []                 # consumer not connected yet: nothing is sent into the void
    co.on_hello("consumer", 0, 1)
    tried = []
    assert co.pump(lambda role, index, msg: tried.append(msg.batch_id) or False) == []  # the send failed
    assert tried == [0]                    # strictly in order: nothing overtakes the batch that failed
    assert co.occupancy(0)["READY"] == 3 and co.unreleased == [0] and not co.delivered_ids
    assert co.pump() == []                 # the consumer must say hello again
    co.on_hello("consumer", 0, 1)
    assert [msg.batch_id for _, _, msg in co.pump()] == [0, 1]


def test_trained_for_a_batch_never_delivered_is_rejected():
    co = Coordinator(order(4), num_producers=1, num_slots=4, num_consumers=1)
    co.on_hello("producer", 0, 1)
    co.on_hello("consumer", 0, 1)
    for _, _, lease in co.pump():
        co.on_slot_ready(ready(lease, 0))
    delivered = [msg.batch_id for _, _, msg in co.pump()]
    co.on_trained(m.Trained(consumer=0, step=1, batch_ids=delivered + [3, 999], loss=1.0, num_tokens=8))
    assert co.trained == set(delivered) and co.rejected["undelivered_batch"] == 2
    co.on_bad_batch(m.BadBatch(producer=99, generation=1, slot=0, batch_id=0, reason="x"), from_consumer=True)
    co.on_bad_batch(m.BadBatch(producer=-1, generation=1, slot=0, batch_id=0, reason="x"), from_consumer=True)
    assert co.rejected["bad_producer_index"] == 2


def test_a_lease_that_cannot_be_sent_changes_nothing_and_goes_out_at_the_next_pump():
    co = Coordinator(order(3), num_producers=2, num_slots=2, num_consumers=1)
    co.on_hello("producer", 0, 1)
    co.on_hello("producer", 1, 1)
    sent = co.pump(lambda role, index, msg: index == 1)  # producer 0 does not take its lease
    assert [(i, msg.batch_id) for _, i, msg in sent] == [(1, 0), (1, 1)]  # producer 1 gets them, in order
    assert co.occupancy(0)["FREE"] == 2 and co.occupancy(1)["WRITING"] == 2
    assert [(i, msg.batch_id) for _, i, msg in co.pump()] == [(0, 2)]


def test_generations_are_the_coordinators_and_fence_every_role():
    co = Coordinator(order(2), num_producers=2, num_slots=2, num_consumers=1)
    assert co.generation("producer", 1) == 1 and co.generation("consumer", 0) == 1
    assert co.producer_died(1) == 2 and co.generation("producer", 1) == 2 and co.generation("producer", 0) == 1
    assert not co.fenced("producer", 1, 2, "heartbeat") and co.fenced("producer", 1, 1, "heartbeat")
    assert not co.fenced("consumer", 0, 1, "trained") and co.fenced("consumer", 0, 2, "trained")
    assert co.fenced("consumer", 3, 1, "hello") and co.fenced("producer", -1, 1, "hello")
    assert co.rejected["stale_generation"] == 2
    assert co.rejected["bad_consumer_index"] == 1 and co.rejected["bad_producer_index"] == 1


def test_a_lease_or_delivery_another_node_could_not_pass_on_is_taken_back():
    # node 0 queued both to node 1's supervisor; node 1 answers send_failed for each
    co = Coordinator(order(2), num_producers=1, num_slots=2, num_consumers=1)
    co.on_hello("producer", 0, 1)
    co.on_hello("consumer", 0, 1)
    leases = [msg for _, _, msg in co.pump()]
    co.unlease(leases[1], 0)
    assert co.occupancy(0) == {"FREE": 1, "WRITING": 1, "READY": 0, "READING": 0}
    co.unlease(leases[1], 0)  # twice, or for a slot that moved on: nothing
    assert co.occupancy(0)["FREE"] == 1
    assert [msg.batch_id for _, _, msg in co.pump()] == [1]
    co.on_slot_ready(ready(leases[0], 0))
    [(_, c, delivery)] = co.pump()
    assert co.occupancy(0)["READING"] == 1
    co.undeliver(delivery, c)
    assert co.occupancy(0)["READY"] == 1 and co.pump() == []  # the consumer gets nothing until its next Hello
    co.on_hello("consumer", 0, 1)
    assert [(c, msg.batch_id) for _, c, msg in co.pump()] == [(0, 0)]
    assert co.duplicates == 0


def _drive(co: Coordinator, bad: set[int], rng: random.Random, steps: int = 20000) -> list[tuple[int, int, int]]:
    """Run a coordinator to the end with producers that answer in random order; returns every delivery as
    (batch, producer, consumer). Producers mark the batches of ``bad`` bad (the first time they see them)."""
    pending: list[tuple[int, m.Lease]] = []
    reading: list[tuple[int, m.SlotReady]] = []
    deliveries = []
    for _ in range(steps):
        for role, idx, msg in co.pump():
            if role == "producer":
                pending.append((idx, msg))
            else:
                deliveries.append((msg.batch_id, msg.producer, idx))
                reading.append((idx, msg))
        if co.done:
            break
        if pending and rng.random() < 0.6:
            p, lease = pending.pop(rng.randrange(len(pending)))
            if lease.batch_id in bad:
                bad.discard(lease.batch_id)
                co.on_bad_batch(m.BadBatch(producer=p, generation=lease.generation, slot=lease.slot,
                                           batch_id=lease.batch_id, reason="test"), from_consumer=False)
            else:
                co.on_slot_ready(ready(lease, p))
        elif reading:
            c, msg = reading.pop(0)
            co.on_slot_released(m.SlotReleased(producer=msg.producer, generation=msg.generation, slot=msg.slot,
                                               batch_id=msg.batch_id))
            co.on_trained(m.Trained(consumer=c, step=1, batch_ids=[msg.batch_id], loss=1.0, num_tokens=8))
    return deliveries


@pytest.mark.parametrize("seed", range(6))
def test_several_nodes_keep_hidden_states_on_their_node_exactly_once(seed):
    # producers 0, 1 on node 0, producer 2 on node 1; consumers 0, 1 on node 0 and 2, 3 on node 1
    pn, cn = [0, 0, 1], [0, 0, 1, 1]
    co = Coordinator(order(40), num_producers=3, num_slots=2, num_consumers=4, producer_nodes=pn, consumer_nodes=cn)
    for c in range(4):
        co.on_hello("consumer", c, 1)
    for p in range(3):
        co.on_hello("producer", p, 1)
    bad = {3, 17, 18} if seed % 2 else set()  # bad batches shift the consumers of every batch after them
    deliveries = _drive(co, set(bad), random.Random(seed))
    assert co.done and co.duplicates == 0 and co.lost() == [] and set(co.bad) == bad
    assert sorted(b for b, _, _ in deliveries) == sorted(set(range(40)) - bad)
    assert all(pn[p] == cn[c] for _, p, c in deliveries), "hidden states crossed a node"
    assert [c for _, _, c in deliveries] == [k % 4 for k in range(len(deliveries))], "round robin kept"


def test_node_lists_must_match_the_counts():
    with pytest.raises(ValueError, match="node of each"):
        Coordinator(order(4), num_producers=2, num_slots=2, num_consumers=1, producer_nodes=[0])
