"""Fault injection for tests and chaos drills: the ``SPECRING_*`` environment hooks of the child processes.

None of them is set in a normal run; each one that is set logs a ``fault ...`` warning in the child that
reads it, so a hook left on is visible in the logs. Hooks read here:

``SPECRING_FAULT_HELPERS=1``
    The producer starts two helper processes (``sleep 600``) at start-up, as target code may: one in its
    own process group, one in a session of its own (``setsid``, out of reach of a group kill). Neither may
    outlive the producer's restart or the run.

Hooks read where they act: ``SPECRING_SLOW_WRITE_S`` (``producers.main``), ``SPECRING_INJECT_NONFINITE``
(``producers.producer``), ``SPECRING_SLOW_CHECKPOINT_S`` (``consumer.checkpoint``), ``SPECRING_SLOW_EVAL_S``
(``consumer.evaluate``).
"""

from __future__ import annotations

import logging
import os
import subprocess

from shared.errors import ConfigError

log = logging.getLogger(__name__)

HELPERS_ENV = "SPECRING_FAULT_HELPERS"


def flag(name: str) -> bool:
    """``$name`` as a switch: unset, empty or ``0`` is off, ``1`` is on; ``ConfigError`` naming it otherwise."""
    text = os.environ.get(name, "").strip()
    if text not in ("", "0", "1"):
        raise ConfigError(f"{name}={text!r} must be 0 or 1")
    return text == "1"


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
