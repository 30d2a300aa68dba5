"""The machine a process runs on: device and dtype names (``devices``), a producer's device group as the command
line spells it (``device_groups``) and how many host threads each process takes (``threads``)."""
