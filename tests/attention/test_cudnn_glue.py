"""sdpa_cudnn's glue without a GPU (Note [cuDNN attention blocks] in llama_cp/attention/kernel_calls.py):
the real ops' meta kernels take our calls, an exact CPU stand-in with the ops' signatures gives
the math reference's results through our forward and backward (GQA, blocks merged by their
log-sum-exp, the backward from the merged statistics), "auto" picks it on sm90 GPUs only and
leaves packed documents to the varlen kernel, and the planner plans it as sdpa_flash."""

import types

import pytest
import torch

from llama_cp.attention import kernel_calls, kernels
from llama_cp.config import TrainConfig


def _inputs(heads, kv_heads, sq, sk, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, heads, sq, 16, generator=g, dtype=dtype),
            torch.randn(2, kv_heads, sk, 16, generator=g, dtype=dtype),
            torch.randn(2, kv_heads, sk, 16, generator=g, dtype=dtype))


def _stand_in(seen: list):
    """The two cuDNN ops as torch declares them, computed by the math reference; each call checks
    what the CUDA kernels need: KV heads expanded, lse as (B, H, Sq, 1) float32, out and dout of
    the same strides, no bias, no dropout."""

    def forward(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
                return_debug_mask=False, *, scale=None):
        assert attn_bias is None and compute_log_sumexp and dropout_p == 0.0 and not return_debug_mask
        assert key.shape[1] == query.shape[1], "KV heads expanded"
        out, lse = kernel_calls.math_forward(query, key, value, is_causal, scale)
        seen.append(("forward", is_causal))
        return (out, lse.float().unsqueeze(-1), None, None, query.shape[2], key.shape[2],
                torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64), None)

    def backward(grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q,
                 cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None):
        assert logsumexp.shape == (*query.shape[:3], 1) and logsumexp.dtype == torch.float32
        assert grad_out.stride() == out.stride() and attn_bias is None and dropout_p == 0.0
        assert (max_q, max_k) == (query.shape[2], key.shape[2]) and key.shape[1] == query.shape[1]
        seen.append(("backward", is_causal))
        return kernel_calls.math_backward(grad_out, query, key, value, out, logsumexp[..., 0], is_causal, scale)

    return types.SimpleNamespace(_scaled_dot_product_cudnn_attention=forward,
                                 _scaled_dot_product_cudnn_attention_backward=backward)


def test_the_real_ops_meta_kernels_take_our_calls():
    q, k, v = (t.to("meta", torch.bfloat16) for t in _inputs(8, 2, 64, 64))
    out, lse = kernel_calls.sdpa_cudnn_forward(q, k, v, True, 0.25)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    dq, dk, dv = kernel_calls.sdpa_cudnn_backward(out, q, k, v, out, lse, True, 0.25)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


@pytest.mark.parametrize("causal, heads", [(True, (4, 4)), (True, (4, 1)), (False, (4, 2))])
def test_forward_and_backward_equal_the_math_reference(causal, heads):
    seen = []
    ops = _stand_in(seen)
    q, k, v = _inputs(*heads, 24, 24 if causal else 40)
    out, lse = kernel_calls.sdpa_cudnn_forward(q, k, v, causal, 0.25, ops=ops)
    want_out, want_lse = kernel_calls.math_forward(q, k, v, causal, 0.25)
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse.float(), rtol=0, atol=0)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    got = kernel_calls.sdpa_cudnn_backward(dout, q, k, v, out, lse, causal, 0.25, ops=ops)
    want = kernel_calls.math_backward(dout, q, k, v, out, lse.double(), causal, 0.25)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)  # lse through float32, as the op returns it
    assert seen == [("forward", causal), ("backward", causal)]


def test_blocks_merge_and_take_the_merged_statistics(monkeypatch):
    """What the ring does with it: key blocks merged by their lse equal one call, and each block's
    backward from the merged (out, lse) sums to the whole gradient; through kernels' dispatch."""
    seen = []
    monkeypatch.setattr(kernels, "_sdpa_ops", lambda backend: _stand_in(seen))
    monkeypatch.setattr(kernels, "check_backend", lambda *args, **kwargs: None)  # no GPU here
    q, k, v = _inputs(4, 2, 16, 48)
    whole, whole_lse = kernels.attention_forward(q, k, v, causal=False, backend="sdpa_cudnn")
    out, lse = kernels.attention_forward(q, k[:, :, :20], v[:, :, :20], causal=False, backend="sdpa_cudnn")
    block_out, block_lse = kernels.attention_forward(q, k[:, :, 20:], v[:, :, 20:], causal=False, backend="sdpa_cudnn")
    kernels.merge_block(out, lse, block_out, block_lse)
    torch.testing.assert_close(out, whole, rtol=1e-6, atol=1e-6)  # the op's lse is float32
    torch.testing.assert_close(lse, whole_lse, rtol=1e-6, atol=1e-6)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
    want = kernels.attention_backward(dout, q, k, v, whole, whole_lse, causal=False, backend="math")
    parts = [kernels.attention_backward(dout, q, k[:, :, s], v[:, :, s], out, lse, causal=False, backend="sdpa_cudnn")
             for s in (slice(0, 20), slice(20, 48))]
    torch.testing.assert_close(parts[0][0] + parts[1][0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([parts[0][1], parts[1][1]], 2), want[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([parts[0][2], parts[1][2]], 2), want[2], rtol=1e-5, atol=1e-5)
    assert {kind for kind, _ in seen} == {"forward", "backward"}


def _gpu_without_flash_attn(monkeypatch, capability):
    """select_backend as on a GPU of ``capability`` without flash-attn, on CPU tensors."""
    monkeypatch.setattr(kernels, "_capability", lambda device: capability)
    monkeypatch.setattr(kernels, "backend_problem", lambda b, *args, **kwargs: "no" if b == "flash_attn" else None)


@pytest.mark.parametrize("capability, picked", [((9, 0), "sdpa_cudnn"), ((8, 0), "sdpa_flash"), ((10, 0), "sdpa_flash")])
def test_auto_picks_it_on_sm90_only(monkeypatch, capability, picked):
    """Checked exact and 1.3x faster at 64K on an H200 (sm90): auto takes it there; on other GPUs
    it has not run, so auto keeps sdpa_flash. The varlen choice (packed documents) stays sdpa_flash."""
    _gpu_without_flash_attn(monkeypatch, capability)
    q = torch.zeros(1, 1, 2, 16)
    assert kernels.select_backend(q) == picked
    assert kernels.select_backend(q, varlen=True) == "sdpa_flash"


def test_auto_keeps_sdpa_flash_on_rocm(monkeypatch):
    """torch reports an AMD MI250 as capability (9, 0), and ROCm's build has no cuDNN attention."""
    monkeypatch.setattr(torch.version, "hip", "6.2")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(kernels, "backend_problem", lambda b, *args, **kwargs: "no" if b == "flash_attn" else None)
    assert kernels._capability(torch.device("cuda", 0)) is None
    assert kernels.select_backend(torch.zeros(1, 1, 2, 16)) == "sdpa_flash"


def test_auto_on_sm90_sends_packed_documents_to_the_varlen_kernel(monkeypatch):
    """Under auto on an H100 without flash-attn, a row of one document runs cuDNN, and a block that
    the varlen kernel takes in fewer calls (packed documents; rows batched) takes the varlen kernel,
    as before cuDNN was picked (not one cuDNN call per document); both equal the per-piece CPU
    kernel (sdpa_cpu), forward and backward."""
    from document_checks import SEQ_LEN, packed_batch
    from llama_cp.attention.documents import DocumentLayout, tiles
    from llama_cp.attention.pieces import pieces_attention
    from llama_cp.attention.workspace import SDPA_OPS
    from llama_cp.parallel.sharding import document_starts

    _gpu_without_flash_attn(monkeypatch, (9, 0))
    seen = []
    ops = types.SimpleNamespace(**vars(SDPA_OPS), **vars(_stand_in(seen)))
    varlen_calls = []
    ops._flash_attention_forward = lambda *a, _f=SDPA_OPS._flash_attention_forward, **kw: (
        varlen_calls.append(1), _f(*a, **kw))[1]
    monkeypatch.setattr(kernels, "_sdpa_ops", lambda backend: ops)
    starts = document_starts(packed_batch()[0]["position_ids"])
    packed = tiles(DocumentLayout(starts, 0, 1).full_row_pieces(), 0)
    one_document = tiles(DocumentLayout(torch.zeros_like(starts[:1]), 0, 1).full_row_pieces(), 0)
    g = torch.Generator().manual_seed(3)
    for block, rows, cudnn, varlen in ((one_document, 1, True, False), (packed, starts.shape[0], False, True)):
        q = torch.randn(rows, 4, SEQ_LEN, 8, generator=g, dtype=torch.float64)
        k, v = (torch.randn(rows, 2, SEQ_LEN, 8, generator=g, dtype=torch.float64) for _ in range(2))
        dout = torch.randn(q.shape, generator=g, dtype=torch.float64)
        seen.clear(), varlen_calls.clear()
        results = []
        for backend in (None, "sdpa_cpu"):
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            out = pieces_attention(*inputs, block, scale=8**-0.5, backend=backend)
            out.backward(dout)
            results.append((out, *(t.grad for t in inputs)))
        assert bool(seen) == cudnn and bool(varlen_calls) == varlen, (seen[:2], len(varlen_calls))
        for got, want in zip(*results, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # cuDNN's lse is float32


def test_its_requirements_are_named():
    problem = kernels.backend_problem("sdpa_cudnn", "cuda", torch.bfloat16, 256, capability=(9, 0))
    assert problem == "sdpa_cudnn takes head sizes up to 128, not 256"
    assert "float16/bfloat16 only" in kernels.backend_problem("sdpa_cudnn", "cuda", torch.float32, 128,
                                                              capability=(9, 0))


def test_the_planner_plans_it_as_sdpa_flash():
    """Note [Planning cuDNN attention] in llama_cp/plan/simulate.py: the same tensors around the
    kernel, and a kernel that allocated less than sdpa_flash's on the H200; head sizes over 128 are
    refused in one line, as the trainer would."""
    from llama_cp.modules.causal_lm import embedded_llama_config
    from llama_cp.plan.simulate import planned_attention_backend

    config = embedded_llama_config()
    assert planned_attention_backend(TrainConfig.from_flags(attention_backend="sdpa_cudnn"), config) == "sdpa_flash"
    config.head_dim = 256
    with pytest.raises(ValueError, match=r"^--attention_backend sdpa_cudnn cannot run here: sdpa_cudnn takes head sizes "
                                         r"up to 128, not 256") as refused:
        planned_attention_backend(TrainConfig.from_flags(attention_backend="sdpa_cudnn"), config)
    assert "\n" not in str(refused.value)
