"""Fixtures every test folder may use (the system tests add theirs in tests/system/conftest.py)."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for the module: decoding is many tiny forwards, faster on one thread and immune to a
    busy machine. Modules take it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
