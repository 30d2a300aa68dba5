"""consumer.step_profile: the phase log line, SPECRING_PROFILE_STEPS's parsing and the profiler window's files."""

from __future__ import annotations

import pytest
import torch

from specring.consumer.step_profile import PHASES, ProfileWindow, StepPhases, parse_profile_steps
from specring.shared import envs
from specring.shared.errors import ConfigError


def test_phase_means_per_window():
    p = StepPhases(every=2)
    p.sums = dict.fromkeys(PHASES, 0.0)
    p.sums["train"] = 0.5
    p.sums["copy"] = 0.1
    assert p.optimizer_step(7) is None
    line = p.optimizer_step(8)
    assert line.startswith("step_phases steps=7-8 ms_per_step=300.0 ")
    assert "train=250.0" in line and "copy=50.0" in line and "wait=0.0" in line
    assert p.sums["train"] == 0.0 and p.steps == 0  # a new window
    with p.phase("after"):
        pass
    assert p.sums["after"] > 0.0


@pytest.mark.parametrize("text", ["x", "5", "1:3", "4:0", "4:1001", "a:b", "4:3:2"])
def test_bad_profile_steps_name_the_variable(text):
    with pytest.raises(ConfigError, match=envs.PROFILE_STEPS):
        parse_profile_steps(text)


def test_profile_steps_parsed():
    assert parse_profile_steps(None) is None and parse_profile_steps(" ") is None
    assert parse_profile_steps("400:20") == (400, 20)


def test_window_writes_tables_and_trace(tmp_path, monkeypatch):
    monkeypatch.setenv(envs.PROFILE_STEPS, "3:2")
    w = ProfileWindow(tmp_path, 0, torch.device("cpu"))
    x = torch.randn(64, 64)
    for step in range(1, 7):
        x = torch.tanh(x @ x)  # the "step" the window times
        w.after_step(step)
    text = (tmp_path / "profile" / "consumer-0.txt").read_text()
    assert text.startswith("consumer-0: 2 optimizer steps, wall ")
    assert "aten::mm" in text  # only steps 3 and 4 ran inside the window: their operators are listed
    assert (tmp_path / "profile" / "consumer-0.trace.json").stat().st_size > 0
    assert w.window is None  # closed: later steps do nothing


def test_window_off_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(envs.PROFILE_STEPS, raising=False)
    w = ProfileWindow(tmp_path, 0, torch.device("cpu"))
    for step in range(1, 5):
        w.after_step(step)
    assert not (tmp_path / "profile").exists()
