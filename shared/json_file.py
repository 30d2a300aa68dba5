"""Reading a JSON file with an error that names it (checkpoint and export configs, ``shared.drafters``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specring.shared.errors import CorruptFile


def read_json(path: str | Path) -> Any:
    """The JSON value of the file ``path``. Raises ``FileNotFoundError`` when it does not exist and
    ``shared.errors.CorruptFile`` naming it when it is not UTF-8 JSON (empty, truncated, garbage)."""
    path = Path(path)
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CorruptFile(f"{path} is not readable JSON ({type(e).__name__}: {e})", path=str(path)) from None
