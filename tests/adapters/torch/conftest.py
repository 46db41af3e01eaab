"""The PyTorch adapter's tests run torch with one intra-op thread.

Their models are tiny: extra threads only add overhead, and on a machine shared with other jobs
spinning OpenMP threads can make a step ten times slower.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
