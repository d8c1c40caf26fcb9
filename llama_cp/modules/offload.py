"""Checkpointed-activation offload: the one tensor per decoder layer that activation
checkpointing keeps (the layer's input, 2 x hidden bytes per token in bf16) lives in host
memory between the forward and the layer's recompute.

Note [Offloading checkpoint inputs]
===================================

Non-reentrant ``torch.utils.checkpoint`` stores the checkpointed function's positional
tensor arguments as saved tensors *before* it installs its own saved-tensor hooks for the
inside of the region, so saved-tensor hooks installed around the ``checkpoint`` call see
exactly those inputs and nothing else (the layer's inner activations go to checkpoint's
own hooks, and transformers passes only ``hidden_states`` positionally):

    forward, layer i                          backward, layer i (recompute)
    ----------------                          -----------------------------
    x_i on device --pack--> host copy         unpack: x_i back on device (prefetched
                  (side stream, device        while layer i+1 ran its backward), and
                   copy freed when done)      start bringing x_{i-1} back (side stream)

So at most two layers' inputs are on the device during backward, instead of all of them.
:class:`CheckpointOffloader` holds the pack / unpack hooks; ``apply_checkpoint_offload``
(``llama_cp.fsdp_wrap``) wraps each decoder layer's checkpoint call with them.

Where the host copy lives:

- CUDA: pinned host memory, copied on a side stream (device -> host in forward,
  host -> device in backward, both overlapping compute); events order the streams.
- real CPU tensors (the tests): a NumPy buffer, which torch's memory trackers do not
  count, so a CPU run's tracked memory is what a GPU run would hold on the device; the
  copy back is a real tensor copy. The values go through unchanged: gradients are
  bit-identical with and without offload.
- fake tensors (the planner): only the shape and dtype are kept; the copy back is an
  empty tensor of that shape, allocated where the real copy would be.

``host_bytes`` / ``peak_host_bytes`` count the host copies alive: the host memory a rank
needs for them (reported apart from device memory by the planner).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch


def _is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(tensor)


class _Offloaded:
    """One packed checkpoint input: its host copy (or, for fake tensors, only its metadata)."""

    __slots__ = ("shape", "dtype", "device", "nbytes", "host", "copied", "prefetched", "ready", "index",
                 "__weakref__")

    def __init__(self, tensor: torch.Tensor, index: int):
        self.shape, self.dtype, self.device = tensor.shape, tensor.dtype, tensor.device
        self.nbytes = tensor.numel() * tensor.element_size()
        self.host = None  # pinned tensor (CUDA), NumPy bytes (CPU), None (fake)
        self.copied = None  # CUDA event: device -> host copy done
        self.prefetched = None  # device tensor brought back ahead of its unpack
        self.ready = None  # CUDA event: host -> device copy done
        self.index = index


class CheckpointOffloader:
    """Saved-tensor pack / unpack hooks that keep checkpoint inputs in host memory
    (Note [Offloading checkpoint inputs]). One per model; safe across steps and
    micro-batches (the packed handles belong to the autograd graph)."""

    def __init__(self) -> None:
        self._stream = None
        self._packed: list[weakref.ref] = []  # pack order; dead entries are dropped
        self._counter = 0
        self.peak_host_bytes = 0

    @property
    def host_bytes(self) -> int:
        """Bytes of the host copies alive now (packed, not yet unpacked, graph not freed)."""
        return sum(handle.nbytes for ref in self._packed if (handle := ref()) is not None)

    def reset_peak(self) -> None:
        self.peak_host_bytes = self.host_bytes

    # ------------------------------------------------------------------ hooks
    def pack(self, tensor: torch.Tensor) -> _Offloaded:
        handle = _Offloaded(tensor, self._counter)
        self._counter += 1
        if tensor.device.type == "cuda":
            stream = self._side_stream(tensor.device)
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor is computed
            with torch.cuda.stream(stream):
                host.copy_(tensor, non_blocking=True)
                handle.copied = stream.record_event()
            tensor.record_stream(stream)  # its memory is not reused before the copy is done
            handle.host = host
        elif not _is_fake(tensor):
            # bytes outside torch (trackers do not count them as device memory), values unchanged
            handle.host = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().copy()
        self._packed = [ref for ref in self._packed if ref() is not None] + [weakref.ref(handle)]
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        return handle

    def unpack(self, handle: _Offloaded) -> torch.Tensor:
        tensor = handle.prefetched if handle.prefetched is not None else self._bring_back(handle)
        if handle.ready is not None:  # the host -> device copy ran on the side stream
            current = torch.cuda.current_stream(tensor.device)
            current.wait_event(handle.ready)
            tensor.record_stream(current)
        handle.prefetched = handle.ready = None
        self._release(handle)
        # the layer recomputed next in backward is the one packed just before this one
        earlier = self._previous(handle)
        if earlier is not None and earlier.prefetched is None and earlier.nbytes:
            earlier.prefetched = self._bring_back(earlier)
        return tensor

    # ------------------------------------------------------------------ helpers
    def _side_stream(self, device: torch.device):
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _bring_back(self, handle: _Offloaded) -> torch.Tensor:
        if handle.device.type == "cuda":
            stream = self._side_stream(handle.device)
            with torch.cuda.stream(stream):
                stream.wait_event(handle.copied)
                tensor = handle.host.to(handle.device, non_blocking=True)
                handle.ready = stream.record_event()
            return tensor
        if handle.host is None or handle.host.size == 0:  # fake (the allocation of the copy), or empty:
            # no values (NumPy gives an empty array stride 0, which torch cannot view as another dtype)
            return torch.empty(handle.shape, dtype=handle.dtype, device=handle.device)
        return torch.from_numpy(handle.host).view(handle.dtype).view(handle.shape).clone()

    @staticmethod
    def _release(handle: _Offloaded) -> None:
        handle.nbytes, handle.host = 0, None

    def _previous(self, handle: _Offloaded) -> _Offloaded | None:
        best = None
        for ref in self._packed:
            other = ref()
            if other is not None and other.index < handle.index and (best is None or other.index > best.index):
                best = other
        return best
