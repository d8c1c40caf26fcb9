"""Single-process checks of the local attention kernels and the LSE merge."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from llama_cp import kernels


def _inputs(heads, kv_heads, sq, sk, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, sq, 16, generator=g).to(dtype)
    k = torch.randn(2, kv_heads, sk, 16, generator=g).to(dtype)
    v = torch.randn(2, kv_heads, sk, 16, generator=g).to(dtype)
    return q, k, v


def _reference(q, k, v, causal):
    """Autograd through torch's SDPA math in float64: out, dq, dk, dv for a fixed dout."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=causal
    )
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out.backward(dout)
    return out.detach(), dout, q.grad, k.grad, v.grad


CASES = list(itertools.product(["sdpa_cpu", "math"], [True, False], [(4, 4), (4, 2), (4, 1)]))


@pytest.mark.parametrize("backend,causal,heads", CASES)
def test_forward_backward_match_sdpa(backend, causal, heads):
    sq = 24
    sk = sq if causal else 40
    q, k, v = _inputs(*heads, sq, sk, torch.float32)
    ref_out, dout, ref_dq, ref_dk, ref_dv = _reference(q, k, v, causal)
    out, lse = kernels.attention_forward(q, k, v, causal=causal, backend=backend)
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    dq, dk, dv = kernels.attention_backward(dout.float(), q, k, v, out, lse, causal=causal, backend=backend)
    assert dk.shape == k.shape and dv.shape == v.shape
    for got, want in ((dq, ref_dq), (dk, ref_dk), (dv, ref_dv)):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa_cpu", "math"])
def test_bf16_close_to_fp64(backend):
    q, k, v = _inputs(4, 2, 32, 32, torch.bfloat16)
    ref_out, dout, ref_dq, *_ = _reference(q, k, v, True)
    out, lse = kernels.attention_forward(q, k, v, causal=True, backend=backend)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref_out, atol=2e-2, rtol=2e-2)
    dq, _, _ = kernels.attention_backward(dout.bfloat16(), q, k, v, out, lse, causal=True, backend=backend)
    assert dq.dtype == torch.bfloat16
    torch.testing.assert_close(dq.double(), ref_dq, atol=5e-2, rtol=5e-2)


def test_lse_is_logsumexp_of_scaled_scores():
    q, k, v = _inputs(2, 2, 8, 8, torch.float64)
    _, lse = kernels.attention_forward(q, k, v, causal=False, backend="sdpa_cpu")
    want = torch.logsumexp(q @ k.transpose(-1, -2) / 4.0, dim=-1)  # head_dim 16 -> scale 1/4
    torch.testing.assert_close(lse.double(), want, atol=1e-5, rtol=1e-5)


def test_merge_of_two_key_blocks_equals_full_attention():
    q, k, v = _inputs(4, 2, 16, 48, torch.float32)
    full_out, full_lse = kernels.attention_forward(q, k, v, causal=False)
    out, lse = kernels.attention_forward(q, k[:, :, :20], v[:, :, :20], causal=False)
    out = out.float()
    block_out, block_lse = kernels.attention_forward(q, k[:, :, 20:], v[:, :, 20:], causal=False)
    kernels.merge_block(out, lse, block_out, block_lse)
    torch.testing.assert_close(out, full_out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, full_lse, atol=1e-6, rtol=1e-5)


def test_backward_with_merged_statistics_gives_block_gradients():
    """dq of full attention = sum of per-block dq computed with the merged (out, lse)."""
    q, k, v = _inputs(4, 4, 16, 32, torch.float64)
    _, dout, ref_dq, ref_dk, ref_dv = _reference(q, k, v, False)
    out, lse = kernels.attention_forward(q, k, v, causal=False)
    dq = torch.zeros_like(q)
    dks, dvs = [], []
    for part in (slice(0, 12), slice(12, 32)):
        g = kernels.attention_backward(dout, q, k[:, :, part], v[:, :, part], out, lse, causal=False)
        dq += g[0]
        dks.append(g[1])
        dvs.append(g[2])
    torch.testing.assert_close(dq, ref_dq)
    torch.testing.assert_close(torch.cat(dks, 2), ref_dk)
    torch.testing.assert_close(torch.cat(dvs, 2), ref_dv)


def test_bad_shapes_raise():
    q, k, v = _inputs(3, 2, 8, 8, torch.float32)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        kernels.attention_forward(q, k, v, causal=True)
    q, k, v = _inputs(4, 2, 8, 12, torch.float32)
    with pytest.raises(ValueError, match="square"):
        kernels.attention_forward(q, k, v, causal=True)
    with pytest.raises(ValueError, match="unknown attention backend"):
        kernels.attention_forward(q, k, v, causal=False, backend="nope")


def test_cpu_selects_the_sdpa_cpu_op():
    assert kernels.select_backend(torch.zeros(1, 1, 2, 2)) == "sdpa_cpu"


H100, T4 = (9, 0), (7, 5)


@pytest.mark.parametrize("backend, device, dtype, head_dim, capability, problem", [
    ("sdpa_flash", "cuda", torch.bfloat16, 128, H100, None),
    ("sdpa_efficient", "cuda", torch.float32, 128, T4, None),
    ("sdpa_efficient", "cuda", torch.bfloat16, 128, T4, "sdpa_efficient takes bfloat16 only on sm80+ GPUs"),
    ("sdpa_flash", "cuda", torch.float16, 128, T4, "sdpa_flash needs an sm80+ (Ampere or newer) GPU"),
    ("flash_attn", "cuda", torch.float32, 128, H100, "flash_attn takes float16/bfloat16 only, not torch.float32"),
    ("sdpa_flash", "cuda", torch.bfloat16, 100, H100, "sdpa_flash takes head sizes 8, 16, ..., 256, not 100"),
    ("sdpa_efficient", "cuda", torch.float64, 128, H100, "takes float16/bfloat16/float32, not torch.float64"),
    ("flash_attn", "cpu", torch.bfloat16, 128, None, "flash_attn needs CUDA tensors, not cpu"),
    ("sdpa_cpu", "cuda", torch.bfloat16, 128, H100, "sdpa_cpu runs on CPU tensors, not cuda"),
    ("math", "cuda", torch.float64, 100, T4, None),
])
def test_backend_problem_names_the_cause(backend, device, dtype, head_dim, capability, problem):
    got = kernels.backend_problem(backend, device, dtype, head_dim, capability=capability)
    assert got == problem if problem is None else problem in got


def test_flash_attn_without_the_package_is_refused(monkeypatch):
    monkeypatch.setattr(kernels, "_flash_attn_interface", lambda: None)
    assert kernels.backend_problem("flash_attn", "cuda", torch.bfloat16, 128, capability=H100) == (
        "flash-attn is not installed (pip install flash-attn --no-build-isolation)"
    )


def test_an_explicit_backend_that_cannot_run_is_refused_in_one_line():
    q, k, v = _inputs(4, 2, 8, 8, torch.float32)
    with pytest.raises(ValueError) as error:
        kernels.attention_forward(q, k, v, causal=True, backend="flash_attn")
    assert str(error.value) == (
        "attention backend 'flash_attn' cannot run here: flash_attn needs CUDA tensors, not cpu; "
        "backends that would run (cpu, float32, head size 16): sdpa_cpu, math"
    )
    out, lse = kernels.attention_forward(q, k, v, causal=True)
    with pytest.raises(ValueError, match="^attention backend 'sdpa_flash' cannot run here"):
        kernels.attention_backward(torch.ones_like(out), q, k, v, out, lse, causal=True, backend="sdpa_flash")


def _cuda_backends():
    if not torch.cuda.is_available():
        return [pytest.param(None, marks=pytest.mark.skip(reason="needs CUDA"))]
    backends = ["sdpa_flash", "sdpa_efficient"]
    if kernels._flash_attn_interface() is not None:
        backends.append("flash_attn")
    return backends


@pytest.mark.parametrize("backend", _cuda_backends())
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_backends_match_math(backend, causal):
    q, k, v = (t.cuda() for t in _inputs(4, 2, 128, 128, torch.bfloat16))
    dout = torch.randn_like(q)
    out, lse = kernels.attention_forward(q, k, v, causal=causal, backend=backend)
    ref_out, ref_lse = kernels.attention_forward(q, k, v, causal=causal, backend="math")
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-2, rtol=1e-2)
    grads = kernels.attention_backward(dout, q, k, v, out, lse, causal=causal, backend=backend)
    ref_grads = kernels.attention_backward(dout, q, k, v, ref_out, ref_lse, causal=causal, backend="math")
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2)
