"""specring installs like a library: a wheel built from the checkout, installed into a fresh venv, runs the main
job from another directory, installs one top-level name, and writes its runs under the current directory.

The fresh venv gets specring from the wheel alone; its dependencies (torch, transformers, ...) are borrowed from
the test's own environment through a ``.pth`` path line, so the test needs no network and no second multi-GB
torch install. Path lines do not run the ``.pth`` hooks of the borrowed directory, so an editable install of
the checkout there stays inert: ``import specring`` must come from the wheel (asserted).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(cmd, cwd, timeout=300, env=None):
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    r = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(REPO)],
             cwd=out)
    if r.returncode:  # no setuptools in this environment: let pip fetch the build backend
        r = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out), str(REPO)], cwd=out)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = out.glob("specring-*.whl")
    return whl


@pytest.fixture(scope="module")
def venv(tmp_path_factory, wheel) -> Path:
    root = tmp_path_factory.mktemp("venv")
    r = _run([sys.executable, "-m", "venv", "--without-pip", str(root / "v")], cwd=root)
    assert r.returncode == 0, r.stderr
    py = root / "v" / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root)
                .stdout.strip())
    (site / "borrowed_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    r = _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", str(wheel)],
             cwd=root)
    if r.returncode:  # pip < 22.3 has no --python: install the wheel's files with the venv's own interpreter
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
        (root / "v" / "bin" / "specring").write_text(
            f"#!{py}\nimport sys\nfrom specring.cli.main import main\nsys.exit(main())\n")
        (root / "v" / "bin" / "specring").chmod(0o755)
    return root / "v"


def test_the_wheel_installs_one_top_level_name_and_the_fixture(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"specring"}, f"the wheel installs other top-level names: {sorted(tops)}"
    assert "specring/assets/tiny-code-lm/config.json" in names
    assert any(n.startswith("specring/shared/transport/ring.py") for n in names)


def test_installed_specring_plans_and_trains_from_another_directory(venv, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    where = _run([str(venv / "bin" / "python"), "-c", "import specring, specring.shared.paths as p; "
                  "print(specring.__file__); print(p.DEFAULT_TARGET)"], cwd=tmp_path, env=env)
    assert where.returncode == 0, where.stderr
    module_file, target = where.stdout.split()
    assert Path(module_file).is_relative_to(venv), f"specring imported from {module_file}, not the venv"
    assert Path(target, "config.json").is_file()
    plan = _run([str(venv / "bin" / "specring"), "train", "--plan"], cwd=tmp_path, env=env, timeout=600)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert "tiny-code-lm" in plan.stdout
    run = _run([str(venv / "bin" / "specring"), "train", "--max-steps", "5", "--eval-prompts", "0"], cwd=tmp_path,
               env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "latest" / "summary.json").read_text())
    assert summary["exit_reason"] == "done" and summary["trained_batches"] == 5
    assert (tmp_path / "data" / "demo" / "train.arrow").is_file()          # the demo corpus under cwd
    assert not list(Path(module_file).parent.rglob("runs")), "something was written inside the package"
