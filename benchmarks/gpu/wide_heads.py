"""The GPU report's check of attention heads over 256 (Gemma 4's full layers, heads of 512): the kernel
"auto" takes for them (Note [Head sizes above 256] in llama_cp/attention/kernels.py: sdpa_efficient on
CUDA) against the float32 math kernel, by the 2x-bf16 rule the exactness checks use."""

from __future__ import annotations

from typing import Any

import torch

HEAD_DIM = 512


def wide_heads(device: torch.device, length: int) -> dict[str, Any]:
    """One causal block of 4 query and 2 key/value heads of 512 over ``length`` tokens, forward and
    backward: the relative error of out, dq, dk and dv of "auto" on bfloat16 inputs, and of math on the
    same bfloat16 inputs (the yardstick: what rounding to bfloat16 alone costs), each against math in
    float32. Passes when auto's errors are at most twice the yardstick's."""
    from llama_cp.attention.kernels import attention_backward, attention_forward, select_backend

    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(1, heads, length, HEAD_DIM, generator=g, device=device)
                     for heads in (4, 2, 2, 4))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the CPU's dry run: sdpa_cpu in float32

    def run(backend, *tensors):
        out, lse = attention_forward(*tensors[:3], causal=True, backend=backend)
        grads = attention_backward(tensors[3], *tensors[:3], out, lse, causal=True, backend=backend)
        return [t.float() for t in (out, *grads)]

    want = run("math", q, k, v, dout)
    low = [t.to(dtype) for t in (q, k, v, dout)]
    errors = {}
    for name, backend in (("auto", None), ("yardstick", "math")):
        got = run(backend, *low)
        errors[name] = [float((a - b).norm() / b.norm()) for a, b in zip(got, want, strict=True)]
    passed = all(a <= 2 * y + 1e-6 for a, y in zip(errors["auto"], errors["yardstick"], strict=True))
    return {"backend": select_backend(low[0]), "head_dim": HEAD_DIM, "length": length,
            "rel_errors_out_dq_dk_dv": errors["auto"], "yardstick": errors["yardstick"], "pass": passed}
