"""Which tensors make a planned step's peak: each tensor the step creates, grouped by the op
that made it, its dtype and its shape (the local token count written ``T``), as alive at the
moment the created tensors' bytes are largest. ``python -m recipes.plan_memory --breakdown``.

The planner's categories (``MemoryBreakdown``) say how much is temporary; this says which
temporaries, and how many bytes each costs per token, which is what a lever has to cut.
Tensors that exist before the step (parameters, optimizer state) are not created in it and
are left out: they are the plan's parameters and optimizer rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import weakref
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from llama_cp.config import TrainConfig
from llama_cp.plan.memory import GiB
from llama_cp.plan.simulate import load_model_config, simulate_step_phases


@dataclasses.dataclass(frozen=True)
class PeakGroup:
    """Tensors of one kind alive at the peak: ``count`` of them, ``nbytes`` in all."""

    label: str
    count: int
    nbytes: int
    per_token: bool
    """The shape has the local token count in it: the bytes grow with the context."""


#: Code whose frames name where a tensor was made (the innermost such frame on the stack).
_SOURCES = ("/llama_cp/", "/transformers/models/", "/peft/tuners/", "/torch/distributed/fsdp/", "/torch/utils/checkpoint")


def _caller() -> str:
    """``file:function`` of the innermost model, attention, peft or FSDP frame on the stack
    (the planner's own frames left out)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        if any(source in path for source in _SOURCES) and "/llama_cp/plan/" not in path:
            return f"{os.path.basename(path)}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


class _PeakTensors(TorchDispatchMode):
    """Counts the storages that ops create, frees them when their storage is collected, and keeps
    the groups alive when the count was highest."""

    def __init__(self, tokens: int):
        super().__init__()
        self.tokens = tokens
        self.live: dict[int, tuple[str, int, bool]] = {}
        self.total = self.peak = 0
        self.at_peak: dict[str, list[int]] = {}
        self._refs: list[weakref.ref] = []

    def _label(self, tensor: torch.Tensor, func) -> tuple[str, bool]:
        dims = ["T" if size == self.tokens else str(size) for size in tensor.shape]
        phase = " in backward" if torch._C._current_graph_task_id() != -1 else ""
        dtype = str(tensor.dtype).removeprefix("torch.")
        return f"{dtype} ({', '.join(dims)}) from {func.overloadpacket.__name__} at {_caller()}{phase}", "T" in dims

    def _free(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.total -= entry[1]

    def resized(self, storage, old_bytes: int) -> None:
        """FSDP frees and re-allocates the gathered parameters by resizing their storages
        (``resize_``, not an op this mode sees): follow the size of the storages it counts."""
        entry = self.live.get(id(storage))
        if entry is not None:
            self.live[id(storage)] = (entry[0], storage.nbytes(), entry[2])
            self.total += storage.nbytes() - old_bytes
            self._note_peak()

    def _note_peak(self) -> None:
        if self.total > self.peak:
            self.peak = self.total
            groups: dict[str, list] = {}
            for name, nbytes, grows in self.live.values():
                entry = groups.setdefault(name, [0, 0, grows])
                entry[0] += 1 if nbytes else 0
                entry[1] += nbytes
            self.at_peak = groups

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
                continue
            storage = tensor.untyped_storage()
            key = id(storage)
            if key in self.live:  # a view or an in-place result: no new bytes
                continue
            label, per_token = self._label(tensor, func)
            self.live[key] = (label, storage.nbytes(), per_token)
            self.total += storage.nbytes()
            self._refs.append(weakref.ref(storage, lambda _, key=key: self._free(key)))
            self._note_peak()
        return out


@contextlib.contextmanager
def peak_tensors(tokens: int) -> Iterator[list[PeakGroup]]:
    """Watch the ops inside the block; afterwards the yielded list holds the groups alive at the
    peak of the bytes created inside it, largest first. ``tokens``: the local token count, the
    size that marks a tensor's bytes as per token."""
    groups: list[PeakGroup] = []
    mode = _PeakTensors(tokens)
    resize = torch.UntypedStorage.resize_

    def resize_and_count(storage, size):
        old_bytes = storage.nbytes()
        result = resize(storage, size)
        mode.resized(storage, old_bytes)
        return result

    torch.UntypedStorage.resize_ = resize_and_count
    try:
        with mode:
            yield groups
    finally:
        torch.UntypedStorage.resize_ = resize
    groups.extend(sorted((PeakGroup(label, count, nbytes, bool(grows))
                          for label, (count, nbytes, grows) in mode.at_peak.items() if nbytes),
                         key=lambda group: -group.nbytes))


def step_peak_tensors(cfg: TrainConfig, world_size: int, *, model_config=None) -> list[PeakGroup]:
    """The groups of tensors alive at the peak of one simulated step of ``cfg`` (the whole model,
    not the planner's few layers: a minute for a 32-layer model)."""
    config = model_config if model_config is not None else load_model_config(cfg.model.model_name)
    groups: list[PeakGroup] = []
    local = cfg.data.context_length // cfg.parallel.cp
    simulate_step_phases(cfg, world_size, model_config=config, observer=lambda: _collect(local, groups))
    return groups


@contextlib.contextmanager
def _collect(tokens: int, into: list[PeakGroup]) -> Iterator[None]:
    with peak_tensors(tokens) as groups:
        yield
    into.extend(groups)


def describe_groups(groups: list[PeakGroup], tokens: int, top: int = 12) -> str:
    """The ``top`` largest groups as lines: GiB, bytes per token where the size grows with the
    context, count and label; then what the rest adds up to."""
    lines = []
    for group in groups[:top]:
        per_token = f"{group.nbytes / tokens:>9,.0f} B/token" if group.per_token else f"{'':>9} (fixed)"
        lines.append(f"  {group.nbytes / GiB:>8.2f} GiB {per_token}  {group.count:>3} x {group.label}")
    rest = sum(group.nbytes for group in groups[top:])
    total = sum(group.nbytes for group in groups)
    lines.append(f"  {rest / GiB:>8.2f} GiB in {max(len(groups) - top, 0)} smaller groups; "
                 f"{total / GiB:.2f} GiB created in the step at its peak")
    return "\n".join(lines)
