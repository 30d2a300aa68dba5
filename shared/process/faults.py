"""Fault injection for tests and chaos drills: the ``SPECRING_*`` environment hooks of the child processes.

Every hook is read here and nowhere else. None of them is set in a normal run; each one that is set logs a
``fault ...`` warning in the process that reads it, so a hook left on is visible in the logs. A value that
does not parse is a ``ConfigError`` naming the variable. The hooks:

``SPECRING_FAULT_HELPERS=1``
    The producer starts two helper processes (``sleep 600``) at start-up, as target code may: one in its
    own process group, one in a session of its own (``setsid``, out of reach of a group kill). Neither may
    outlive the producer's restart or the run.

``SPECRING_SLOW_FORWARD_S=<seconds>``
    The producer sleeps this long in every batch, before the forward (a long sequence on a big target, a
    cold compile): the batch takes longer, the process stays healthy.
``SPECRING_STALL_FORWARD=<index>:<generation>``
    That producer incarnation never returns from its first batch (it waits on an event nobody sets, as a
    deadlock in the forward would): its process and its heartbeat thread live on, its batch never ends.

``SPECRING_SLOW_WRITE_S=<seconds>``
    The producer sleeps this long between writing a slot and publishing it, so a test can SIGKILL a producer
    whose slot is WRITING (``slow_write_s``).
``SPECRING_INJECT_NONFINITE=<batch_id,...>``
    The producer puts a NaN into those batches' captured hidden states, before its finite check, so the real
    check must catch it (``inject_nonfinite``).
``SPECRING_SLOW_CHECKPOINT_S=<seconds>``
    A checkpoint write sleeps this long before its rename, as a large drafter's write would take
    (``slow_checkpoint_s``, ``shared.drafters.checkpoint``).
``SPECRING_SLOW_EVAL_S=<seconds>``
    The consumer's tau evaluation sleeps this long after each prompt (``slow_eval_s``, ``consumer.tau``).
``SPECRING_FAIL_EVAL=1``
    The consumer's tau evaluation raises ``RuntimeError`` before its first prompt (``fail_eval``,
    ``consumer.tau``), so a test can see that a failed evaluation is named, not silent.

``SPECRING_SLOW_SHARD_S=<seconds>``
    A ``launch.py regenerate`` worker sleeps this long after writing each shard (``slow_shard_s``), so a test
    can stop or kill the launcher while its workers live, between two shards.

``SPECRING_RUN_ID`` is no hook: it marks a run's processes (``shared.process.procs``).
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time

from specring.shared import envs
from specring.shared.errors import ConfigError

log = logging.getLogger(__name__)

# the hooks' names, declared in shared/envs.py
HELPERS_ENV = envs.FAULT_HELPERS
SLOW_FORWARD_ENV = envs.SLOW_FORWARD_S
STALL_FORWARD_ENV = envs.STALL_FORWARD
SLOW_WRITE_ENV = envs.SLOW_WRITE_S
INJECT_NONFINITE_ENV = envs.INJECT_NONFINITE
SLOW_CHECKPOINT_ENV = envs.SLOW_CHECKPOINT_S
SLOW_EVAL_ENV = envs.SLOW_EVAL_S
FAIL_EVAL_ENV = envs.FAIL_EVAL
SLOW_SHARD_ENV = envs.SLOW_SHARD_S
_warned: set[str] = set()  # hooks whose "fault ..." line this process has logged


flag = envs.flag          # ``$name`` as a switch (shared.envs.flag)
seconds = envs.seconds    # ``$name`` as seconds (shared.envs.seconds)


def start_helpers() -> list[subprocess.Popen]:
    """Under ``SPECRING_FAULT_HELPERS=1``: start the two helpers (see the module docstring) and return them;
    ``[]`` otherwise. Each helper's pid is logged as ``fault helper pid=N session=group|own``."""
    if not flag(HELPERS_ENV):
        return []
    helpers = []
    for own_session in (False, True):
        p = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             start_new_session=own_session)
        log.warning("fault helper pid=%d session=%s", p.pid, "own" if own_session else "group")
        helpers.append(p)
    return helpers


def stall_target() -> tuple[int, int] | None:
    """``$SPECRING_STALL_FORWARD`` as ``(producer index, generation)``; None when unset; ``ConfigError``
    naming it unless it reads ``<index>:<generation>`` with integers >= 0 and >= 1."""
    text = (envs.get(STALL_FORWARD_ENV) or "").strip()
    if not text:
        return None
    index, sep, gen = text.partition(":")
    if not (sep and index.isdigit() and gen.isdigit() and int(gen) >= 1):
        raise ConfigError(f"{STALL_FORWARD_ENV}={text!r} must read <producer index>:<generation>, e.g. 0:1")
    return int(index), int(gen)


def _warn_once(name: str, value) -> None:
    if name not in _warned:
        _warned.add(name)
        log.warning("fault %s=%s", name, value)


def _seconds_hook(name: str) -> float:
    value = seconds(name)
    if value:
        _warn_once(name, value)
    return value


def slow_write_s() -> float:
    """``$SPECRING_SLOW_WRITE_S``: seconds between writing a slot and publishing it (0 when unset)."""
    return _seconds_hook(SLOW_WRITE_ENV)


def slow_checkpoint_s() -> float:
    """``$SPECRING_SLOW_CHECKPOINT_S``: seconds a checkpoint write sleeps before its rename (0 when unset)."""
    return _seconds_hook(SLOW_CHECKPOINT_ENV)


def slow_eval_s() -> float:
    """``$SPECRING_SLOW_EVAL_S``: seconds the tau evaluation sleeps after each prompt (0 when unset)."""
    return _seconds_hook(SLOW_EVAL_ENV)


def slow_shard_s() -> float:
    """``$SPECRING_SLOW_SHARD_S``: seconds a regenerate worker sleeps after each shard it wrote (0 when unset)."""
    return _seconds_hook(SLOW_SHARD_ENV)


def fail_eval() -> bool:
    """``$SPECRING_FAIL_EVAL``: whether the tau evaluation is to raise (logged once when on)."""
    on = flag(FAIL_EVAL_ENV)
    if on and FAIL_EVAL_ENV not in _warned:
        _warned.add(FAIL_EVAL_ENV)
        log.warning("fault %s=1: every tau evaluation raises", FAIL_EVAL_ENV)
    return on


def parse_batch_ids(text: str | None) -> set[int]:
    """``"3,17, 42"`` -> ``{3, 17, 42}``; empty or None -> empty set. Raises ``ConfigError`` naming
    ``SPECRING_INJECT_NONFINITE`` and a bad entry."""
    out: set[int] = set()
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        try:
            out.add(int(part))
        except ValueError:
            raise ConfigError(f"{INJECT_NONFINITE_ENV}: {part!r} is not a batch id") from None
    return out


def inject_nonfinite() -> set[int]:
    """``$SPECRING_INJECT_NONFINITE``: the batch ids whose hidden states get a NaN (empty when unset)."""
    ids = parse_batch_ids(envs.get(INJECT_NONFINITE_ENV))
    if ids:
        _warn_once(INJECT_NONFINITE_ENV, ",".join(map(str, sorted(ids))))
    return ids


class ForwardFaults:
    """The forward hooks of one producer incarnation (``SPECRING_SLOW_FORWARD_S``, ``SPECRING_STALL_FORWARD``),
    read once at start-up; ``before_forward()`` applies them. Raises ``ConfigError`` for bad values."""

    def __init__(self, index: int, generation: int):
        self.slow_s = seconds(SLOW_FORWARD_ENV)
        self.stall = stall_target() == (index, generation)
        if self.slow_s:
            log.warning("fault slow_forward_s=%g", self.slow_s)
        if self.stall:
            log.warning("fault stall_forward index=%d generation=%d", index, generation)

    def before_forward(self) -> None:
        """Sleep ``slow_s``; under a stall, never return (the GIL is released, as in a real deadlock)."""
        if self.slow_s:
            time.sleep(self.slow_s)
        if self.stall:
            log.warning("fault stalling forever")
            threading.Event().wait()
