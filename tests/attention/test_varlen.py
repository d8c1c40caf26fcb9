"""Varlen document calls (Note [Varlen document calls] in llama_cp/attention/varlen.py) without a GPU:

- the glue against the real schemas: torch's ``aten._flash_attention_forward`` /
  ``_flash_attention_backward`` run their meta kernels on the tensors our packing code makes,
  and flash-attn's ``_flash_attn_varlen_forward`` / ``_backward`` are called through the
  signatures of 2.6.3, 2.7.4 and 2.8.3 (transcribed below from flash_attn/flash_attn_interface.py);
- the CPU stand-ins of both ops (llama_cp/attention/workspace.py) make the varlen path equal the
  per-piece path (sdpa_cpu) in outputs, lse and gradients for the packed rows of
  tests/attention/test_documents.py: one process, and every ring step's block at cp 2 and 4;
- the stand-ins' workspace is mha_varlen_bwd's.
"""

import contextlib
import functools
import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from document_checks import SEQ_LEN, TOLERANCE, packed_batch
from llama_cp.attention import kernels
from llama_cp.attention.documents import DocumentLayout, tiles
from llama_cp.attention.pieces import pieces_attention, pieces_backward, pieces_forward
from llama_cp.attention.varlen import varlen_calls, varlen_plan
from llama_cp.attention.workspace import FLASH_ATTN, ModelledBackend, flash_attention_forward
from llama_cp.parallel.sharding import document_starts
from probes import RecordedOps

VARLEN = [ModelledBackend(b) for b in kernels.VARLEN]
H, HKV, D = 4, 2, 8  # GQA


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Hundreds of tiny kernel calls: one thread each (two threads spin against each other on a
    busy 2-core machine, 40x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _layout(cp_rank=0, cp_size=1):
    return DocumentLayout(document_starts(packed_batch()[0]["position_ids"]), cp_rank, cp_size)


def _qkv(seq, dtype, seed=0, batch=4):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, H, D, generator=g).to(dtype).transpose(1, 2)  # HF's layout: (B, S, H, D) viewed
    k, v = (torch.randn(batch, HKV, seq, D, generator=g).to(dtype) for _ in range(2))
    return q, k, v


@contextlib.contextmanager
def _counting_varlen_calls():
    """Counts kernels.varlen_forward / varlen_backward calls."""
    counts = {"forward": 0, "backward": 0}
    originals = kernels.varlen_forward, kernels.varlen_backward

    def counted(name, fn, *args, **kwargs):
        counts[name] += 1
        return fn(*args, **kwargs)

    kernels.varlen_forward = functools.partial(counted, "forward", originals[0])
    kernels.varlen_backward = functools.partial(counted, "backward", originals[1])
    try:
        yield counts
    finally:
        kernels.varlen_forward, kernels.varlen_backward = originals


# ---------------------------------------------------------------- varlen == per piece, CPU stand-ins
F32, F64 = torch.float32, torch.float64
FA, SDPA = VARLEN


@pytest.mark.parametrize("backend,block_size,dtype", [(FA, 0, F64), (FA, 8, F32), (SDPA, 8, F64), (SDPA, 0, F32)])
def test_one_process_varlen_equals_per_piece(backend, block_size, dtype):
    """cp 1 (and Ulysses' gathered rows): out and dq, dk, dv through the autograd function."""
    block = tiles(_layout().full_row_pieces(), block_size)
    windows = varlen_calls(block, block_size)
    calls = sum(len(c) for c in windows)
    assert calls < len(block) and varlen_plan(block, torch.zeros(1, 1, 1, D), backend) is not None
    q, k, v = _qkv(SEQ_LEN, dtype)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    results = []
    for b in ("sdpa_cpu", backend):
        inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        with _counting_varlen_calls() as counts:
            out = pieces_attention(*inputs, block, scale=D**-0.5, backend=b)
            out.backward(dout)
        results.append((out, *(t.grad for t in inputs)))
        assert counts == ({"forward": 0, "backward": 0} if b == "sdpa_cpu" else {"forward": calls, "backward": calls})
    for name, want, got in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, **TOLERANCE[dtype], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", VARLEN)
def test_the_auto_backend_takes_the_varlen_calls_it_picks(backend, monkeypatch):
    """--attention_backend auto (None) on a GPU picks a varlen backend (sdpa_flash without
    flash-attn): the packed documents' calls go to it by name. The kernels were handed None and
    refused it ("attention backend None has no varlen kernel"): every packed run on a GPU stopped
    at its first step (seen on an H200, torch 2.11, issue 35)."""
    monkeypatch.setattr(kernels, "select_backend", lambda q, varlen=False: backend)  # what auto picks on CUDA
    block = tiles(_layout().full_row_pieces(), 0)
    q, k, v = _qkv(SEQ_LEN, F64)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    results = []
    for b in (backend, None):
        inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        with _counting_varlen_calls() as counts:
            out = pieces_attention(*inputs, block, scale=D**-0.5, backend=b)
            out.backward(dout)
        assert counts["forward"] > 0 and counts["backward"] > 0, counts
        results.append((out, *(t.grad for t in inputs)))
    for want, got in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("backend,cp,block_size,dtype", [(FA, 2, 0, F64), (SDPA, 2, 5, F32), (FA, 4, 5, F32),
                                                        (SDPA, 4, 0, F64)])
def test_ring_step_blocks_varlen_equals_per_piece(backend, cp, block_size, dtype):
    """Every (rank, source) block of the ring at cp 2 and 4: merged into given float32 accumulators
    (out, lse, dq) and dk/dv, as the ring does, from a state already holding earlier blocks. Blocks
    that keep the per-piece path (one piece, or no fewer calls) are left to tests/attention/test_kernels.py."""
    g = torch.Generator().manual_seed(2)
    acc = kernels.accumulation_dtype(torch.zeros((), dtype=dtype))
    shard = SEQ_LEN // cp
    taken = 0
    for rank, source in itertools.product(range(cp), range(cp)):
        block = tiles(_layout(rank, cp).ring_pieces(source), block_size)
        if varlen_plan(block, torch.zeros(1, 1, 1, D), backend) is None:
            continue
        taken += 1
        q, k, v = _qkv(shard, dtype, seed=rank * cp + source)
        out0 = torch.randn(q.shape, generator=g, dtype=acc)
        lse0 = torch.randn(q.shape[:3], generator=g, dtype=acc)
        dout, dq0 = torch.randn(q.shape, generator=g, dtype=dtype), torch.randn(q.shape, generator=g, dtype=acc)
        results = []
        for b in ("sdpa_cpu", backend):
            out, lse = pieces_forward(q, k, v, block, scale=D**-0.5, backend=b, out=out0.clone(), lse=lse0.clone())
            dq, dk, dv = dq0.clone(), torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)
            assert pieces_backward(dout, q, k, v, out, lse, block, scale=D**-0.5, backend=b, dq=dq, dk=dk,
                                   dv=dv) is None
            results.append((out, lse, dq, dk, dv))
        for name, want, got in zip(("out", "lse", "dq", "dk", "dv"), *results, strict=True):
            torch.testing.assert_close(got, want, **TOLERANCE[dtype],
                                       msg=lambda m: f"rank {rank} source {source} {name}: {m}")
    assert taken >= cp


def test_varlen_calls_are_bounded_and_cover_the_block():
    """Windows of whole query slices, calls of one kind, at most block_size query and key rows
    (unless one piece alone is longer), every piece exactly once (unwindowed pieces: a segment each)."""
    block = tiles(_layout(0, 2).ring_pieces(0), 0)  # ring step 0 of rank 0: causal and full pieces
    for block_size in (0, 5, 12, 40):
        windows = varlen_calls(block, block_size)
        segments = [s for calls in windows for call in calls for s in call]
        assert all((s.q, s.k, s.window) == (s.piece.q, s.piece.k, (-1, -1)) for s in segments)
        assert sorted(s.piece for s in segments) == sorted(block)
        for calls in windows:
            queries = {s.piece.queries for call in calls for s in call}
            assert sorted(s.piece for call in calls for s in call) == sorted(
                p for p in block if p.queries in queries)
            if block_size and len(queries) > 1:
                assert sum(stop - start for _, start, stop in queries) <= block_size
            for call in calls:
                assert len({p.causal for p in call}) == 1
                if block_size and len(call) > 1:
                    assert sum(p.q.stop - p.q.start for p in call) <= block_size
                    assert sum(p.k.stop - p.k.start for p in call) <= block_size
    untiled = varlen_calls(block, 0)  # one window: one causal call and one full call
    assert [[(call[0].causal, len(call)) for call in calls] for calls in untiled] == [
        [(True, sum(p.causal for p in block)), (False, sum(not p.causal for p in block))]]


# ---------------------------------------------------------------- torch's ops: the real schema (meta kernels)
def _packed_calls(dtype=torch.bfloat16):
    """The varlen calls our packing code makes for the cp 1 rows of 16-token blocks: ((q, k, v)
    gathered on CPU, the call's index tensors, its pieces)."""
    q, k, v = _qkv(SEQ_LEN, dtype)
    block = tiles(_layout().full_row_pieces(), 16)
    plan = varlen_plan(block, q, VARLEN[0])
    q_, k_, v_ = (t.transpose(1, 2) for t in (q, k, v))
    return [((q_[c.q_rows], k_[c.k_rows], v_[c.k_rows]), c, call_pieces)
            for window, calls in zip(plan, varlen_calls(block, 16), strict=True)
            for c, call_pieces in zip(window.calls, calls, strict=True)]


def test_sdpa_flash_varlen_glue_against_the_real_schema():
    """kernels.varlen_forward / varlen_backward ("sdpa_flash") run torch's own ops, which on meta
    tensors run their meta kernels: the arguments bind to the schema, and what the op receives and
    returns is what the Note says."""
    calls = _packed_calls()
    assert len(calls) > 1
    for (q, k, v), call, call_pieces in calls:
        n = len(call_pieces)
        lengths_q = [p.q.stop - p.q.start for p in call_pieces]
        lengths_k = [p.k.stop - p.k.start for p in call_pieces]
        for cu, lengths in ((call.cu_seqlens_q, lengths_q), (call.cu_seqlens_k, lengths_k)):
            assert cu.dtype == torch.int32 and cu.tolist() == [0, *itertools.accumulate(lengths)]
        assert (q.shape[0], k.shape[0]) == (sum(lengths_q), sum(lengths_k))
        assert (call.max_seqlen_q, call.max_seqlen_k) == (max(lengths_q), max(lengths_k))
        assert {p.causal for p in call_pieces} == {call.causal}
        # the packed rows are the pieces' rows of q and k, in order
        want_q = torch.cat([_qkv(SEQ_LEN, torch.bfloat16)[0][p.piece.row, :, p.q].transpose(0, 1) for p in call_pieces])
        assert torch.equal(q, want_q)
        meta = [t.to("meta") for t in (q, k, v, call.cu_seqlens_q, call.cu_seqlens_k)]
        assert all(t.is_contiguous() for t in meta[:3])
        with RecordedOps() as recorded:
            out, lse = kernels.varlen_forward(*meta, call.max_seqlen_q, call.max_seqlen_k, causal=call.causal,
                                              scale=0.125, backend="sdpa_flash")
        name, args = next(c for c in recorded.calls if c[0] == "_flash_attention_forward")
        assert args["query"].shape == (q.shape[0], H, D) and args["key"].shape == args["value"].shape == (
            k.shape[0], HKV, D)
        for seq in ("cum_seq_q", "cum_seq_k"):
            assert args[seq].dtype == torch.int32 and args[seq].shape == (n + 1,), seq
        assert (args["max_q"], args["max_k"], args["dropout_p"], args["is_causal"], args["return_debug_mask"],
                args["scale"]) == (call.max_seqlen_q, call.max_seqlen_k, 0.0, call.causal, False, 0.125)
        assert out.shape == (q.shape[0], H, D) and out.dtype == torch.bfloat16
        assert lse.shape == (H, q.shape[0]) and lse.dtype == torch.float32

        dout = torch.empty_like(meta[0])
        with RecordedOps() as recorded:
            dq, dk, dv = kernels.varlen_backward(dout, *meta[:3], out, lse, *meta[3:], call.max_seqlen_q,
                                                 call.max_seqlen_k, causal=call.causal, scale=0.125,
                                                 backend="sdpa_flash")
        name, args = next(c for c in recorded.calls if c[0] == "_flash_attention_backward")
        assert args["logsumexp"].shape == (H, q.shape[0]) and args["logsumexp"].dtype == torch.float32
        assert args["cum_seq_q"].dtype == args["cum_seq_k"].dtype == torch.int32
        assert (args["max_q"], args["max_k"], args["is_causal"], args["scale"]) == (
            call.max_seqlen_q, call.max_seqlen_k, call.causal, 0.125)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


@pytest.mark.parametrize("backend", VARLEN)
def test_stand_ins_return_what_the_real_ops_return(backend):
    """Under fake tensors, each stand-in returns tensors of the shapes and dtypes of the real op:
    torch's meta kernels, and for flash-attn the fakes it registers (2.7.4/2.8.3
    ``_flash_attn_varlen_forward_fake``: out like q, lse (H, Tq) float32, rng_state (2,) int64)."""
    (q, k, v), call, _ = _packed_calls()[0]
    with FakeTensorMode() as mode:
        q, k, v, cu_q, cu_k = (mode.from_tensor(t) for t in (q, k, v, call.cu_seqlens_q, call.cu_seqlens_k))
        if backend == "sdpa_flash":
            got = flash_attention_forward(q, k, v, cu_q, cu_k, call.max_seqlen_q, call.max_seqlen_k, 0.0,
                                          call.causal, False, scale=0.125)
            want = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, call.max_seqlen_q,
                                                           call.max_seqlen_k, 0.0, call.causal, False, scale=0.125)
        else:
            got = FLASH_ATTN._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, call.max_seqlen_q,
                                                        call.max_seqlen_k, 0.0, 0.125, call.causal)
            want = (torch.empty_like(q), torch.empty(H, q.shape[0]), torch.empty(0, dtype=q.dtype),
                    torch.empty(2, dtype=torch.int64))
    assert [(tuple(t.shape), t.dtype) for t in got] == [(tuple(t.shape), t.dtype) for t in want]


# ---------------------------------------------------------------- flash-attn's signatures, 2.6.3 / 2.7.4 / 2.8.3
# flash_attn/flash_attn_interface.py of each release (git tags v2.6.3, v2.7.4, v2.8.3 of
# Dao-AILab/flash-attention). 2.6.3: plain functions, window_size a tuple, the forward returns
# (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state). 2.7.4 = 2.8.3: torch custom ops
# (the Python function is the op's ``_init_fn``), window_size_left/right, zero_tensors, the forward
# returns (out, softmax_lse, S_dmask, rng_state) and the backward softmax_d.
FLASH_ATTN_SIGNATURES = {
    "2.6.3": (
        "q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, "
        "window_size=(-1, -1), softcap=0.0, alibi_slopes=None, return_softmax=False, block_table=None, "
        "leftpad_k=None, seqused_k=None",
        "dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, "
        "dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, rng_state=None",
    ),
    "2.7.4": (
        "q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, "
        "window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False, "
        "block_table=None, leftpad_k=None, seqused_k=None, zero_tensors=False",
        "dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, "
        "dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes, "
        "deterministic, rng_state=None, zero_tensors=False",
    ),
}
FLASH_ATTN_SIGNATURES["2.8.3"] = FLASH_ATTN_SIGNATURES["2.7.4"]


def _flash_attn_release(version, seen):
    """A module with the varlen functions of flash-attn ``version``'s signatures, which record
    their arguments in ``seen`` and compute with the stand-ins."""
    forward_params, backward_params = FLASH_ATTN_SIGNATURES[version]
    scope = {}
    exec(f"def forward({forward_params}): return locals()\ndef backward({backward_params}): return locals()", scope)

    def window(args):
        left, right = args.pop("window_size") if "window_size" in args else (
            args.pop("window_size_left"), args.pop("window_size_right"))
        return dict(window_size_left=left, window_size_right=right)

    def forward(*args, **kwargs):
        bound = scope["forward"](*args, **kwargs)
        seen.append(("forward", dict(bound)))
        out, lse, p, rng = FLASH_ATTN._flash_attn_varlen_forward(**window(bound), **bound)
        return (out, lse, p, rng) if version != "2.6.3" else (out, None, None, None, out, lse, p, rng)

    def backward(*args, **kwargs):
        bound = scope["backward"](*args, **kwargs)
        seen.append(("backward", dict(bound)))
        return FLASH_ATTN._flash_attn_varlen_backward(**window(bound), **bound)

    if version != "2.6.3":  # custom ops: the signature is read from _init_fn
        forward._init_fn, backward._init_fn = scope["forward"], scope["backward"]
    else:
        forward.__wrapped__, backward.__wrapped__ = scope["forward"], scope["backward"]
    return type("flash_attn_interface", (), dict(_flash_attn_varlen_forward=staticmethod(forward),
                                                 _flash_attn_varlen_backward=staticmethod(backward)))


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("version", sorted(FLASH_ATTN_SIGNATURES))
def test_flash_attn_varlen_glue_binds_each_release(version, window, monkeypatch):
    """Our keyword calls bind to every release's signature with the values the Note says, and
    give the per-piece path's results (through the stand-in); with a sliding window, each call's
    window (a (left, right) tuple for 2.6.3)."""
    seen = []
    monkeypatch.setattr(kernels, "_flash_attn_module", lambda backend: _flash_attn_release(version, seen))
    block = tiles(_layout().full_row_pieces(window), 16)
    windows = {call[0].window for calls in varlen_calls(block, 16) for call in calls}
    assert (len(windows) > 1) == (window is not None)
    q, k, v = _qkv(SEQ_LEN, torch.float32)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    results = []
    for b in ("sdpa_cpu", VARLEN[0]):
        inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = pieces_attention(*inputs, block, scale=D**-0.5, backend=b)
        out.backward(dout)
        results.append((out, *(t.grad for t in inputs)))
    for want, got in zip(*results, strict=True):
        torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])
    assert {kind for kind, _ in seen} == {"forward", "backward"}
    assert {args.get("window_size", (args.get("window_size_left"), args.get("window_size_right")))
            for _, args in seen} == windows
    for kind, args in seen:
        assert args["cu_seqlens_q"].dtype == args["cu_seqlens_k"].dtype == torch.int32
        assert args["cu_seqlens_q"].shape == args["cu_seqlens_k"].shape
        assert args["max_seqlen_q"] == int(args["cu_seqlens_q"].diff().max())
        assert args["max_seqlen_k"] == int(args["cu_seqlens_k"].diff().max())
        assert (args["dropout_p"], args["softmax_scale"], args["alibi_slopes"]) == (0.0, D**-0.5, None)
        assert args.get("window_size", (args.get("window_size_left"), args.get("window_size_right"))) in windows
        assert args["q"].shape[1:] == (H, D) and args["k"].shape[1:] == (HKV, D) and args["q"].is_contiguous()
        if kind == "backward":
            assert args["deterministic"] is False and args["softmax_lse"].shape == (H, args["q"].shape[0])
            assert args["dq"].shape == args["q"].shape and args["dk"].shape == args["k"].shape


# ---------------------------------------------------------------- workspace
@pytest.mark.parametrize("backend", VARLEN)
def test_varlen_backward_workspace_is_mha_varlen_bwds(backend):
    """Under fake tensors (the planner), one varlen backward of n segments peaks at its inputs,
    dq/dk/dv, and mha_varlen_bwd's softmax_d (H, Tq + 128 n) and dq_accum (Tq + 128 n, H, D
    rounded to 32) in float32, and with GQA dK/dV expanded to every query head (Tk, H, D)."""
    from llama_cp.plan.memory import track_peak_memory

    lengths_q, heads, kv_heads, head_dim, e = [300, 5, 1000], 32, 8, 128, 2
    total = sum(lengths_q)
    with FakeTensorMode():
        cu = torch.tensor([0, *itertools.accumulate(lengths_q)], dtype=torch.int32)
        with track_peak_memory() as peak:
            q, out, dout = (torch.empty(total, heads, head_dim, dtype=torch.bfloat16) for _ in range(3))
            k, v = (torch.empty(total, kv_heads, head_dim, dtype=torch.bfloat16) for _ in range(2))
            lse = torch.empty(heads, total)
            kernels.varlen_backward(dout, q, k, v, out, lse, cu, cu, 1000, 1000, causal=True, scale=1.0,
                                    backend=backend)
    q_bytes, kv_bytes, rows = total * heads * head_dim * e, total * kv_heads * head_dim * e, total + 128 * 3
    inputs = 3 * q_bytes + 2 * kv_bytes + heads * total * 4
    philox = 8 if backend == "sdpa_flash" else 0  # the zero scalar passed as philox seed and offset
    workspace = heads * rows * 4 + rows * heads * 128 * 4 + 2 * total * heads * head_dim * e
    assert peak["Total"] == inputs + philox + q_bytes + 2 * kv_bytes + workspace


def test_model_logits_and_gradients_varlen_equal_per_piece():
    """The tiny Llama of tests/attention/test_documents.py on its packed rows at cp 1 (16-token attention
    blocks): logits and every parameter gradient with the flash_attn stand-in (varlen calls)
    equal those with sdpa_cpu (one call per piece)."""
    import copy

    import torch.nn.functional as F

    from document_checks import HEADS
    from fsdp_checks import tiny_model
    from llama_cp import apply_context_parallel

    data, _ = packed_batch()
    reference = tiny_model(**HEADS)
    results = []
    for backend in ("sdpa_cpu", FA):
        model = apply_context_parallel(copy.deepcopy(reference), None, backend=backend, block_size=16)
        with _counting_varlen_calls() as counts:
            logits = model(input_ids=data["input_ids"], position_ids=data["position_ids"]).logits
            F.cross_entropy(logits.flatten(0, 1), data["labels"].flatten(), ignore_index=-100).backward()
        assert (counts["forward"] > 0) == (backend == FA)
        results.append((logits, {n: p.grad for n, p in model.named_parameters()}))
    (want_logits, want_grads), (got_logits, got_grads) = results
    torch.testing.assert_close(got_logits, want_logits, **TOLERANCE[F32])
    assert want_grads.keys() == got_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], **TOLERANCE[F32], msg=lambda m: f"{name}: {m}")
