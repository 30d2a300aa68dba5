"""Several nodes: how node supervisors meet, talk, and stand in for one another's coordinator.

A run of ``N`` nodes is ``N`` launchers (``launch.py train --nnodes N --node-rank R ...``, or ``torchrun
--nnodes N --nproc-per-node 1 ... launch.py train ...``), each with its own supervisor, producers, rings and
consumers. ``docs/DESIGN.md`` ("Several nodes") describes the whole; this module holds its parts:

* ``rendezvous``: the supervisors meet in torch.distributed's ``TCPStore`` at ``master_addr:master_port``
  (node 0's supervisor hosts it, or torchrun's agent hosts it when ``TORCHELASTIC_USE_AGENT_STORE`` is set).
  Node 0 publishes its control endpoint, its CURVE public key, the digest of the run plan and where its
  checkpoints live; node ``k`` registers its own CURVE public key and its plan digest under its rank (set once:
  a second node with the same rank is refused), and gets node 0's verdict: a node whose plan differs (other
  data, flags, consumer count, or another target or tokenizer by content: ``plan_record``) is refused with an
  error naming what differs. The consumers of every node join
  one data-parallel group through the same store (``consumer_store_env``).
* ``NodeLink``: the control link, ZeroMQ over TCP with CURVE (``zmq.has("curve")``): node 0 binds a ROUTER as
  CURVE server and admits only the client keys registered at the rendezvous (a ZAP handler,
  ``zmq.auth.thread.ThreadAuthenticator``); a peer without a registered key never completes the handshake, so
  nothing it sends is read. Every frame's ``User-Id`` (the sender's key) must belong to the node the message
  names. Sends never block (``channel.send`` semantics).
* ``RelayCoordinator``: on node ``k`` it takes the coordinator's place in the supervisor: what the local
  children say goes up to node 0 with global indices (producer ``i`` of node ``k`` is global producer
  ``P_0 + ... + P_{k-1} + i``, consumers likewise), and what node 0 sends to them comes down with local indices.
  Node 0's ``Coordinator`` is the one batch ledger; hidden states never leave their node (its locality rule).

Errors: a rendezvous that does not complete within ``rendezvous_timeout_s`` raises ``RendezvousError`` naming the
address and the missing node; a refused node raises ``ConfigError`` with node 0's reason.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import secrets
import time
from collections import Counter, deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import zmq

from specring.shared import envs
from specring.shared.errors import ConfigError, MessageError
from specring.shared.run.run_dir import RunDir
from specring.shared.transport import channel
from specring.shared.transport import messages as m
from specring.supervisor.peers import LogLimiter

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0   # a node link says something at least this often
SEND_FAILED_LOG_EVERY_S = 10.0  # a node that does not read: one send_failed line per node and event this often
STORE_ENV, PREFIX_ENV, CHECKPOINTS_ENV = envs.DIST_STORE, envs.DIST_PREFIX, envs.CHECKPOINTS_DIR  # shared/envs.py


class RendezvousError(RuntimeError):
    """The nodes did not all meet in time (names the store address and who is missing)."""


@dataclass
class NodeTopology:
    """Who runs what, agreed at the rendezvous: producers and consumers per node (node order)."""
    nnodes: int
    node_rank: int
    producers: list[int]
    consumers: list[int]
    store_addr: str            # host:port
    dp_prefix: str             # key prefix of the consumers' process group in the store
    checkpoints_dir: str       # node 0's

    def offset(self, role: str) -> int:
        """Global index of this node's first producer or consumer."""
        counts = self.producers if role == "producer" else self.consumers
        return sum(counts[:self.node_rank])

    def nodes_of(self, role: str) -> list[int]:
        """The node of every global producer or consumer."""
        counts = self.producers if role == "producer" else self.consumers
        return [n for n, c in enumerate(counts) for _ in range(c)]


def _digest(x) -> str:
    return hashlib.sha256(json.dumps(x, sort_keys=True, default=str).encode()).hexdigest()[:16]


# the producer fields that shape what is captured besides the target itself (its layers are compared resolved)
CAPTURE_FIELDS = ("dtype", "random_weights", "trust_remote_code")
WHY = {"target weights": "the target checkpoints' weights differ (compared by content, not path: a copy elsewhere "
                         "is fine)",
       "target config": "the target checkpoints' config.json (or the modelling code they ship) differ",
       "tokenizer": "the target checkpoints' tokenizers differ"}


def plan_record(cfg, plan) -> dict[str, str]:
    """What every node must agree on, one short digest per item: the batch order, the data, the captured
    layers, the steps, the slot size, the consumers per node, each trainer field, the target by content
    (``shared.models.fingerprint.target_fingerprint``: its config, sampled weights and tokenizer, whatever its path) and
    how it is captured (``CAPTURE_FIELDS``: dtype, random weights, remote code). Nodes that differ in any
    would train different runs (a drafter trained on two targets' hidden states mixed); ``plan_differences``
    names the items. Raises ``ConfigError`` naming ``--target`` when the target's files cannot be read."""
    record = {"batch order": _digest([b.batch_id for b in plan.order]), "data": _digest(plan.data_digest),
              "target layers": _digest(plan.target_layer_ids), "optimizer steps": _digest(plan.total_steps),
              "slot size": _digest(plan.slot_bytes), "consumers per node": _digest(len(cfg.trainer.devices))}
    for k, v in dataclasses.asdict(cfg.trainer).items():
        if k != "devices":
            record[f"trainer.{k}"] = _digest(v)
    producer = getattr(cfg, "producer", None)
    if getattr(producer, "target", None):
        from specring.shared.models.fingerprint import target_fingerprint
        try:
            record.update(target_fingerprint(producer.target))
        except OSError as e:
            raise ConfigError(f"--target: {producer.target} cannot be read to compare it with the other nodes' "
                              f"({e})") from None
    for k in CAPTURE_FIELDS:
        if hasattr(producer, k):
            record[f"producer.{k}"] = _digest(getattr(producer, k))
    return record


def explain_differences(diff: list[str]) -> str:
    """The items of ``plan_differences``, each target item with what it means (``WHY``)."""
    return ", ".join(f"{k} ({WHY[k]})" if k in WHY else k for k in diff)


def plan_differences(a: dict, b: dict) -> list[str]:
    """The items of two ``plan_record``s that differ."""
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def _store(cfg, is_master: bool):
    from torch.distributed import TCPStore
    nc = cfg.nodes
    try:
        return TCPStore(nc.master_addr, nc.master_port, is_master=is_master,
                        timeout=timedelta(seconds=nc.rendezvous_timeout_s), wait_for_workers=False)
    except Exception as e:  # torch raises RuntimeError/DistNetworkError for an address in use or unreachable
        what = "host the rendezvous store on" if is_master else "reach the rendezvous store at"
        raise RendezvousError(f"node {nc.node_rank}: cannot {what} {nc.master_addr}:{nc.master_port}: "
                              f"{type(e).__name__}: {e}") from None


def _get(store, key: str, what: str, cfg) -> bytes:
    try:
        return store.get(key)
    except Exception as e:
        raise RendezvousError(f"node {cfg.nodes.node_rank}: {what} did not arrive at the rendezvous store "
                              f"{cfg.nodes.master_addr}:{cfg.nodes.master_port} within "
                              f"{cfg.nodes.rendezvous_timeout_s:g} s ({type(e).__name__})") from None


def rendezvous(cfg, plan, ctx: zmq.Context, run_dir: str):
    """Meet the other nodes; returns ``(NodeTopology, NodeLink, store)`` (keep the store referenced for the life
    of the run: on node 0 it hosts the store every node and consumer talks to). See the module docstring."""
    nc = cfg.nodes
    agent = (envs.get("TORCHELASTIC_USE_AGENT_STORE") or "").lower() == "true"
    rank = nc.node_rank
    store = _store(cfg, is_master=(rank == 0 and not agent))
    base = f"specring/{envs.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    record = plan_record(cfg, plan)
    mine = {"producers": len(cfg.producer.devices), "consumers": len(cfg.trainer.devices), "plan": record}
    if rank == 0:
        link = NodeLink.server(ctx, nc.master_addr)
        try:  # the link holds a socket and an authenticator thread: closed on any failure, or ctx.term() hangs
            info = dict(mine, endpoint=link.endpoint, server_key=link.public_key.decode(),
                        dp_prefix=f"{base}dp-{secrets.token_hex(6)}/",
                        checkpoints_dir=os.path.abspath(RunDir(run_dir).checkpoints_dir))
            _register(store, base + "node0", info, cfg)
            producers, consumers, errors = [mine["producers"]], [mine["consumers"]], []
            for k in range(1, nc.nnodes):
                other = json.loads(_get(store, f"{base}node{k}", f"node {k}", cfg))
                diff = plan_differences(record, other["plan"])
                why = (f"node {k}'s run differs from node 0's in {explain_differences(diff)}: every node must give "
                       f"the same flags (and data), run the same target and tokenizer by content and the same number "
                       f"of consumers") if diff else ""
                store.set(f"{base}verdict{k}", why or "ok")
                if why:
                    errors.append(why)
                link.allow(other["client_key"].encode(), k)
                producers.append(int(other["producers"]))
                consumers.append(int(other["consumers"]))
            if errors:
                raise ConfigError("; ".join(errors))
            topo = NodeTopology(nc.nnodes, 0, producers, consumers, f"{nc.master_addr}:{nc.master_port}",
                                info["dp_prefix"], info["checkpoints_dir"])
        except BaseException:
            link.close()
            raise
    else:
        pub, sec = zmq.curve_keypair()
        _register(store, f"{base}node{rank}", dict(mine, client_key=pub.decode()), cfg)
        node0 = json.loads(_get(store, base + "node0", "node 0", cfg))
        verdict = _get(store, f"{base}verdict{rank}", "node 0's verdict", cfg).decode()
        if verdict != "ok":
            raise ConfigError(f"node 0 refused node {rank}: {verdict}")
        counts = [json.loads(_get(store, f"{base}node{k}", f"node {k}", cfg)) for k in range(1, nc.nnodes)]
        topo = NodeTopology(nc.nnodes, rank, [node0["producers"]] + [c["producers"] for c in counts],
                            [node0["consumers"]] + [c["consumers"] for c in counts],
                            f"{nc.master_addr}:{nc.master_port}", node0["dp_prefix"], node0["checkpoints_dir"])
        link = NodeLink.client(ctx, node0["endpoint"], node0["server_key"].encode(), pub, sec, rank)
    log.info("rendezvous node=%d nnodes=%d producers=%s consumers=%s store=%s endpoint=%s", rank, nc.nnodes,
             topo.producers, topo.consumers, topo.store_addr, link.endpoint)
    return topo, link, store


def _register(store, key: str, info: dict, cfg) -> None:
    value = json.dumps(info)
    try:
        got = store.compare_set(key, "", value)
    except Exception as e:
        raise RendezvousError(f"node {cfg.nodes.node_rank}: the rendezvous store {cfg.nodes.master_addr}:"
                              f"{cfg.nodes.master_port} failed: {type(e).__name__}: {e}") from None
    if got.decode() != value:
        raise ConfigError(f"--node-rank: node rank {cfg.nodes.node_rank} has already joined the run at "
                          f"{cfg.nodes.master_addr}:{cfg.nodes.master_port} (two nodes with the same rank?)",
                          key="nodes.node_rank")


def consumer_store_env(topo: NodeTopology, node_rank: int, local_index: int) -> dict[str, str]:
    """Environment of a consumer of a multi-node run: its global rank, the world size, and where the process
    group meets (the rendezvous store, under this run's prefix); on nodes other than 0, node 0's checkpoints."""
    env = {"RANK": str(topo.offset("consumer") + local_index), "WORLD_SIZE": str(sum(topo.consumers)),
           STORE_ENV: topo.store_addr, PREFIX_ENV: topo.dp_prefix}
    if node_rank != 0:
        env[CHECKPOINTS_ENV] = topo.checkpoints_dir
    return env


# ------------------------------------------------------------------------------------------------ link
class _Allowed:
    """The ZAP credentials provider: only CURVE keys registered at the rendezvous may connect."""

    def __init__(self):
        self.keys: dict[bytes, int] = {}
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key in self.keys
        if not ok:
            self.refused += 1
            log.warning("node_link refused a peer whose key was not registered at the rendezvous")
        return ok


class NodeLink:
    """The authenticated control link between node supervisors (see the module docstring). Build with
    ``server`` (node 0) or ``client`` (other nodes)."""

    def __init__(self, sock: zmq.Socket, endpoint: str, public_key: bytes, node: int, auth=None,
                 allowed: _Allowed | None = None):
        self.sock, self.endpoint, self.public_key, self.node = sock, endpoint, public_key, node
        self.auth, self.allowed = auth, allowed
        self.last_sent: dict[int, float] = {}   # node → when it was last sent anything (node 0's heartbeats)
        self.rejected = 0
        self.send_failures = 0                  # sends that could not be queued (a node stopped, gone, not reading)
        self._log_limiter = LogLimiter(SEND_FAILED_LOG_EVERY_S)

    @classmethod
    def server(cls, ctx: zmq.Context, advertise_host: str, bind_host: str = "*") -> "NodeLink":
        """Node 0's ROUTER, a CURVE server on a free TCP port, admitting the keys given to ``allow``."""
        if not zmq.has("curve"):
            raise ConfigError("--nnodes: this pyzmq/libzmq has no CURVE security, which authenticates the control "
                              "traffic between nodes")
        from zmq.auth.thread import ThreadAuthenticator
        pub, sec = zmq.curve_keypair()
        allowed = _Allowed()
        auth = ThreadAuthenticator(ctx, log=logging.getLogger(__name__ + ".zap"))
        auth.start()
        auth.configure_curve_callback(domain="*", credentials_provider=allowed)
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, channel.LINGER_MS)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, channel.ROUTER_SNDHWM)
        sock.setsockopt(zmq.MAXMSGSIZE, m.MAX_MESSAGE_BYTES + 4096)
        sock.curve_server = True
        sock.curve_secretkey, sock.curve_publickey = sec, pub
        port = sock.bind_to_random_port(f"tcp://{bind_host}")
        return cls(sock, f"tcp://{advertise_host}:{port}", pub, 0, auth, allowed)

    @classmethod
    def client(cls, ctx: zmq.Context, endpoint: str, server_key: bytes, public_key: bytes, secret_key: bytes,
               node: int) -> "NodeLink":
        """Node ``node``'s DEALER to node 0, a CURVE client with the keys registered at the rendezvous."""
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, channel.LINGER_MS)
        sock.setsockopt(zmq.SNDHWM, channel.HWM)
        sock.setsockopt(zmq.IDENTITY, f"node-{node}".encode())
        sock.curve_serverkey = server_key
        sock.curve_publickey, sock.curve_secretkey = public_key, secret_key
        sock.connect(endpoint)
        return cls(sock, endpoint, public_key, node)

    def allow(self, key: bytes, node: int) -> None:
        self.allowed.keys[key] = node

    def send(self, msg: m.NodeMsg, to: int | None = None) -> bool:
        """Send without blocking (to node ``to`` from node 0); False when the peer is gone or not reading (counted
        in ``send_failures``; logged at most once per node and event every ``SEND_FAILED_LOG_EVERY_S``)."""
        try:
            if to is None:
                self.sock.send(m.encode(msg), flags=zmq.NOBLOCK)
            else:
                self.sock.send_multipart([f"node-{to}".encode(), m.encode(msg)], flags=zmq.NOBLOCK)
            self.last_sent[0 if to is None else to] = time.monotonic()
            return True
        except zmq.ZMQError as e:  # rate-limited: a node stopped for 20 s must not write a line per heartbeat
            self.send_failures += 1
            key = (0 if to is None else to, msg.event)
            if self._log_limiter.allow(key):
                held = self._log_limiter.held(key)
                log.warning("node_link send_failed to=%s event=%s error=%s%s", key[0], msg.event, e,
                            f" (and {held} more in the last {SEND_FAILED_LOG_EVERY_S:g} s)" if held else "")
            return False

    def recv(self, timeout_s: float = 0.0) -> m.NodeMsg | None:
        """One message, or None. On node 0 a frame whose ``User-Id`` (sender key) does not belong to the node the
        message names, and anything that is not a ``NodeMsg``, is counted in ``rejected`` and dropped."""
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        frames = self.sock.recv_multipart(copy=False)
        data = frames[-1]
        try:
            msg = m.decode(data.bytes)
        except MessageError as e:
            self.rejected += 1
            log.warning("node_link reject error=%s", e)
            return None
        if not isinstance(msg, m.NodeMsg):
            self.rejected += 1
            log.warning("node_link reject kind=%s reason=not_a_node_message", getattr(msg, "KIND", "?"))
            return None
        if self.allowed is not None:
            sender = self.allowed.keys.get(data.get("User-Id").encode())
            if sender != msg.node or len(frames) != 2 or frames[0].bytes != f"node-{sender}".encode():
                self.rejected += 1
                log.warning("node_link reject node=%s key_of_node=%s reason=not_its_key", msg.node, sender)
                return None
        return msg

    def close(self) -> None:
        self.sock.close(linger=0)
        if self.auth is not None:
            self.auth.stop()


# ------------------------------------------------------------------------------------------------ relay
def to_global(msg: Any, topo: NodeTopology) -> Any:
    """A local child's message with its producer/consumer indices made global (node ``topo.node_rank``'s)."""
    po, co = topo.offset("producer"), topo.offset("consumer")
    if isinstance(msg, (m.Hello, m.Heartbeat, m.Error)):
        return dataclasses.replace(msg, index=msg.index + (po if msg.role == "producer" else co))
    if isinstance(msg, (m.SlotReady, m.SlotReleased, m.BadBatch)):
        return dataclasses.replace(msg, producer=msg.producer + po)
    if isinstance(msg, m.Trained):
        return dataclasses.replace(msg, consumer=msg.consumer + co)
    return msg


def to_local(msg: Any, topo: NodeTopology) -> Any:
    """A message from node 0 for a child of this node, with the producer index of a delivery made local."""
    if isinstance(msg, m.SlotReady):
        return dataclasses.replace(msg, producer=msg.producer - topo.offset("producer"))
    return msg


class RelayCoordinator:
    """Node ``k``'s stand-in for the coordinator (see the module docstring). The supervisor relays each child
    message with ``up``; ``pump`` returns what node 0 sent for the children, with local indices. The ledger
    fields that the supervisor reports are empty here: node 0's ``summary.json`` holds the run's."""

    def __init__(self, topo: NodeTopology, link: NodeLink):
        self.topo, self.link = topo, link
        self.order: list[int] = []
        self.trained: set[int] = set()
        self.bad: dict[int, str] = {}
        self.skipped: set[int] = set()
        self.updated_steps = 0
        self.duplicates = 0
        self.trained_before = 0
        self.rejected: Counter = Counter()
        self.loss_first = self.loss_last = None
        self.done = False
        self.generations = [1] * topo.producers[topo.node_rank]
        self.inbox: deque = deque()

    def up(self, role: str, index: int, msg: Any) -> None:
        g = to_global(msg, self.topo)
        self.link.send(m.NodeMsg(node=self.topo.node_rank, event="child", role=role,
                                 index=index + self.topo.offset(role), body=m.encode(g)))

    def down(self, nm: m.NodeMsg) -> None:
        """A ``child`` message from node 0: queued for ``pump`` with the local index."""
        local = nm.index - self.topo.offset(nm.role)
        count = self.topo.producers if nm.role == "producer" else self.topo.consumers
        if not 0 <= local < count[self.topo.node_rank]:
            log.warning("node_link reject role=%s index=%d reason=not_on_this_node", nm.role, nm.index)
            return
        self.inbox.append((nm.role, local, to_local(m.decode(nm.body), self.topo)))

    # the Coordinator interface the supervisor uses
    def lost(self) -> list[int]:
        return []

    def occupancy(self, producer: int) -> dict[str, int]:
        return {"FREE": 0, "WRITING": 0, "READY": 0, "READING": 0}  # node 0 keeps the slot states

    def on_hello(self, *a) -> None:
        pass

    def on_slot_ready(self, msg) -> bool:
        return True

    def on_bad_batch(self, msg, from_consumer: bool) -> None:
        pass

    def on_slot_released(self, msg) -> bool:
        return True

    def on_trained(self, msg) -> None:
        pass

    def producer_died(self, p: int) -> int:
        """Mirror of node 0's fencing: both sides bump the generation once per death."""
        self.generations[p] += 1
        self.link.send(m.NodeMsg(node=self.topo.node_rank, event="producer_died", role="producer",
                                 index=p + self.topo.offset("producer")))
        return self.generations[p]

    def generation(self, role: str, index: int) -> int:
        """The generation of local child ``role`` ``index`` (producers mirror node 0's fencing; consumers are
        never restarted, so stay at 1)."""
        return self.generations[index] if role == "producer" else 1

    def fenced(self, role: str, index: int, generation: int, what: str) -> bool:
        """As ``Coordinator.fenced``, for this node's children (local indices); node 0 fences again."""
        count = len(self.generations) if role == "producer" else self.topo.consumers[self.topo.node_rank]
        if not (isinstance(index, int) and 0 <= index < count):
            self.rejected[f"bad_{role}_index"] += 1
            log.warning("reject %s %s=%s reason=no_such_%s", what, role, index, role)
            return True
        if generation != self.generation(role, index):
            self.rejected["stale_generation"] += 1
            log.warning("reject %s %s=%d generation=%s current=%d reason=stale_generation", what, role, index,
                        generation, self.generation(role, index))
            return True
        return False

    def _send_failed(self, role: str, index: int, msg) -> None:
        self.link.send(m.NodeMsg(node=self.topo.node_rank, event="send_failed", role=role,
                                 index=index + self.topo.offset(role), body=m.encode(to_global(msg, self.topo))))

    def pump(self, send: Callable[[str, int, Any], bool] | None = None) -> list:
        """Pass what node 0 sent to the local children through ``send(role, local index, message)``; one that
        cannot be queued goes back to node 0 as ``send_failed`` (node 0 takes the lease or delivery back).
        Returns what was sent."""
        out = []
        while self.inbox:
            role, index, msg = self.inbox.popleft()
            if send is None or send(role, index, msg):
                out.append((role, index, msg))
            else:
                self._send_failed(role, index, msg)
        return out
