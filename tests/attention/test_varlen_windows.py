"""Windowed pieces of packed documents as varlen calls (Note [Varlen document calls] in
llama_cp/attention/varlen.py), without a GPU: a varlen call takes one flash window, aligned to each
segment's bottom-right corner, so the windowed causal squares of one layer go into one call and a
windowed full piece is cut into the parts ``windows.flash_segments`` makes.

- exact through the CPU stand-ins of both varlen ops (llama_cp/attention/workspace.py, which read a
  varlen window as mha_varlen_fwd / mha_varlen_bwd do): against the masked attention of the whole
  row (one process), and against the per-piece path on every ring step's block at cp 2 and 4;
- fewer calls than the per-piece path, with short documents in the windowed squares' call;
- the glue against torch's meta kernels (the window keywords of ``_flash_attention_forward`` /
  ``_backward`` with cum_seq) and the refusal on ROCm.
"""

import functools
import itertools

import pytest
import torch

from document_checks import SEQ_LEN, TOLERANCE, packed_batch
from llama_cp.attention import kernels
from llama_cp.attention.documents import DocumentLayout, tiles
from llama_cp.attention.pieces import pieces_attention, pieces_backward, pieces_forward
from llama_cp.attention.varlen import segments, varlen_calls, varlen_plan
from llama_cp.attention.windows import NO_WINDOW
from llama_cp.attention.workspace import ModelledBackend
from llama_cp.parallel.sharding import document_starts
from probes import RecordedOps

FA, SDPA = (ModelledBackend(b) for b in kernels.VARLEN)
H, HKV, D = 4, 2, 8  # GQA
F64 = torch.float64


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _starts():
    return document_starts(packed_batch()[0]["position_ids"])  # rows of 1, 2, 7 and 50 documents


def _qkv(seq, dtype, seed=0, batch=4):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, H, D, generator=g).to(dtype).transpose(1, 2)  # HF's layout: (B, S, H, D) viewed
    k, v = (torch.randn(batch, HKV, seq, D, generator=g).to(dtype) for _ in range(2))
    return q, k, v


def _counted(monkeypatch):
    """Counts kernels.varlen_forward / varlen_backward calls and the windows they get."""
    counts = {"forward": 0, "backward": 0, "windows": set()}

    def counted(name, fn, *args, **kwargs):
        counts[name] += 1
        counts["windows"].add(kwargs.get("window", NO_WINDOW))
        return fn(*args, **kwargs)

    for name in ("forward", "backward"):
        original = getattr(kernels, f"varlen_{name}")
        monkeypatch.setattr(kernels, f"varlen_{name}", functools.partial(counted, name, original))
    return counts


def _per_piece_calls(block):
    """Kernel calls the per-piece path makes for ``block``: a windowed piece is one per part."""
    return sum(len(segments(p)) for p in block)


@pytest.mark.parametrize("backend", [FA, SDPA])
@pytest.mark.parametrize("window,block_size", [(4, 0), (10, 0), (4, 16), (10, 7)])
def test_windowed_documents_as_varlen_calls_equal_the_masked_attention(backend, window, block_size, monkeypatch):
    """cp 1 (and Ulysses' gathered rows): out and dq, dk, dv through the autograd function equal the
    attention of the whole rows under the document and window masks, in fewer calls than pieces,
    the windowed squares and the documents shorter than the window in one causal call."""
    starts = _starts()
    block = tiles(DocumentLayout(starts).full_row_pieces(window), block_size)
    assert any(p.lag is not None for p in block) and any(p.lag is None and p.causal for p in block)
    calls = varlen_calls(block, block_size)
    count = sum(map(len, calls))
    assert count < _per_piece_calls(block) and varlen_plan(block, torch.zeros(1, 1, 1, D), backend) is not None
    if not block_size:  # one window of query rows: one call per kind and window
        ((causal_call, *full_calls),) = calls
        assert {s.window for s in causal_call} == {(window - 1, 0)}
        assert {s.piece.lag is None for s in causal_call} == {True, False}  # short documents joined
    counts = _counted(monkeypatch)
    q, k, v = (t.requires_grad_() for t in _qkv(SEQ_LEN, F64))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    out = pieces_attention(q, k, v, block, scale=D**-0.5, backend=backend)
    out.backward(dout)
    assert (counts["forward"], counts["backward"]) == (count, count)
    assert any(w != NO_WINDOW for w in counts["windows"]), counts

    i, j = torch.arange(SEQ_LEN)[:, None], torch.arange(SEQ_LEN)[None, :]
    visible = (j <= i) & (i - j < window) & (j >= starts[:, :, None])  # (B, L, L)
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    scores = (qr @ kr.repeat_interleave(H // HKV, 1).transpose(-1, -2) * D**-0.5)
    ref = torch.softmax(scores.masked_fill(~visible[:, None], float("-inf")), -1) @ vr.repeat_interleave(H // HKV, 1)
    ref.backward(dout)
    for name, got, want in (("out", out, ref), ("dq", q.grad, qr.grad), ("dk", k.grad, kr.grad),
                            ("dv", v.grad, vr.grad)):
        torch.testing.assert_close(got, want, **TOLERANCE[F64], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend,cp,block_size,window", [(FA, 2, 0, 10), (SDPA, 2, 5, 4), (FA, 4, 5, 10),
                                                          (SDPA, 4, 0, 4)])
def test_windowed_ring_step_blocks_varlen_equal_per_piece(backend, cp, block_size, window):
    """Every (rank, source) block of the ring at cp 2 and 4 with a window, merged into given
    accumulators as the ring does: the varlen calls equal the per-piece calls (sdpa_cpu), among
    them windowed full pieces cut into a part without window and a part with one."""
    g = torch.Generator().manual_seed(2)
    shard, taken, cut = SEQ_LEN // cp, 0, False
    for rank, source in itertools.product(range(cp), range(cp)):
        block = tiles(DocumentLayout(_starts(), rank, cp).ring_pieces(source, window), block_size)
        if varlen_plan(block, torch.zeros(1, 1, 1, D), backend) is None:
            continue
        taken += 1
        cut |= any(not s.causal and s.window != NO_WINDOW for calls in varlen_calls(block, block_size)
                   for call in calls for s in call)
        q, k, v = _qkv(shard, F64, seed=rank * cp + source)
        out0, lse0 = torch.randn(q.shape, generator=g, dtype=F64), torch.randn(q.shape[:3], generator=g, dtype=F64)
        dout, dq0 = torch.randn(q.shape, generator=g, dtype=F64), torch.randn(q.shape, generator=g, dtype=F64)
        results = []
        for b in ("sdpa_cpu", backend):
            out, lse = pieces_forward(q, k, v, block, scale=D**-0.5, backend=b, out=out0.clone(), lse=lse0.clone())
            dq, dk, dv = dq0.clone(), torch.zeros_like(k), torch.zeros_like(v)
            pieces_backward(dout, q, k, v, out, lse, block, scale=D**-0.5, backend=b, dq=dq, dk=dk, dv=dv)
            results.append((out, lse, dq, dk, dv))
        for name, want, got in zip(("out", "lse", "dq", "dk", "dv"), *results, strict=True):
            torch.testing.assert_close(got, want, **TOLERANCE[F64],
                                       msg=lambda m: f"rank {rank} source {source} {name}: {m}")
    assert taken >= cp and cut


def test_varlen_windows_against_torchs_meta_kernels():
    """kernels.varlen_forward / varlen_backward ("sdpa_flash") with a window run torch's own ops on
    meta tensors: the window keywords bind to the schema with the call's sides; a call without a
    window passes none (the call torch's SDPA makes)."""
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device="meta")
    q, k, v = (torch.empty(12, h, D, dtype=torch.bfloat16, device="meta") for h in (H, HKV, HKV))
    for window in ((3, 0), NO_WINDOW):
        with RecordedOps() as recorded:
            out, lse = kernels.varlen_forward(q, k, v, cu, cu, 7, 7, causal=True, scale=0.125, backend="sdpa_flash",
                                              window=window)
            dq, dk, dv = kernels.varlen_backward(torch.empty_like(q), q, k, v, out, lse, cu, cu, 7, 7, causal=True,
                                                 scale=0.125, backend="sdpa_flash", window=window)
        for op in ("_flash_attention_forward", "_flash_attention_backward"):
            args = next(a for name, a in recorded.calls if name == op)
            assert args["cum_seq_q"] is not None and args["is_causal"] is True
            got = (args.get("window_size_left"), args.get("window_size_right"))
            assert got == (window if window != NO_WINDOW else (None, None)), (op, got)
        assert out.shape == q.shape and lse.shape == (H, 12) and (dq.shape, dk.shape) == (q.shape, k.shape)


def test_a_varlen_window_on_rocm_is_refused_as_a_per_piece_one(monkeypatch):
    """torch's flash kernel on ROCm reads a window by rules llama-cp has not checked: refused in the
    varlen path as in the per-piece one; the same call without a window runs."""
    monkeypatch.setattr(torch.version, "hip", "6.2")
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device="meta")
    q, k, v = (torch.empty(12, h, D, dtype=torch.bfloat16, device="meta") for h in (H, HKV, HKV))
    with pytest.raises(ValueError, match="sliding-window attention on ROCm"):
        kernels.varlen_forward(q, k, v, cu, cu, 7, 7, causal=True, scale=0.125, backend="sdpa_flash", window=(3, 0))
    kernels.varlen_forward(q, k, v, cu, cu, 7, 7, causal=True, scale=0.125, backend="sdpa_flash")


def test_a_square_without_window_joins_the_windowed_call_only_where_the_window_hides_nothing():
    """A causal square without a window goes into the windowed squares' call only when it is at most
    the window long (left >= its length - 1: the window hides none of its keys); a longer one (a block
    mixing layers, which llama-cp's layouts never make) keeps a call of its own."""
    from llama_cp.attention.documents import Piece

    windowed = Piece(0, slice(0, 10), slice(0, 10), True, 3)  # window of 4 tokens: flash's (3, 0)
    short, long = (Piece(0, slice(a, b), slice(a, b), True, None) for a, b in ((10, 14), (14, 19)))
    ((joined,),) = varlen_calls([windowed, short], 0)
    assert [(s.piece, s.window) for s in joined] == [(windowed, (3, 0)), (short, (3, 0))]
    (calls,) = varlen_calls([windowed, short, long], 0)
    assert [[(s.piece, s.window) for s in call] for call in calls] == [
        [(long, NO_WINDOW)], [(windowed, (3, 0)), (short, (3, 0))]]


@pytest.mark.parametrize("cp", [1, 2])
def test_rows_of_one_document_keep_one_call_for_every_row(cp, monkeypatch):
    """Rows without documents (the layout the windowed layers get: every row one document from 0) are
    not gathered into varlen calls, which would copy the whole local q, k, v for one or two saved
    launches: their pieces are every row's (row None), one call for all rows, as without a window;
    the same as the per-piece calls of separate rows (float32: flash-attn's backward takes a float32 lse)."""
    window, rows = 10, 3
    single = DocumentLayout(torch.zeros(rows, SEQ_LEN, dtype=torch.long), 0, cp, single=True)
    separate = DocumentLayout(torch.zeros(rows, SEQ_LEN, dtype=torch.long), 0, cp)
    block = tiles(single.ring_pieces(0, window), 0)
    assert block and all(p.row is None for p in block) and any(p.lag is not None for p in block)
    assert varlen_plan(block, torch.zeros(1, 1, 1, D), FA) is None
    assert [p._replace(row=0) for p in block] == [p for p in separate.ring_pieces(0, window) if p.row == 0]
    counts = _counted(monkeypatch)
    q, k, v = _qkv(SEQ_LEN // cp, torch.float32, batch=rows)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    results = []
    for layout in (single, separate):
        inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = pieces_attention(*inputs, tiles(layout.ring_pieces(0, window), 0), scale=D**-0.5,
                               backend=FA if layout is single else "sdpa_cpu")
        out.backward(dout)
        results.append((out, *(t.grad for t in inputs)))
    assert counts["forward"] == counts["backward"] == 0
    for name, got, want in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        torch.testing.assert_close(got, want, **TOLERANCE[torch.float32], msg=lambda m: f"{name}: {m}")


def test_an_untiled_block_gathers_at_most_untiled_rows_a_window():
    """Block size 0 (untiled): a window of varlen calls still holds at most UNTILED_ROWS query rows, and
    a call at most as many query and key rows (their gathered copies), unless one piece is longer."""
    from llama_cp.attention.varlen import UNTILED_ROWS

    lengths = [300] * 200 + [UNTILED_ROWS + 5] + [700] * 40  # 100,405 tokens, one document longer than the bound
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    block = DocumentLayout(document_starts(positions)).full_row_pieces(1024)
    windows = varlen_calls(block, 0)
    assert len(windows) > 1 and sorted(s.piece for calls in windows for call in calls for s in call) == sorted(block)
    for calls in windows:
        rows = {s.piece.queries for call in calls for s in call}
        assert sum(stop - start for _, start, stop in rows) <= UNTILED_ROWS or len(rows) == 1
        for call in calls:
            assert len(call) == 1 or sum(s.q.stop - s.q.start for s in call) <= UNTILED_ROWS
            assert len(call) == 1 or sum(s.k.stop - s.k.start for s in call) <= UNTILED_ROWS
