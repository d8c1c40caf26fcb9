"""Single-process checks of the local attention kernels and the LSE merge."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from llama_cp.attention import dense, kernels, windows
from probes import RecordedOps


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
    # Gemma 4's full layers (Note [Head sizes above 256]): the memory-efficient kernel alone, at any multiple of 8
    ("sdpa_efficient", "cuda", torch.bfloat16, 512, H100, None),
    ("sdpa_efficient", "cuda", torch.bfloat16, 260, H100, "sdpa_efficient takes head sizes that are multiples of 8"),
    ("sdpa_flash", "cuda", torch.bfloat16, 512, H100, "sdpa_flash takes head sizes 8, 16, ..., 256, not 512"),
    ("flash_attn", "cuda", torch.bfloat16, 512, H100, "flash_attn takes head sizes 8, 16, ..., 256, not 512"),
])
def test_backend_problem_names_the_cause(backend, device, dtype, head_dim, capability, problem):
    got = kernels.backend_problem(backend, device, dtype, head_dim, capability=capability)
    assert got == problem if problem is None else problem in got


def test_auto_takes_the_fastest_kernel_of_each_head_size(monkeypatch):
    """select_backend chooses per call: a Gemma 4 run's windowed layers (heads of 256) take flash-attn,
    its full layers (512) the memory-efficient kernel, where "math" would build each block's scores.
    (An H100 stood in: select_backend reads a query's device, dtype and head size only.)"""
    import types

    monkeypatch.setattr(kernels, "_flash_attn_interface", lambda: object())
    monkeypatch.setattr(kernels, "_capability", lambda device: H100)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: H100)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    picks = {head_dim: kernels.select_backend(types.SimpleNamespace(
        device=torch.device("cuda"), dtype=torch.bfloat16, shape=(1, 2, 4, head_dim))) for head_dim in (256, 512)}
    assert picks == {256: "flash_attn", 512: "sdpa_efficient"}


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


# ---------------------------------------------------------------- tiled attention
# Note [Tiled attention] (llama_cp/attention/documents.py): every block cut into kernel calls of at most
# block_size queries x keys, exact against the untiled calls.
TILE_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float64: dict(atol=1e-10, rtol=1e-10)}


def _document_block(seq: int, seed: int = 5):
    """Pieces of 2 rows of ``seq`` tokens packed with documents (one of length 1, one spanning
    most of the row), as cp 1 computes them."""
    from llama_cp.attention.documents import DocumentLayout
    from llama_cp.parallel.sharding import document_starts

    g = torch.Generator().manual_seed(seed)
    position_ids = torch.arange(seq).repeat(2, 1)
    for row, cuts in enumerate(([3, 4], sorted(torch.randperm(seq - 1, generator=g)[:3].add(1).tolist()))):
        for cut in cuts:
            position_ids[row, cut:] -= int(position_ids[row, cut])
    return DocumentLayout(document_starts(position_ids)).ring_pieces(0)


def _pairs(block, batch):
    """{(row, query, key)} of a block's pieces (causal pieces square), and the count of repeats."""
    seen = []
    for p in block:
        rows = range(batch) if p.row is None else [p.row]
        for r in rows:
            for i, qi in enumerate(range(p.q.start, p.q.stop)):
                for j, kj in enumerate(range(p.k.start, p.k.stop)):
                    if not p.causal or j <= i:
                        seen.append((r, qi, kj))
    return set(seen), len(seen) - len(set(seen))


@pytest.mark.parametrize("block_size", [1, 3, 5, 8, 24, 100])
def test_tiles_cover_each_visible_pair_once_in_small_calls(block_size):
    from llama_cp.attention.documents import Piece, tiles

    seq = 24
    for block in ([Piece(None, slice(0, seq), slice(0, seq), True)],
                  [Piece(None, slice(4, 20), slice(0, 40), False)],
                  _document_block(seq)):
        tiled = tiles(block, block_size)
        assert _pairs(tiled, 2) == (_pairs(block, 2)[0], 0)
        for t in tiled:
            assert t.q.stop - t.q.start <= block_size and t.k.stop - t.k.start <= block_size
            assert not t.causal or t.q.stop - t.q.start == t.k.stop - t.k.start
        if block_size >= 40:
            assert tiled == block  # nothing to cut: the untiled calls
    # queries-outer: the tiles of a query block follow each other (Note [Tiled attention])
    tiled = tiles([Piece(None, slice(0, 8), slice(0, 8), True)], 3)
    assert [(t.q.start, t.k.start, t.causal) for t in tiled] == [
        (0, 0, True), (3, 0, False), (3, 3, True), (6, 0, False), (6, 3, False), (6, 6, True)]


TILED_CASES = [
    *itertools.product(["sdpa_cpu"], [1, 5, 8, 16], [True, False, "documents"], [(4, 4), (4, 2), (4, 1)],
                       [torch.float32, torch.float64]),
    *itertools.product(["math"], [5], [True, False, "documents"], [(4, 2)], [torch.float32, torch.float64]),
]


@pytest.mark.slow
@pytest.mark.parametrize("backend,block_size,causal,heads,dtype", TILED_CASES)
def test_tiled_attention_equals_untiled(backend, block_size, causal, heads, dtype):
    """out, lse, dq, dk, dv of the tiled local attention equal the untiled calls' (block sizes
    that divide the 16 queries, that do not, 1, and the whole block)."""
    from llama_cp.attention.documents import Piece, tiles
    from llama_cp.attention.pieces import pieces_forward
    from llama_cp.attention.local import local_attention

    seq = 16
    sk = seq if causal else 13
    q, k, v = _inputs(*heads, seq, sk, dtype)
    if causal == "documents":
        block = _document_block(seq)
        ref_out, ref_lse = pieces_forward(q, k, v, block, scale=0.25, backend=backend)
    else:
        block = None
        ref_out, ref_lse = kernels.attention_forward(q, k, v, causal=causal, backend=backend)
    whole = block or [Piece(None, slice(0, seq), slice(0, sk), causal)]
    out, lse = pieces_forward(q, k, v, tiles(whole, block_size), scale=0.25, backend=backend)
    tol = TILE_TOL[dtype]
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(lse, ref_lse, **tol)

    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(7)).to(dtype)
    grads = []
    for size in (0, block_size):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        got = local_attention(*inputs, causal=bool(causal), scale=0.25, backend=backend, block_size=size,
                              block=block)
        got.backward(dout)
        torch.testing.assert_close(got, ref_out.to(dtype), **tol)
        grads.append([t.grad for t in inputs])
    for name, got, want in zip(("dq", "dk", "dv"), grads[1], grads[0], strict=True):
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{name}: {m}")


class _LargestFloat32(TorchDispatchMode):
    """The most elements of any float32 tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.numel = max(self.numel, t.numel())
        return result


@pytest.mark.parametrize("backend", ["sdpa_cpu", "math"])
def test_tiled_bf16_attention_keeps_float32_per_query_block(backend):
    """bf16 in and out; the float32 tensors are per tile or query block, or the dK/dV sums at the
    KV head count: never the float32 output or dQ of the whole sequence (Note [Tiled attention])."""
    from llama_cp.attention.local import local_attention

    seq, block_size = 64, 8
    q, k, v = (t.requires_grad_() for t in _inputs(4, 1, seq, seq, torch.bfloat16))
    with _LargestFloat32() as largest:
        out = local_attention(q, k, v, causal=True, scale=0.25, backend=backend, block_size=block_size)
        out.backward(torch.ones_like(out))
    assert out.dtype == q.grad.dtype == k.grad.dtype == torch.bfloat16
    # dK and dV in float32 at 1 KV head: (2, 1, 64, 16); a query block's output: (2, 4, 8, 16)
    assert largest.numel == 2 * 1 * seq * 16, largest.numel
    ref_out, ref_lse = kernels.attention_forward(q.detach(), k.detach(), v.detach(), causal=True, backend=backend)
    torch.testing.assert_close(out.detach(), ref_out, atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------- soft-capped scores (Gemma 2)
def _softcap_reference(q, k, v, causal, softcap, dout):
    """Dense autograd in float64, written as Gemma 2's eager attention: scores / cap, tanh, * cap."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(rep, 1).transpose(-1, -2) * q.shape[-1] ** -0.5
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = torch.softmax(scores, -1) @ v.repeat_interleave(rep, 1)
    out.backward(dout)
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("backend", ["sdpa_cpu", "math"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (4, 1)])
def test_softcapped_attention_is_exact(backend, causal, heads, monkeypatch):
    """fp64 to 1e-10, queries in several row steps of the CPU kernel, and the cap really bites."""
    monkeypatch.setattr(dense, "DENSE_ROWS", 5)
    q, k, v = (3 * t for t in _inputs(*heads, 12, 12, torch.float64))  # large scores: tanh saturates
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = _softcap_reference(q, k, v, causal, 2.0, dout)
    out, lse = kernels.attention_forward(q, k, v, causal=causal, backend=backend, softcap=2.0)
    grads = kernels.attention_backward(dout, q, k, v, out, lse, causal=causal, backend=backend, softcap=2.0)
    tol = dict(atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(lse, ref_lse, **tol)
    for got, want in zip(grads, (ref_dq, ref_dk, ref_dv)):
        torch.testing.assert_close(got, want, **tol)
    plain, _ = kernels.attention_forward(q, k, v, causal=causal, backend=backend)
    assert (plain - out).abs().max() > 1e-2  # without the cap the result differs


def test_softcapped_blocks_merge_and_take_the_merged_statistics():
    """Key blocks merged by lse, and each block's backward with the merged (out, lse), give
    whole-row attention: what the ring and the document pieces do with a cap."""
    q, k, v = (3 * t for t in _inputs(4, 2, 16, 40, torch.float64))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = _softcap_reference(q, k, v, False, 1.5, dout)
    parts = (slice(0, 17), slice(17, 40))
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float64)
    for part in parts:
        kernels.merge_block(out, lse, *kernels.attention_forward(q, k[:, :, part], v[:, :, part], causal=False,
                                                                  softcap=1.5))
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=1e-10)
    grads = [kernels.attention_backward(dout, q, k[:, :, p], v[:, :, p], out, lse, causal=False, softcap=1.5)
             for p in parts]
    torch.testing.assert_close(sum(g[0] for g in grads), ref_dq, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(torch.cat([g[1] for g in grads], 2), ref_dk, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(torch.cat([g[2] for g in grads], 2), ref_dv, atol=1e-10, rtol=1e-10)


def test_softcap_through_flash_attn_glue_and_its_refusals():
    """flash_attn gets the cap in its own argument (the stand-in computes with it, as the library
    would); torch's CUDA kernels have none and are refused in one line naming the fix."""
    from llama_cp.attention.workspace import ModelledBackend

    q, k, v = (3 * t.float() for t in _inputs(4, 2, 12, 12, torch.float64))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    backend = ModelledBackend("flash_attn")
    out, lse = kernels.attention_forward(q, k, v, causal=True, backend=backend, softcap=2.0)
    grads = kernels.attention_backward(dout, q, k, v, out, lse, causal=True, backend=backend, softcap=2.0)
    ref_out, ref_lse, *ref_grads = _softcap_reference(q, k, v, True, 2.0, dout.double())
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    for name in ("sdpa_flash", "sdpa_efficient"):
        with pytest.raises(ValueError, match=rf"soft-capping .* needs --attention_backend flash_attn .* {name!r} "
                                             r"has none: install flash-attn"):
            windows.window_or_cap_backend(name, softcap=2.0)


def test_softcapped_document_pieces_in_tiles_are_exact():
    """Packed documents cut into tiles of 5 (the pieces the ring, Ulysses and all-gather compute),
    with a cap: equal to dense attention with the document mask, forward and backward."""
    from llama_cp.attention.documents import DocumentLayout, tiles
    from llama_cp.attention.pieces import pieces_attention
    from llama_cp.parallel.sharding import document_starts

    lengths = [7, 1, 12, 4]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    starts = document_starts(positions)
    block = tiles(DocumentLayout(starts).ring_pieces(0), 5)
    q, k, v = (3 * t[:1] for t in _inputs(4, 2, 24, 24, torch.float64))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    got_out = pieces_attention(q, k, v, block, scale=0.25, softcap=1.5)
    got_out.backward(dout)
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    scores = q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.25
    scores = torch.tanh(scores / 1.5) * 1.5
    index = torch.arange(24)
    visible = (index[None, :] <= index[:, None]) & (index[None, :] >= starts[0][:, None])
    out = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ v.repeat_interleave(2, 1)
    out.backward(dout)
    torch.testing.assert_close(got_out, out, atol=1e-10, rtol=1e-10)
    for g, t in zip(got, (q, k, v)):
        torch.testing.assert_close(g, t.grad, atol=1e-10, rtol=1e-10)


# ---------------------------------------------------------------- sliding windows (lag)
def _window_reference(q, k, v, causal, lag, dout):
    """Dense autograd in float64: key j hidden from query i when i - j > lag (and j > i, causal);
    rows that see nothing: out 0, lse -inf, no gradient."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(rep, 1).transpose(-1, -2) * q.shape[-1] ** -0.5
    i, j = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None, :]
    hidden = (i - j > lag) | ((j > i) if causal else torch.zeros_like(i - j, dtype=torch.bool))
    scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # empty rows: -inf - -inf
    out = probs @ v.repeat_interleave(rep, 1)
    out.backward(dout)
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


#: (queries, keys, causal, lag): a band in a causal square; full calls where every row sees a key,
#: where the last rows see none, where the first rows see every key and the rest a suffix, and one
#: with a negative lag (queries after the keys, as a ring block's tile can be)
WINDOW_CALLS = [(12, 12, True, 3), (12, 12, True, 0), (9, 12, False, 4), (12, 5, False, 2), (20, 6, False, 7),
                (7, 9, False, -3), (6, 6, False, 20)]


@pytest.mark.parametrize("backend", ["sdpa_cpu", "math", "flash_attn", "sdpa_flash"])
@pytest.mark.parametrize("num_q, num_k, causal, lag", WINDOW_CALLS)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_windowed_attention_is_exact(backend, num_q, num_k, causal, lag, heads, monkeypatch):
    """fp64 to 1e-10 on the CPU backends (the dense kernel in several row steps); flash_attn and
    sdpa_flash through their stand-ins, which read the window as flash-attn 2.8.3's and torch's
    mha_fwd / mha_bwd do (workspace._flash_bounds), so the glue's translation of the lag to their
    bottom-right windows is checked too (sdpa_flash: K/V with their own heads, the (B, S, H, D)
    views, Note [Windows on torch's flash kernel])."""
    from llama_cp.attention.workspace import ModelledBackend

    monkeypatch.setattr(dense, "DENSE_ROWS", 5)
    modelled = backend in ("flash_attn", "sdpa_flash")
    dtype, tol = (torch.float32, dict(atol=1e-5, rtol=1e-5)) if modelled else (
        torch.float64, dict(atol=1e-10, rtol=1e-10))
    q, k, v = (t.to(dtype) for t in _inputs(*heads, num_q, num_k, torch.float64))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    ref_out, ref_lse, *ref_grads = _window_reference(q, k, v, causal, lag, dout)
    chosen = ModelledBackend(backend) if modelled else backend
    out, lse = kernels.attention_forward(q, k, v, causal=causal, backend=chosen, lag=lag)
    grads = kernels.attention_backward(dout, q, k, v, out, lse, causal=causal, backend=chosen, lag=lag)
    torch.testing.assert_close(out.double(), ref_out, **tol)
    torch.testing.assert_close(lse.double(), ref_lse, **tol)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, **tol)


def test_window_parts_give_flash_attn_calls_it_computes_exactly():
    """Every visible pair in exactly one part, every row of a part sees a key, and a windowed full
    part never has more queries than keys (flash-attn's right side would hide keys otherwise)."""
    for num_q in range(1, 9):
        for num_k in range(1, 9):
            for lag in range(-num_k - 1, num_q + 1):
                for causal in (False, True) if num_q == num_k else (False,):
                    if causal and lag < 0:
                        continue  # a causal call sees its diagonal: lag >= 0
                    i, j = torch.arange(num_q)[:, None], torch.arange(num_k)[None, :]
                    visible = (i - j <= lag) & ((j <= i) if causal else True)
                    parts = windows.window_parts(num_q, num_k, causal, lag)
                    if parts is None:
                        assert bool(visible.eq((j <= i) if causal else True).all())
                        continue
                    covered = torch.zeros(num_q, num_k, dtype=torch.int64)
                    for rows, keys, part_lag in parts:
                        pi, pj = torch.arange(rows.stop - rows.start)[:, None], torch.arange(keys.stop - keys.start)
                        seen = (pi - pj[None, :] <= (part_lag if part_lag is not None else num_k + num_q))
                        seen &= (pj[None, :] <= pi) if causal else True
                        assert bool(seen.any(1).all()), (num_q, num_k, lag, parts)
                        if part_lag is not None and not causal:
                            assert rows.stop - rows.start <= keys.stop - keys.start
                        covered[rows, keys] += seen.long()
                    assert torch.equal(covered, visible.long()), (num_q, num_k, causal, lag, parts)


def test_windowed_calls_on_torchs_cuda_kernels_take_sdpa_flash_or_are_refused(monkeypatch):
    """A window without a cap runs on torch's flash kernel (Note [Windows on torch's flash kernel]):
    sdpa_flash's own calls (a modelled sdpa_flash stays modelled: the planner's stand-in) and
    sdpa_cudnn's, whose op takes no window; sdpa_efficient (float32, or a GPU before sm80) takes none,
    and torch's ROCm kernel reads windows by rules not checked here: refused in one line each."""
    from llama_cp.attention.workspace import ModelledBackend

    modelled = ModelledBackend("sdpa_flash")
    assert windows.window_or_cap_backend(modelled, softcap=0.0) is modelled
    for backend in ("sdpa_flash", "sdpa_cudnn"):
        assert windows.window_or_cap_backend(backend, softcap=0.0) == "sdpa_flash"
    for backend in ("sdpa_efficient", ModelledBackend("sdpa_efficient")):
        with pytest.raises(ValueError, match=r"^sliding-window attention on CUDA needs float16/bfloat16 \(--dtype "
                                             r"bfloat16\) on an sm80\+ GPU, where sdpa_flash or flash_attn takes it; "
                                             r"'sdpa_efficient' \(chosen for float32, or for a GPU older than sm80\) "
                                             r"takes none$"):
            windows.window_or_cap_backend(backend, softcap=0.0)
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert windows.window_or_cap_backend(modelled, softcap=0.0) is modelled  # the planner plans, whatever runs the run
    for backend in ("sdpa_flash", "sdpa_cudnn"):
        with pytest.raises(ValueError, match=rf"^sliding-window attention on ROCm needs --attention_backend flash_attn"
                                             rf": .* so {backend!r} is not given one$"):
            windows.window_or_cap_backend(backend, softcap=0.0)


@pytest.mark.parametrize("backend", ["sdpa_flash", "sdpa_cudnn"])
@pytest.mark.parametrize("num_q, num_k, causal, lag", [(12, 12, True, 3), (9, 12, False, 4)])
def test_windowed_sdpa_calls_against_the_real_schema(backend, num_q, num_k, causal, lag):
    """A windowed call of sdpa_flash or sdpa_cudnn runs torch's own _flash_attention_forward /
    _backward, which on meta tensors run their meta kernels (torch 2.13 here, 2.10 on the floors): the
    arguments bind to the installed schema; the window reaches the op as flash-attn's sides
    (kernel_calls.flash_window: left lag + Sk - Sq, right 0 causal or -1), without cum_seq (the dense
    path), K/V with their own heads in (B, S, H, D) views with the last dimension contiguous, the lse
    contiguous float32; out, lse and the gradients come back in the layouts of kernels."""
    q = torch.empty(2, 4, num_q, 16, dtype=torch.bfloat16, device="meta")
    k, v = (torch.empty(2, 2, num_k, 16, dtype=torch.bfloat16, device="meta") for _ in range(2))
    sides = (lag + num_k - num_q, 0 if causal else -1)

    def call(recorded, name):
        (args,) = [args for op, args in recorded.calls if op == name]
        assert args["cum_seq_q"] is None and args["cum_seq_k"] is None and args["is_causal"] == causal
        assert (args["window_size_left"], args["window_size_right"], args["scale"]) == (*sides, 0.25)
        assert (args["max_q"], args["max_k"], args["dropout_p"]) == (num_q, num_k, 0.0)
        assert args["query"].shape == (2, num_q, 4, 16) and args["key"].shape == args["value"].shape == (
            2, num_k, 2, 16)
        assert all(args[name].stride(-1) == 1 for name in ("query", "key", "value"))
        return args

    with RecordedOps() as recorded:
        out, lse = kernels._forward(q, k, v, causal, 0.25, backend, 0.0, lag)
    call(recorded, "_flash_attention_forward")
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert lse.shape == (2, 4, num_q) and lse.dtype == torch.float32
    with RecordedOps() as recorded:
        wider = torch.empty(2, 4, num_q + 3, device="meta")  # a row slice of the merged lse, as the windowed parts pass
        dq, dk, dv = kernels._backward(torch.empty_like(q), q, k, v, out, wider[..., 1:num_q + 1], causal, 0.25,
                                       backend, 0.0, lag)
    args = call(recorded, "_flash_attention_backward")
    assert args["logsumexp"].shape == (2, 4, num_q) and args["logsumexp"].is_contiguous()
    assert args["grad_out"].shape == args["out"].shape == (2, num_q, 4, 16)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


@pytest.mark.parametrize("backend", [None, "sdpa_flash"])
@pytest.mark.parametrize("block_size", [0, 4, 7])
@pytest.mark.parametrize("window", [1, 3, 10, 40])
def test_windowed_document_pieces_are_exact_and_skip_what_the_band_misses(block_size, window, backend):
    """Pieces of packed rows with a window, tiled or not, give the dense masked attention in fp64
    (logits and every gradient); no tile lies wholly outside the band, and tiles compute fewer
    pairs than without the window. sdpa_flash: the same pieces through the stand-in of torch's
    windowed flash op (Note [Windows on torch's flash kernel]), in fp32, the lse's dtype there."""
    from llama_cp.attention.documents import Chunk, pieces, spans, tiles
    from llama_cp.attention.pieces import pieces_attention
    from llama_cp.attention.workspace import ModelledBackend
    from llama_cp.parallel.sharding import document_starts

    seq = 32
    position_ids = torch.stack([torch.arange(seq), torch.cat([torch.arange(11), torch.arange(seq - 11)])])
    starts = document_starts(position_ids)
    block = tiles(pieces(spans(starts, torch.arange(seq)), [Chunk(0, 0, seq)], window), block_size)
    for piece in block:
        if piece.lag is not None:
            assert piece.q.start - (piece.k.stop - 1) <= piece.lag  # some query of the tile sees a key
    q, k, v = (t.requires_grad_() for t in _inputs(4, 2, seq, seq, torch.float64))
    dtype = torch.float64 if backend is None else torch.float32
    q, k, v = (t.detach().expand(2, -1, -1, -1).to(dtype).requires_grad_() for t in (q, k, v))
    out = pieces_attention(q, k, v, block, scale=0.25, backend=backend and ModelledBackend(backend))
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(dtype)
    out.backward(dout)
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    visible = (j <= i) & (i - j < window) & (j >= starts[:, :, None])  # (B, L, L)
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    scores = (qr @ kr.repeat_interleave(2, 1).transpose(-1, -2) * 0.25).masked_fill(~visible[:, None], float("-inf"))
    ref = torch.softmax(scores, -1) @ vr.repeat_interleave(2, 1)
    ref.backward(dout)
    tol = TILE_TOL[dtype]
    torch.testing.assert_close(out, ref, **tol)
    for got, want in ((q.grad, qr.grad), (k.grad, kr.grad), (v.grad, vr.grad)):
        torch.testing.assert_close(got, want, **tol)
    if window <= 3 and block_size:  # a short window: whole tiles are skipped
        computed = sum((p.q.stop - p.q.start) * (p.k.stop - p.k.start) for p in block)
        full = sum((p.q.stop - p.q.start) * (p.k.stop - p.k.start) for p in tiles(
            pieces(spans(starts, torch.arange(seq)), [Chunk(0, 0, seq)]), block_size))
        assert computed < full, (computed, full)
