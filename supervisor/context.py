"""What the supervisor's parts share: the run's plan and identity, its children, the ledger and the socket.

``RunContext`` is handed to each part of ``supervisor.supervisor.Supervisor`` (``MessageDispatch``,
``NodeEvents``, ``ChildLifecycle``, ``RunRecords``); each part keeps its own state as its own attributes and
reads or sets only these shared ones here: the state no single part owns. Beside it, the loop's timing constants
every part keeps to (``POLL_S``, ``MAX_FRAMES_PER_TURN``, ``SHUTDOWN_CAP_FACTOR``) and ``to_ledger``, the hand-over of
a child's batch messages to the ledger, which both ``MessageDispatch`` (this node's children) and ``NodeEvents``
(other nodes' children, on node 0) make.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specring.shared.transport import messages as m

if TYPE_CHECKING:
    from specring.shared.config.run_config import RunConfig
    from specring.shared.process.balance import ProcessBalance
    from specring.supervisor.coordinator import Coordinator
    from specring.supervisor.monitor import Child, HealthMonitor
    from specring.supervisor.nodes import RelayCoordinator
    from specring.supervisor.progress import Progress
    from specring.supervisor.runplan import RunPlan

POLL_S = 0.05  # how long the loop waits for a frame before it looks at the children
MAX_FRAMES_PER_TURN = 500  # frames handled before the loop pumps, watches children and checks for a stop
# a consumer still heartbeating after shutdown is waited for at most this many shutdown_timeout_s
SHUTDOWN_CAP_FACTOR = 5


@dataclass
class RunContext:
    """The state the supervisor's parts share.

    * ``cfg`` (``RunConfig``), ``plan`` (``RunPlan``: batch order, slot sizes), ``run_dir``, ``run_id``: set once;
    * ``monitor`` (``HealthMonitor``), ``producers``/``consumers`` (this node's ``Child`` records, by local index)
      and ``balance`` (a ``shared.process.balance.ProcessBalance`` per ``(role, index)``): set once, updated in place;
    * ``coordinator``: the ledger (``Coordinator``, or on node k > 0 its ``RelayCoordinator``), None until
      ``Supervisor`` set-up; ``router``: the ROUTER socket of the coordinator channel, None until set-up and
      once closed; ``progress``: the progress line (``Progress``), None until ``Supervisor.run``;
    * ``stop_reason``: why the loop stops (empty while it runs; the first part to set it names the reason) and
      ``signals``: stop signals received so far (two or more: a hard stop, no waiting for checkpoints)."""
    cfg: RunConfig
    plan: RunPlan | None
    run_dir: Path
    run_id: str
    monitor: HealthMonitor
    producers: list[Child]
    consumers: list[Child]
    balance: dict[tuple[str, int], ProcessBalance]
    coordinator: Coordinator | RelayCoordinator | None = None
    router: Any = None
    progress: Progress | None = None
    stop_reason: str = ""
    signals: int = 0

    def child(self, role: str, index: int) -> Child | None:
        """This node's ``role`` child of local ``index``; None for another role, a non-int or an index out of
        range."""
        group = self.producers if role == "producer" else self.consumers if role == "consumer" else []
        return group[index] if isinstance(index, int) and 0 <= index < len(group) else None


def to_ledger(co, records, world: int, role: str, msg) -> bool | None:
    """Hand a child's ``SlotReady``/``BadBatch``/``SlotReleased``/``Trained`` to the coordinator ``co`` (a local
    child's, or on node 0 another node's, indices global; a ``Trained`` through ``records``, the run's
    ``supervisor.records.RunRecords``, ``world``: the run's consumers on every node); returns whether it counts as the
    child's progress, None when it is not one of those messages from that role."""
    if isinstance(msg, m.SlotReady) and role == "producer":
        return co.on_slot_ready(msg)
    if isinstance(msg, m.BadBatch):
        co.on_bad_batch(msg, from_consumer=(role == "consumer"))
        return True
    if isinstance(msg, m.SlotReleased) and role == "consumer":
        co.on_slot_released(msg)
        return True
    if isinstance(msg, m.Trained) and role == "consumer":
        records.on_trained(msg, world)
        return True
    return None
