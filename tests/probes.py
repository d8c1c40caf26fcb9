"""Probes shared by the tests: tensor sizes, small filesystems."""

import contextlib
import subprocess

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.numel, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.op = t.numel(), func
        return result


@contextlib.contextmanager
def tmpfs(path, options: str):
    """Mount a tmpfs with ``options`` (e.g. "size=60m", "ro,size=1m") on the existing directory
    ``path`` for the block; skips the test where it cannot be mounted (not root)."""
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"a tmpfs ({options}) could not be mounted (needs root): {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)
