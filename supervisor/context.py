"""What the supervisor's parts share: the run's plan and identity, its children, the ledger and the socket.

``RunContext`` is handed to each part of ``supervisor.supervisor.Supervisor`` (``MessageDispatch``,
``NodeEvents``, ``ChildLifecycle``, ``RunRecords``); each part keeps its own state as its own attributes and
reads or sets only these shared ones here. Nothing in it does work: it is the state no single part owns.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specring.shared.config.run_config import RunConfig
    from specring.shared.process.balance import ProcessBalance
    from specring.supervisor.coordinator import Coordinator
    from specring.supervisor.monitor import Child, HealthMonitor
    from specring.supervisor.nodes import RelayCoordinator
    from specring.supervisor.progress import Progress
    from specring.supervisor.runplan import RunPlan


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
