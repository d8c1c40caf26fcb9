"""Tensor-level memory tracking (deterministic on CPU, unlike RSS)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

CATEGORIES = ("Parameter", "Buffer", "Gradient", "Activation", "Temp", "Optstate", "Other")


@contextlib.contextmanager
def track_peak_memory(
    *tracked: nn.Module | torch.optim.Optimizer, device_type: str = "cpu"
) -> Iterator[dict[str, int]]:
    """Track every tensor allocated inside the block; afterwards the yielded dict holds the
    bytes per category (``CATEGORIES``) on ``device_type`` at the block's peak, and their
    ``"Total"``.

    Pass the model (and optimizer) so their parameters, gradients and states are
    attributed to the right category even when allocated before the block.
    """
    peak: dict[str, int] = {}
    tracker = MemTracker()
    if tracked:
        tracker.track_external(*tracked)
    with tracker:
        yield peak
    snapshot = tracker.get_tracker_snapshot("peak")
    peak.update({category: 0 for category in (*CATEGORIES, "Total")})
    for device, device_stats in snapshot.items():
        if device.type == device_type:
            for key, nbytes in device_stats.items():
                peak[key if isinstance(key, str) else key.value] = nbytes
