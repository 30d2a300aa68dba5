"""The coordinator's logic: the batch ledger, slot states, leases, routing and fencing — no sockets.

``Coordinator`` is a pure state machine. The supervisor's loop feeds it events (messages received,
producers dead) and lets ``pump(send)`` hand out what can go now. Tests drive it directly.

What it guarantees:

* **Exactly once.** Every batch of ``order`` (the run's batches in plan order, minus those already trained
  before a resume) is delivered for training exactly once, unless a producer marks it bad (then it is
  counted in ``bad_batches`` and never delivered). A batch whose producer dies before publishing it goes
  back to the lease queue; a published (READY) batch of a dead producer is still delivered from the ring.
* **Deterministic order.** Batches are delivered in ``order``, round robin over consumers (delivery k goes
  to consumer k mod M), whatever the number and speed of producers, so a run and its resume train the same
  batches in the same order on every rank.
* **Fencing.** It is the one owner of generations: every child incarnation has one (``generation``; a
  child runs as, and is addressed by, the generation it was started with). ``producer_died`` bumps a
  producer's; a message from, or carrying, another generation is rejected (``fenced``: logged, counted,
  never acted on). A dead producer's WRITING slots become FREE only when the supervisor reports it dead,
  which it does only after it has reaped the process.
* **Back-pressure.** A producer is leased a batch only with a FREE slot of its own ring; a consumer is
  delivered a slot only while it holds fewer than ``max_unreleased`` unreleased slots.
* **Nothing to roll back.** Leases and deliveries go only to peers that said Hello, and ``pump`` records
  one only once its ``send`` has queued it: a send that fails (the peer is gone or does not read; a send
  never blocks) leaves the ledger as it was. A consumer whose delivery could not be sent gets nothing more
  until it says Hello again; a producer is tried again at the next ``pump``. (Several nodes: a send to a
  child of another node is only queued to that node's supervisor; when the node reports it could not pass it
  on, ``undeliver``/``unlease`` take it back.)
* **Locality (several nodes).** With ``producer_nodes``/``consumer_nodes`` (the node of each producer and
  consumer, global indices), hidden states never leave their node: a batch is leased only to a producer of the
  node whose consumer will take it (delivery k goes to consumer k mod M, so the consumer of every batch in the
  delivery queue is known), and a READY batch whose consumer changed node meanwhile (a batch ahead of it turned
  out bad) is dropped from its slot and leased again on the right node (``relocated`` counts them).

What it does not do: it does not time anything (the monitor does) and does not persist itself (the
trained batch ids are saved with the trainer's checkpoint and passed back in on resume).

Slot states: FREE → (lease) → WRITING → (SlotReady) → READY → (deliver) → READING → (SlotReleased) → FREE.
"""

from __future__ import annotations

import heapq
import logging
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from specring.shared.data.dataset import Batch
from specring.shared.transport import messages as m

log = logging.getLogger(__name__)

FREE, WRITING, READY, READING = "FREE", "WRITING", "READY", "READING"


@dataclass
class Slot:
    state: str = FREE
    batch_id: int = -1
    generation: int = 0
    consumer: int = -1


@dataclass
class ProducerState:
    live: bool = False          # a Hello of the current generation has arrived
    slots: list[Slot] = field(default_factory=list)


Send = Callable[[str, int, Any], bool]  # (role, index, message) -> queued; never blocks


class Coordinator:
    """Ledger and router for ``num_producers`` rings of ``num_slots`` slots and ``num_consumers`` trainers.

    ``order`` is the run's batch list in training order (the plan's ``shared.data.dataset.Batch`` items, as
    they are: their ``sample_ids`` and ``pad_to`` go into the leases). ``trained`` holds batch ids already trained
    (resume). ``producer_nodes``/``consumer_nodes``: the node of each producer/consumer (several nodes; see
    Locality above), None on one node. Raises ``ValueError`` for duplicate batch ids in ``order`` or node lists
    of the wrong length.
    """

    def __init__(self, order: Sequence[Batch], num_producers: int, num_slots: int, num_consumers: int,
                 trained: set[int] | None = None, max_unreleased: int = 2,
                 producer_nodes: Sequence[int] | None = None, consumer_nodes: Sequence[int] | None = None):
        ids = [b.batch_id for b in order]
        if len(set(ids)) != len(ids):
            dup = [k for k, v in Counter(ids).items() if v > 1][:5]
            raise ValueError(f"batch order has duplicate batch ids, e.g. {dup}")
        trained = set(trained or ())
        self.batches = {b.batch_id: b for b in order}
        self.position = {b.batch_id: i for i, b in enumerate(order)}
        self.order = [b for b in ids if b not in trained]
        self.trained_before = len(ids) - len(self.order)
        self.num_consumers = num_consumers
        self.max_unreleased = max_unreleased
        self.producers = [ProducerState(slots=[Slot() for _ in range(num_slots)]) for _ in range(num_producers)]
        self.generations = {"producer": [1] * num_producers, "consumer": [1] * num_consumers}
        self._lease_heap: list[tuple[int, int]] = [(self.position[b], b) for b in self.order]
        heapq.heapify(self._lease_heap)
        self.where: dict[int, tuple[int, int]] = {}          # batch id → (producer, slot) while in a ring
        self.to_deliver: deque[int] = deque(self.order)      # delivery queue, plan order
        self.delivered = 0
        self.unreleased = [0] * num_consumers
        self.trained: set[int] = set()
        self.skipped: set[int] = set()                       # trained by a step that updated nothing
        self.updated_steps = 0                               # Trained reports of steps that updated the weights
        self.trained_counts: Counter = Counter()
        self.bad: dict[int, str] = {}
        self.rejected = Counter()                            # reason → count
        self.loss_first: float | None = None
        self.loss_last: float | None = None
        self.consumer_bad_retries: Counter = Counter()
        self.redeliver_to: dict[int, int] = {}
        self.delivered_ids: set[int] = set()                 # every batch handed to a consumer
        self.consumer_live = [False] * num_consumers         # a Hello arrived: its socket is connected
        self.ready_msgs: dict[tuple[int, int], m.SlotReady] = {}   # (producer, slot) → its SlotReady
        self.producer_nodes = list(producer_nodes) if producer_nodes is not None else [0] * num_producers
        self.consumer_nodes = list(consumer_nodes) if consumer_nodes is not None else [0] * num_consumers
        if len(self.producer_nodes) != num_producers or len(self.consumer_nodes) != num_consumers:
            raise ValueError(f"producer_nodes/consumer_nodes must name the node of each of the {num_producers} "
                             f"producers and {num_consumers} consumers")
        self.multi_node = len(set(self.producer_nodes) | set(self.consumer_nodes)) > 1
        self.relocated = 0                                   # READY batches leased again on another node

    # ------------------------------------------------------------------ queries
    @property
    def done(self) -> bool:
        """Every batch of the order is trained or bad."""
        return len(self.trained) + len(self.bad) >= len(self.order)

    @property
    def duplicates(self) -> int:
        return sum(c - 1 for c in self.trained_counts.values() if c > 1)

    def occupancy(self, producer: int) -> dict[str, int]:
        """Slot counts by state for one producer's ring."""
        c = Counter(s.state for s in self.producers[producer].slots)
        return {k: c.get(k, 0) for k in (FREE, WRITING, READY, READING)}

    def lost(self) -> list[int]:
        """Batches of the order that were neither trained nor marked bad (non-empty only if the run stopped early)."""
        return [b for b in self.order if b not in self.trained and b not in self.bad]

    # ------------------------------------------------------------------ generations
    def generation(self, role: str, index: int) -> int:
        """The current generation of child ``role`` ``index``: the one to start it as and to address."""
        return self.generations[role][index]

    def fenced(self, role: str, index: int, generation: int, what: str) -> bool:
        """Whether a message ``what`` of ``role`` ``index`` from, or about, ``generation`` must be rejected: no
        such child, or not its current generation (counted in ``rejected`` and logged)."""
        gens = self.generations.get(role, [])
        if not (isinstance(index, int) and 0 <= index < len(gens)):
            self.rejected[f"bad_{role}_index"] += 1
            log.warning("reject %s %s=%s reason=no_such_%s", what, role, index, role)
            return True
        if generation != gens[index]:
            self.rejected["stale_generation"] += 1
            log.warning("reject %s %s=%d generation=%s current=%d reason=stale_generation", what, role, index,
                        generation, gens[index])
            return True
        return False

    def producer_died(self, p: int) -> int:
        """Producer ``p`` has exited and been reaped: fence it and reclaim its unpublished slots.

        WRITING slots become FREE and their batches return to the lease queue; READY and READING slots are
        kept. Returns the new generation.
        """
        ps = self.producers[p]
        reclaimed = []
        for i, s in enumerate(ps.slots):
            if s.state == WRITING:
                reclaimed.append(s.batch_id)
                self.where.pop(s.batch_id, None)
                heapq.heappush(self._lease_heap, (self.position[s.batch_id], s.batch_id))
                ps.slots[i] = Slot()
        self.generations["producer"][p] += 1
        ps.live = False
        log.info("fence producer=%d generation=%d requeued=%s", p, self.generation("producer", p), reclaimed)
        return self.generation("producer", p)

    # ------------------------------------------------------------------ messages
    def _slot(self, p: int, slot: int, what: str) -> Slot | None:
        if not 0 <= p < len(self.producers):
            self.rejected["bad_producer_index"] += 1
            log.warning("reject %s producer=%s reason=no_such_producer", what, p)
            return None
        slots = self.producers[p].slots
        if not 0 <= slot < len(slots):
            self.rejected["bad_slot"] += 1
            log.warning("reject %s producer=%d slot=%s reason=no_such_slot", what, p, slot)
            return None
        return slots[slot]

    def on_hello(self, role: str, index: int, generation: int) -> None:
        """Child ``role`` ``index`` of ``generation`` is connected and takes work (ignored when fenced)."""
        if self.fenced(role, index, generation, "hello"):
            return
        if role == "producer":
            self.producers[index].live = True
        else:
            self.consumer_live[index] = True

    def on_slot_ready(self, msg: m.SlotReady) -> bool:
        """A producer published a slot; returns False if the message was rejected."""
        if self.fenced("producer", msg.producer, msg.generation, "slot_ready"):
            return False
        s = self._slot(msg.producer, msg.slot, "slot_ready")
        if s is None or s.state != WRITING or s.batch_id != msg.batch_id:
            self.rejected["unexpected_slot_ready"] += 1
            log.warning("reject slot_ready producer=%d slot=%d batch=%d reason=slot_not_leased_for_it state=%s",
                        msg.producer, msg.slot, msg.batch_id, s.state if s else "?")
            return False
        s.state = READY
        self.ready_msgs[(msg.producer, msg.slot)] = msg
        return True

    def on_bad_batch(self, msg: m.BadBatch, from_consumer: bool) -> None:
        """A producer could not produce a batch (counted bad), or a consumer could not read it (re-leased once)."""
        if from_consumer:
            s = self._slot(msg.producer, msg.slot, "bad_batch")
            if s is None or s.state != READING or s.batch_id != msg.batch_id:
                self.rejected["unexpected_bad_batch"] += 1
                return
            s_consumer = s.consumer
            self._release(msg.producer, s)
            self.consumer_bad_retries[msg.batch_id] += 1
            if self.consumer_bad_retries[msg.batch_id] > 1:
                self._mark_bad(msg.batch_id, f"consumer: {msg.reason}")
            else:
                self.to_deliver.appendleft(msg.batch_id)
                self.redeliver_to[msg.batch_id] = s_consumer  # same rank, same turn: DP ranks stay in step
                heapq.heappush(self._lease_heap, (self.position[msg.batch_id], msg.batch_id))
            return
        if self.fenced("producer", msg.producer, msg.generation, "bad_batch"):
            return
        s = self._slot(msg.producer, msg.slot, "bad_batch")
        if s is None or s.state != WRITING or s.batch_id != msg.batch_id:
            self.rejected["unexpected_bad_batch"] += 1
            return
        self.producers[msg.producer].slots[msg.slot] = Slot()
        self.where.pop(msg.batch_id, None)
        self._mark_bad(msg.batch_id, msg.reason)

    def _mark_bad(self, batch_id: int, reason: str) -> None:
        self.bad[batch_id] = reason
        log.warning("bad_batch batch=%d reason=%s", batch_id, reason)
        try:
            self.to_deliver.remove(batch_id)
        except ValueError:
            pass

    def _release(self, p: int, s: Slot) -> None:
        if 0 <= s.consumer < self.num_consumers:
            self.unreleased[s.consumer] -= 1
        self.where.pop(s.batch_id, None)
        s.state, s.batch_id, s.consumer = FREE, -1, -1

    def on_slot_released(self, msg: m.SlotReleased) -> bool:
        """A consumer's copy out of a slot completed; the slot is FREE again."""
        if not 0 <= msg.producer < len(self.producers):
            self.rejected["bad_producer_index"] += 1
            return False
        s = self._slot(msg.producer, msg.slot, "slot_released")
        # generation here is the one that wrote the data, which may be older than the producer's current one
        if s is None or s.state != READING or s.batch_id != msg.batch_id or s.generation != msg.generation:
            self.rejected["unexpected_slot_released"] += 1
            log.warning("reject slot_released producer=%d slot=%d batch=%d", msg.producer, msg.slot, msg.batch_id)
            return False
        self._release(msg.producer, s)
        return True

    def on_trained(self, msg: m.Trained) -> None:
        """A consumer took an optimizer step covering ``msg.batch_ids`` (``msg.skipped``: a step that changed
        no weight, for want of labels or for a non-finite loss; its batches are done all the same)."""
        for b in msg.batch_ids:
            if b not in self.delivered_ids:  # never delivered: a forged or confused report changes nothing
                self.rejected["undelivered_batch"] += 1
                log.warning("reject trained consumer=%s batch=%s reason=never_delivered", msg.consumer, b)
                continue
            self.trained_counts[b] += 1
            self.trained.add(b)
            if msg.skipped:
                self.skipped.add(b)
            else:
                self.skipped.discard(b)
        if not msg.skipped:
            self.updated_steps += 1
            if self.loss_first is None:
                self.loss_first = msg.loss
            self.loss_last = msg.loss

    # ------------------------------------------------------------------ actions
    def pump(self, send: Send | None = None) -> list[tuple[str, int, Any]]:
        """Hand out the leases and deliveries that can go now; returns them as ``(role, index, message)``.

        Each one is first handed to ``send(role, index, message)`` and recorded in the ledger only when that
        returns True (``send=None``: every send succeeds). A delivery that cannot be sent stops the
        deliveries (they go strictly in order) and marks its consumer not live until its next Hello; a lease
        that cannot be sent is not tried on that producer again in this call.
        """
        send = send or (lambda role, index, msg: True)
        return self._deliver(send) + self._lease(send)

    def _deliver(self, send: Send) -> list[tuple[str, int, Any]]:
        """Deliveries, strictly in plan order, round robin over the live consumers with credit."""
        out: list[tuple[str, int, Any]] = []
        while self.to_deliver:
            b = self.to_deliver[0]
            if b in self.bad:
                self.to_deliver.popleft()
                continue
            loc = self.where.get(b)
            if loc is None:
                break
            p, i = loc
            s = self.producers[p].slots[i]
            if s.state != READY:
                break
            redelivery = b in self.redeliver_to
            c = self.redeliver_to[b] if redelivery else self.delivered % self.num_consumers
            if self.multi_node and self.producer_nodes[p] != self.consumer_nodes[c]:
                self._relocate(b, p, i, c)
                break
            if not self.consumer_live[c] or self.unreleased[c] >= self.max_unreleased:
                break
            msg = self.ready_msgs[(p, i)]
            if not send("consumer", c, msg):
                self.consumer_live[c] = False  # not connected (or not reading): nothing more until its Hello
                break
            self.to_deliver.popleft()
            if redelivery:
                del self.redeliver_to[b]
            else:
                self.delivered += 1
            self.unreleased[c] += 1
            s.state, s.consumer = READING, c
            self.delivered_ids.add(b)
            del self.ready_msgs[(p, i)]
            out.append(("consumer", c, msg))
        return out

    def _lease(self, send: Send) -> list[tuple[str, int, Any]]:
        """Leases, lowest plan position first, each to the live producer with the most FREE slots (several
        nodes: of the node whose consumer will take the batch)."""
        out: list[tuple[str, int, Any]] = []
        if self.multi_node:
            self._make_room_for_head()
        refused: set[int] = set()  # producers whose lease could not be sent in this call
        passed: list[tuple[int, int]] = []   # batches whose node has no free slot now (several nodes)
        while self._lease_heap and len(passed) <= self._max_passed():
            free = [(sum(s.state == FREE for s in ps.slots), -p) for p, ps in enumerate(self.producers)
                    if ps.live and p not in refused]
            free = [f for f in free if f[0] > 0]
            if not free:
                break
            item = heapq.heappop(self._lease_heap)
            b = item[1]
            if b in self.bad or b in self.trained or b in self.where:
                continue
            if self.multi_node:
                node = self.consumer_nodes[self._consumer_of(b)]
                free = [f for f in free if self.producer_nodes[-f[1]] == node]
                if not free:
                    passed.append(item)
                    continue
            p = -max(free)[1]
            ps = self.producers[p]
            i = next(k for k, s in enumerate(ps.slots) if s.state == FREE)
            gen = self.generation("producer", p)
            info = self.batches[b]
            msg = m.Lease(batch_id=b, slot=i, generation=gen, epoch=info.epoch, sample_ids=list(info.sample_ids),
                          pad_to=info.pad_to)
            if not send("producer", p, msg):
                refused.add(p)
                heapq.heappush(self._lease_heap, item)
                continue
            ps.slots[i] = Slot(state=WRITING, batch_id=b, generation=gen)
            self.where[b] = (p, i)
            out.append(("producer", p, msg))
        for item in passed:
            heapq.heappush(self._lease_heap, item)
        return out

    # ------------------------------------------------------------------ several nodes
    def undeliver(self, msg: m.SlotReady, consumer: int) -> None:
        """Several nodes: a delivery that node 0 queued to another node's supervisor could not be passed on to
        its consumer (``send_failed`` from that node). The slot is READY again and the batch back at the head
        of the delivery queue, for the same consumer, which gets nothing more until it says Hello again.
        Ignored when the slot no longer reads that batch."""
        s = self._slot(msg.producer, msg.slot, "undeliver")
        if s is None or s.state != READING or s.batch_id != msg.batch_id or s.consumer != consumer:
            return
        s.state, s.consumer = READY, -1
        self.unreleased[consumer] -= 1
        self.delivered_ids.discard(msg.batch_id)
        self.ready_msgs[(msg.producer, msg.slot)] = msg
        self.to_deliver.appendleft(msg.batch_id)
        self.redeliver_to[msg.batch_id] = consumer
        self.consumer_live[consumer] = False

    def unlease(self, lease: m.Lease, producer: int) -> None:
        """Several nodes: a lease that another node's supervisor could not pass on to its producer. Its slot is
        FREE again and the batch back in the lease queue. Ignored when the slot no longer holds that lease."""
        s = self._slot(producer, lease.slot, "unlease")
        if s is None or s.state != WRITING or s.batch_id != lease.batch_id or s.generation != lease.generation:
            return
        self.producers[producer].slots[lease.slot] = Slot()
        self.where.pop(lease.batch_id, None)
        heapq.heappush(self._lease_heap, (self.position[lease.batch_id], lease.batch_id))

    def _max_passed(self) -> int:
        """How many batches of saturated nodes one pump looks past for a batch of a node with room: a window of
        a few rounds of every consumer, so a pump stays short whatever the length of the queue."""
        slots = sum(len(ps.slots) for ps in self.producers)
        return 4 * (self.num_consumers + slots) if self.multi_node else 0

    def _consumer_of(self, b: int) -> int:
        """The consumer that batch ``b`` (in the delivery queue) will be delivered to, as things stand."""
        if b in self.redeliver_to:
            return self.redeliver_to[b]
        ahead = 0
        for x in self.to_deliver:  # deliveries are strictly in order; leases are near the head of the queue
            if x == b:
                break
            if x not in self.redeliver_to:
                ahead += 1
        return (self.delivered + ahead) % self.num_consumers

    def _make_room_for_head(self) -> None:
        """The batch at the head of the delivery queue waits for a slot on its consumer's node while that node's
        slots all hold later batches (they were leased there before a relocation changed the plan of nodes):
        drop the latest READY one of them so the head can be produced. Without this the run would wait forever."""
        while self.to_deliver and self.to_deliver[0] in self.bad:
            self.to_deliver.popleft()
        if not self.to_deliver or self.to_deliver[0] in self.where:
            return
        head = self.to_deliver[0]
        node = self.consumer_nodes[self._consumer_of(head)]
        mine = [(p, ps) for p, ps in enumerate(self.producers) if self.producer_nodes[p] == node and ps.live]
        if not mine or any(s.state == FREE for _, ps in mine for s in ps.slots):
            return
        ready = [(self.position[s.batch_id], p, i) for p, ps in mine for i, s in enumerate(ps.slots)
                 if s.state == READY]
        if ready:
            _, p, i = max(ready)
            b = self.producers[p].slots[i].batch_id
            log.info("evict batch=%d producer=%d for head batch=%d of node %d", b, p, head, node)
            self._relocate(b, p, i, -1)

    def _relocate(self, b: int, p: int, i: int, c: int) -> None:
        """Batch ``b`` is READY in slot ``i`` of producer ``p``, on another node than its consumer ``c`` (a batch
        ahead of it was marked bad since it was leased): free the slot and lease it again, on ``c``'s node."""
        self.producers[p].slots[i] = Slot()
        self.where.pop(b, None)
        self.ready_msgs.pop((p, i), None)
        heapq.heappush(self._lease_heap, (self.position[b], b))
        self.relocated += 1
        log.info("relocate batch=%d producer=%d node=%d consumer=%d", b, p, self.producer_nodes[p], c)
