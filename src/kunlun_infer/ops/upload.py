"""Step data made on the host, sent to the device without waiting for the device's queue.

A step's inputs (token ids, positions, attention metadata, the sampler's
per-row parameters) are made on the host and copied to the device. A
blocking copy first waits until every kernel queued before it has run (on a
GPU, a stream synchronisation): the host would stall while the step before
still runs on the device (``scheduler.overlap_steps``). A non-blocking copy
from ordinary (pageable) host memory is staged by the driver before the
call returns, so its source may be dropped at once, and it lands in queue
order, before any kernel queued after it reads it. On the host CPU both are
the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def upload(data: torch.Tensor | Sequence[Any], device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``data`` (a host tensor, or values for one) on ``device``, queued behind the kernels before it."""
    host = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    return host.to(device, non_blocking=True)
