"""Shared fixtures. Tests run on the CPU by default; tests marked ``gpu`` skip without CUDA."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seed():
    torch.manual_seed(0)
    return 0
