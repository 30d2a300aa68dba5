"""Node k's ``RelayCoordinator`` against node 0's ``Coordinator``: what node 0 sends for a child of node k goes
down with local indices; a lease or delivery that node k cannot hand to its child goes back up as
``send_failed`` and node 0 takes it back, so it is sent again and trained once. The link between them is a
recording stand-in here (the real CURVE link is tested in ``test_node_link.py``)."""

from __future__ import annotations

from specring.shared.data.dataset import Batch
from specring.shared.transport import messages as m
from specring.supervisor.coordinator import Coordinator
from specring.supervisor.nodes import NodeTopology, RelayCoordinator


class RecordingLink:
    def __init__(self):
        self.sent: list[m.NodeMsg] = []

    def send(self, msg, to=None) -> bool:
        self.sent.append(msg)
        return True


def two_nodes():
    # one producer and one consumer per node; node 1 is global producer 1 and consumer 1
    topo = NodeTopology(nnodes=2, node_rank=1, producers=[1, 1], consumers=[1, 1], store_addr="127.0.0.1:1",
                        dp_prefix="t", checkpoints_dir="/nonexistent")
    co = Coordinator([Batch(batch_id=i, epoch=0, sample_ids=(i,), pad_to=8) for i in range(2)], num_producers=2,
                     num_slots=1, num_consumers=2, producer_nodes=[0, 1], consumer_nodes=[0, 1])
    for role in ("producer", "consumer"):
        for i in range(2):
            co.on_hello(role, i, 1)
    link = RecordingLink()
    return co, RelayCoordinator(topo, link), link


def down(relay: RelayCoordinator, role: str, index: int, msg) -> None:
    relay.down(m.NodeMsg(node=0, event="child", role=role, index=index, body=m.encode(msg)))


def back_to_node0(co: Coordinator, nm: m.NodeMsg) -> None:
    """What node 0's supervisor does with ``send_failed`` (``supervisor.node_events``)."""
    msg = m.decode(nm.body)
    if isinstance(msg, m.Lease):
        co.unlease(msg, nm.index)
    else:
        co.undeliver(msg, nm.index)


def test_a_lease_node_k_cannot_hand_on_is_taken_back_and_sent_again():
    co, relay, link = two_nodes()
    sent = co.pump()
    lease = next(msg for role, i, msg in sent if role == "producer" and i == 1)
    assert lease.batch_id == 1  # batch 1 goes to consumer 1, so to node 1's producer
    assert co.occupancy(1)["WRITING"] == 1
    down(relay, "producer", 1, lease)
    assert relay.pump(lambda role, index, msg: False) == []   # node 1's producer is not connected
    [nm] = [x for x in link.sent if x.event == "send_failed"]
    assert (nm.role, nm.index, m.decode(nm.body)) == ("producer", 1, lease)  # global index
    back_to_node0(co, nm)
    assert co.occupancy(1)["FREE"] == 1
    again = [msg for role, i, msg in co.pump() if role == "producer" and i == 1]
    assert [x.batch_id for x in again] == [1]


def test_a_delivery_node_k_cannot_hand_on_goes_back_to_the_same_consumer():
    co, relay, link = two_nodes()
    leases = {i: msg for role, i, msg in co.pump() if role == "producer"}
    for p, lease in leases.items():
        co.on_slot_ready(m.SlotReady(producer=p, generation=1, slot=lease.slot, batch_id=lease.batch_id, seq=0,
                                     descriptor=[], payload_bytes=0, num_tokens=8))
    deliveries = {c: msg for role, c, msg in co.pump() if role == "consumer"}
    assert deliveries[1].batch_id == 1 and deliveries[1].producer == 1
    down(relay, "consumer", 1, deliveries[1])
    got = relay.pump(lambda role, index, msg: role == "producer")  # the consumer does not take it
    assert got == []
    [nm] = [x for x in link.sent if x.event == "send_failed"]
    assert m.decode(nm.body) == deliveries[1]  # the producer index is global again on the way up
    back_to_node0(co, nm)
    assert co.occupancy(1)["READY"] == 1 and co.pump() == []   # nothing until consumer 1 says Hello again
    co.on_hello("consumer", 1, 1)
    assert [(c, msg.batch_id) for role, c, msg in co.pump()] == [(1, 1)]
    # delivered to node 1 once it takes it, with the producer's local index
    down(relay, "consumer", 1, deliveries[1])
    [(role, c, msg)] = relay.pump(lambda role, index, msg: True)
    assert (role, c, msg.producer, msg.batch_id) == ("consumer", 0, 0, 1)
