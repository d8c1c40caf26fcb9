"""Document layouts in one process: transformers' boundary rule, pieces that cover exactly the
visible (query, key) pairs, the -inf-safe merge, and no [L, L] tensor with linear peak memory."""

import itertools

import pytest
import torch
from transformers.masking_utils import find_packed_sequence_indices

from llama_cp import apply_context_parallel
from llama_cp.attention.documents import Chunk, DocumentLayout, Span, pieces, spans
from llama_cp.attention.kernels import merge_block
from llama_cp.parallel.sharding import document_starts
from llama_cp.parallel.sharding import zigzag_index
from llama_cp.plan.memory import track_peak_memory

from fsdp_checks import tiny_model
from probes import LargestTensor


def random_positions(g: torch.Generator, seq_len: int, batch: int = 3) -> torch.Tensor:
    """Rows of random document lengths, some continuing a document, one with odd restarts."""
    rows = []
    for _ in range(batch):
        row, first = [], int(torch.randint(0, 5, (1,), generator=g))
        while len(row) < seq_len:
            length = int(torch.randint(1, seq_len // 2 + 2, (1,), generator=g))
            row += range(first, first + length)
            first = int(torch.randint(0, 3, (1,), generator=g))  # restarts at 0, 1 or 2
        rows.append(row[:seq_len])
    return torch.tensor(rows)


def brute_force_visible(starts: torch.Tensor) -> torch.Tensor:
    """(B, L, L) bool: query t sees key s iff start[t] <= s <= t (tiny L only)."""
    idx = torch.arange(starts.shape[1])
    return (idx[None, None, :] >= starts[:, :, None]) & (idx[None, None, :] <= idx[None, :, None])


def test_document_starts_follow_transformers_rule():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        positions = random_positions(g, 40)
        starts = document_starts(positions)
        ids = find_packed_sequence_indices(positions)
        ids = torch.zeros_like(positions) if ids is None else ids
        # same document <=> same start, and a start is the first index of its document
        same_doc = ids[:, :, None] == ids[:, None, :]
        assert torch.equal(same_doc, starts[:, :, None] == starts[:, None, :])
        assert torch.equal(ids.gather(1, starts), ids)
        assert bool((starts <= torch.arange(40)).all())


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_pieces_cover_each_visible_pair_once(cp):
    """Ring: over the cp steps of every rank, and Ulysses: on the gathered row, the pieces
    cover every visible pair exactly once and no other pair."""
    g = torch.Generator().manual_seed(cp)
    seq_len = 48
    for _ in range(10):
        starts = document_starts(random_positions(g, seq_len))
        want = brute_force_visible(starts).int()
        ring = torch.zeros_like(want)
        for rank in range(cp):
            layout = DocumentLayout(starts, cp_rank=rank, cp_size=cp)
            q_rows = zigzag_index(seq_len, cp, rank)
            for source in range(cp):
                k_rows = zigzag_index(seq_len, cp, source)
                for piece in layout.ring_pieces(source):
                    for i, j in itertools.product(q_rows[piece.q].tolist(), k_rows[piece.k].tolist()):
                        if not piece.causal or j <= i:
                            ring[piece.row, i, j] += 1
        assert torch.equal(ring, want)
        full = torch.zeros_like(want)
        for piece in DocumentLayout(starts, cp_rank=0, cp_size=cp).full_row_pieces():
            sub = full[piece.row, piece.q, piece.k]
            sub += torch.ones_like(sub).tril() if piece.causal else 1
        assert torch.equal(full, want)


def test_spans_split_at_documents_and_row_jumps():
    starts = torch.tensor([[0, 0, 2, 2, 2, 2, 6, 6]])
    rows = torch.tensor([0, 1, 2, 3, 6, 7, 8, 9])  # a jump between local 3 and 4
    assert [tuple(s) for s in spans(starts, rows)[0]] == [(0, 0, 2, 0), (2, 2, 2, 2), (4, 6, 2, 2), (6, 8, 2, 6)]
    # a span inside a chunk gets one causal piece; one before it in its document a full piece too
    assert pieces([[Span(4, 6, 2, 2)]], [Chunk(0, 0, 4), Chunk(4, 6, 2)]) == [
        (0, slice(4, 6), slice(2, 4), False, None), (0, slice(4, 6), slice(4, 6), True, None)
    ]
    # a window of 4: rows 6, 7 reach back to rows 3 and 4 (row 3 is local key 3); row 7 misses
    # row 3, so the full piece keeps a lag: local i - j <= 4 - 1 - (6 - 4) + (0 - 0) = 1
    assert pieces([[Span(4, 6, 2, 2)]], [Chunk(0, 0, 4), Chunk(4, 6, 2)], window=4) == [
        (0, slice(4, 6), slice(3, 4), False, 1), (0, slice(4, 6), slice(4, 6), True, None)
    ]
    # a window of 3 reaches row 4 at most, which this rank does not hold: no full piece
    assert pieces([[Span(4, 6, 2, 2)]], [Chunk(0, 0, 4), Chunk(4, 6, 2)], window=3) == [
        (0, slice(4, 6), slice(4, 6), True, None)
    ]


def test_merge_block_handles_rows_that_see_nothing():
    inf = float("-inf")
    out = torch.tensor([[0.0, 0.0], [1.0, 2.0], [0.0, 0.0], [1.0, 1.0]]).reshape(1, 1, 4, 2)
    lse = torch.tensor([inf, 0.5, inf, 0.0]).reshape(1, 1, 4)
    block_out = torch.tensor([[3.0, 4.0], [0.0, 0.0], [0.0, 0.0], [3.0, 3.0]]).reshape(1, 1, 4, 2)
    block_lse = torch.tensor([1.0, inf, inf, 0.0]).reshape(1, 1, 4)
    merge_block(out, lse, block_out, block_lse)
    # empty + block -> block; row + empty -> row; empty + empty -> (0, -inf); equal weights -> mean
    torch.testing.assert_close(out.flatten(), torch.tensor([3.0, 4.0, 1.0, 2.0, 0.0, 0.0, 2.0, 2.0]))
    torch.testing.assert_close(lse.flatten(), torch.tensor([1.0, 0.5, inf, torch.log(torch.tensor(2.0)).item()]))


def packed_positions(seq_len: int, document: int = 64) -> torch.Tensor:
    return (torch.arange(seq_len) % document)[None]


@pytest.mark.slow
def test_no_seq_by_seq_tensor_and_memory_linear_in_length():
    """Document masking builds no [L, L] tensor: the largest tensor is far below L * L / 8
    and the tracked peak of forward+backward grows linearly with L (2x for 2x tokens)."""
    model = apply_context_parallel(tiny_model(), None)
    peaks = {}
    for seq_len in (1024, 2048, 4096):
        input_ids = torch.randint(0, 96, (1, seq_len), generator=torch.Generator().manual_seed(seq_len))
        with LargestTensor() as largest, track_peak_memory(model) as peak:
            model(input_ids=input_ids, position_ids=packed_positions(seq_len)).logits.sum().backward()
        model.zero_grad(set_to_none=True)
        assert largest.numel < seq_len * seq_len // 8, (seq_len, largest.numel, largest.op)
        peaks[seq_len] = peak["Total"]
    assert peaks[2048] / peaks[1024] < 2.1 and peaks[4096] / peaks[2048] < 2.1, peaks
    # the same check sees a quadratic tensor: transformers' own SDPA builds an [L, L] packed mask
    reference = tiny_model()
    with LargestTensor() as largest:
        reference(input_ids=input_ids, position_ids=packed_positions(4096), use_cache=False).logits.sum().backward()
    assert largest.numel >= 4096 * 4096, largest.numel


def test_position_ids_broadcast_over_the_batch():
    """position_ids of shape (1, L) for a batch of 3 rows: every row gets the documents."""
    reference = tiny_model().double()
    model = apply_context_parallel(tiny_model().double(), None)
    input_ids = torch.randint(0, 96, (3, 12), generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]])
    with torch.no_grad():
        want = reference(input_ids=input_ids, position_ids=positions, use_cache=False).logits
        got = model(input_ids=input_ids, position_ids=positions).logits
        whole_row = reference(input_ids=input_ids, use_cache=False).logits
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    assert (want - whole_row).abs().max() > 1e-3


def test_a_layer_that_drops_the_documents_is_refused():
    """Note [Documents a layer drops]: a decoder layer that calls its attention without the keyword
    arguments it got (as transformers 5.24's Nemotron and StableLM layers do) would have its packed rows
    attended as one document; the attention call refuses in one line instead. A batch of one document
    a row hands no layout, and runs."""
    from llama_cp.cp_attention import DOCUMENTS_KWARG

    model = apply_context_parallel(tiny_model().double(), None)
    layer = model.model.layers[1]
    forward = layer.forward

    def dropping(*args, **kwargs):  # the layer's own forward, the layout taken out of its kwargs
        kwargs.pop(DOCUMENTS_KWARG, None)
        return forward(*args, **kwargs)

    layer.forward = dropping
    input_ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with pytest.raises(RuntimeError, match=r"^LlamaAttention was called without the batch's document layout, "
                                               r"which the decoder handed its layers: .*cannot be trained"):
            model(input_ids=input_ids, position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]]))
        model(input_ids=input_ids, position_ids=torch.arange(12)[None])  # one document: no layout handed
