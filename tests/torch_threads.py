"""``one_thread``: the autouse fixture that runs each test on one torch thread.

Tiny matrices gain nothing from threads, and lose a lot when the cores are
busy elsewhere. A test package opts in by importing the fixture into its
``conftest.py`` (``from tests.torch_threads import one_thread``), which makes
it autouse for that package only.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread for the test; the previous count restored after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
