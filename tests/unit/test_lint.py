"""``ruff check`` (the rules pyproject.toml's ``[tool.ruff.lint]`` keeps: pycodestyle errors and warnings with the
120-column limit, pyflakes, import order) is clean on the whole checkout. ruff comes with the ``[test]`` extra."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _ruff() -> list[str]:
    beside = Path(sys.executable).with_name("ruff")  # the venv's, installed by the [test] extra
    found = str(beside) if beside.is_file() else shutil.which("ruff")
    assert found, "ruff is not installed: it is in the [test] extra (pip install -e '.[test]')"
    return [found]


def test_ruff_is_clean():
    out = subprocess.run(_ruff() + ["check", "--no-cache", "--output-format", "concise", str(ROOT)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, f"ruff check found problems:\n{out.stdout[-6000:]}{out.stderr[-2000:]}"
