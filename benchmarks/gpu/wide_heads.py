"""The GPU report's check of attention heads over 256 (Gemma 4's full layers, heads of 512): the kernel
"auto" takes for them (Note [Head sizes above 256] in llama_cp/attention/kernels.py: sdpa_efficient on
CUDA) against the float32 math kernel, by the 2x-bf16 rule the exactness checks use; and the bytes one
such call allocates beyond its inputs against the planner's stand-in of it (Note [GPU attention
kernels' workspace] in llama_cp/attention/workspace.py: its global-memory kernels' float32 output
accumulator and dK/dV staging, modelled from pytorch's source, not yet measured)."""

from __future__ import annotations

from typing import Any

import torch

HEAD_DIM = 512


def wide_heads(device: torch.device, length: int) -> dict[str, Any]:
    """One causal block of 4 query and 2 key/value heads of 512 over ``length`` tokens, forward and
    backward: the relative error of out, dq, dk and dv of "auto" on bfloat16 inputs, and of math on the
    same bfloat16 inputs (the yardstick: what rounding to bfloat16 alone costs), each against math in
    float32. Passes when auto's errors are at most twice the yardstick's."""
    from llama_cp.attention.kernels import select_backend

    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(1, heads, length, HEAD_DIM, generator=g, device=device)
                     for heads in (4, 2, 2, 4))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the CPU's dry run: sdpa_cpu in float32

    def run(backend, *tensors):
        out, _, *grads = _call(*tensors, backend)
        return [t.float() for t in (out, *grads)]

    want = run("math", q, k, v, dout)
    low = [t.to(dtype) for t in (q, k, v, dout)]
    errors = {}
    for name, backend in (("auto", None), ("yardstick", "math")):
        got = run(backend, *low)
        errors[name] = [float((a - b).norm() / b.norm()) for a, b in zip(got, want, strict=True)]
    passed = all(a <= 2 * y + 1e-6 for a, y in zip(errors["auto"], errors["yardstick"], strict=True))
    return {"backend": select_backend(low[0]), "head_dim": HEAD_DIM, "length": length,
            "rel_errors_out_dq_dk_dv": errors["auto"], "yardstick": errors["yardstick"], "pass": passed,
            **wide_heads_memory(device, length)}


#: Gemma-4-31B-like full layer: query and key/value heads of one forward and backward call.
MEMORY_HEADS = (32, 4)


def _call(q, k, v, dout, backend) -> list[torch.Tensor]:
    from llama_cp.attention.kernels import attention_backward, attention_forward

    out, lse = attention_forward(q, k, v, causal=True, backend=backend)
    return [out, lse, *attention_backward(dout, q, k, v, out, lse, causal=True, backend=backend)]


def wide_heads_memory(device: torch.device, length: int) -> dict[str, Any]:
    """The peak bytes beyond its bfloat16 inputs of one causal forward and backward of heads of 512
    (``MEMORY_HEADS``) under "auto": measured on CUDA (None elsewhere), and as the planner sees it (its
    stand-ins under fake tensors, the backend it plans "auto" with)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from llama_cp.attention.workspace import ModelledBackend
    from llama_cp.plan.memory import track_peak_memory

    heads, kv_heads = MEMORY_HEADS
    shapes = [(1, h, length, HEAD_DIM) for h in (heads, kv_heads, kv_heads, heads)]
    with FakeTensorMode():
        tensors = [torch.empty(shape, dtype=torch.bfloat16) for shape in shapes]
        with track_peak_memory() as peak:
            _call(*tensors, ModelledBackend("flash_attn", auto=True))
    planned, measured = peak["Total"], None
    if device.type == "cuda":
        tensors = [torch.randn(shape, device=device, dtype=torch.bfloat16) for shape in shapes]
        _call(*tensors, None)  # warm
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        results = _call(*tensors, None)
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - base
        del results
    return {"memory_heads": list(MEMORY_HEADS), "planned_extra_bytes": planned, "measured_extra_bytes": measured,
            "planned_over_measured": planned / measured if measured else None}
