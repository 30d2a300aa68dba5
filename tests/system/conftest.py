"""Fixtures of the system tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import make_dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """A small tokenized dataset (``tests.support.make_dataset``), one per test module."""
    return make_dataset(tmp_path_factory.mktemp("data") / "small.arrow")
