"""specring: train speculative-decoding drafters from a target LLM's hidden states.

The one installed namespace. Its rooms stand at the top of the checkout and install under it:
``specring.shared`` (what every process uses: config, transport, models, data), ``specring.producers`` and
``specring.consumer`` (the two process kinds), ``specring.supervisor`` (the supervisor process),
``specring.cli`` (the command line and the offline commands) and ``specring.assets`` (the fixture target).
In a checkout this package's path also covers the folder above it, where the rooms are; an installed wheel
holds them inside it.
"""

from pathlib import Path as _Path

__version__ = "0.2.0"

_here = _Path(__file__).resolve().parent
if not (_here / "shared").is_dir():  # a checkout: the rooms stand beside this folder
    __path__.append(str(_here.parent))  # type: ignore[name-defined]  # noqa: F821
