"""Probes shared by the tests: tensor sizes, small filesystems."""

import contextlib
import functools
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


class RecordedOps(TorchDispatchMode):
    """The arguments of every aten op call, by the names of the op's schema: ``calls`` holds
    (op name, {argument: value}) in call order."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        names = [a.name for a in func._schema.arguments]
        self.calls.append((func.overloadpacket.__name__, {**dict(zip(names, args)), **(kwargs or {})}))
        return func(*args, **(kwargs or {}))


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


@functools.cache
def bnb_cpu_optimizer_problem() -> str | None:
    """Why bitsandbytes' AdamW8bit cannot step a CPU tensor here (not installed, or a release
    whose CPU library does not load: 0.45.1 needs a newer libstdc++ than this machine's), or None."""
    try:
        import bitsandbytes as bnb

        param = torch.nn.Parameter(torch.ones(8))
        param.grad = torch.ones(8)
        bnb.optim.AdamW8bit([param], lr=0.1).step()
    except Exception as error:  # noqa: BLE001 - any failure means: no CPU optimizer here
        return f"bitsandbytes' optimizer does not run on CPU here ({type(error).__name__}: {error})"
    return None
