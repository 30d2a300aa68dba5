"""Device groups as the command line spells them: one producer's devices joined by ``+`` (``cuda:0+cuda:1``).

Pure string work, without torch, so the command line (``cli/flags.py``) reads a group at ``--help`` time;
``shared.machine.devices.resolve_device_group`` checks the members against the machine.
"""

from __future__ import annotations

from specring.shared.errors import ConfigError

GROUP_SEP = "+"   # joins the devices of one producer's group: cuda:0+cuda:1


def group_members(spec: str) -> list[str]:
    """The device strings of a device group ``"cuda:0+cuda:1"`` (``["cuda:0", "cuda:1"]``); a single device is a
    group of one. Nothing is checked against the machine; raises ``ConfigError`` naming the group when a member
    is empty (``"cuda:0+"``)."""
    parts = [p.strip() for p in str(spec).split(GROUP_SEP)]
    if any(not p for p in parts):
        raise ConfigError(f"device group {str(spec)!r} has an empty member: join devices with {GROUP_SEP!r}, "
                          f"e.g. cuda:0{GROUP_SEP}cuda:1")
    return parts


def is_cpu_group(spec: str) -> bool:
    """Whether every member of the group ``spec`` is ``cpu`` (``"cpu"``, ``"cpu+cpu"``); False for a malformed
    group, which ``resolve_device_group`` reports with the flag's name."""
    try:
        return all(m == "cpu" for m in group_members(spec))
    except ConfigError:
        return False
