"""Shared test configuration."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _single_threaded_torch():
    """Most tests run many tiny tensor ops, where intra-op thread wake-ups cost more than the
    work on a busy 2-core machine; one thread keeps the suite fast and its timing stable."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
