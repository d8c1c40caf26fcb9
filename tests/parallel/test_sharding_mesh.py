"""Single-process checks of the zigzag layout and of ParallelDims validation."""

import pytest
import torch

from llama_cp.parallel.mesh import ParallelDims
from llama_cp.parallel.sharding import check_seq_len, shard_sequence, unshard_sequence, zigzag_index


def test_zigzag_index_keeps_head_and_tail_chunks():
    # L=16, cp=2: chunks of 4; rank 0 keeps chunks 0 and 3, rank 1 keeps chunks 1 and 2
    assert zigzag_index(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_index(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_shards_partition_the_sequence_and_unshard_inverts(cp):
    x = torch.arange(3 * 64 * 5).reshape(3, 64, 5)
    shards = [shard_sequence(x, cp, r) for r in range(cp)]
    positions = torch.cat([zigzag_index(64, cp, r) for r in range(cp)])
    assert sorted(positions.tolist()) == list(range(64))
    assert all(s.shape == (3, 64 // cp, 5) for s in shards)
    torch.testing.assert_close(unshard_sequence(shards), x)


def test_zigzag_balances_causal_work():
    """Every rank's query tokens see the same number of keys under the causal mask."""
    cp, seq_len = 4, 64
    work = [int((zigzag_index(seq_len, cp, r) + 1).sum()) for r in range(cp)]
    assert len(set(work)) == 1, work


def test_shard_batch_splits_sequence_tensors_and_adds_positions():
    from llama_cp import shard_batch
    from llama_cp.parallel.sharding import cp_rank_and_size

    assert cp_rank_and_size(None) == (0, 1)
    ids = torch.arange(32).reshape(2, 16)
    batch = {"input_ids": ids, "labels": ids + 100, "num_items": torch.tensor(7), "name": "x"}
    out = shard_batch(batch, None)  # no cp group: the full sequence, with positions added
    torch.testing.assert_close(out["position_ids"], torch.arange(16).expand(2, 16))
    assert out["num_items"].item() == 7 and out["name"] == "x"
    torch.testing.assert_close(out["labels"], ids + 100)


def test_bad_lengths_name_nearest_valid_ones():
    with pytest.raises(ValueError, match=r"100 is not divisible by 2 x cp = 8; pad or truncate it to 96 or 104"):
        check_seq_len(100, 4)
    with pytest.raises(ValueError, match=r"pad or truncate it to 8 \("):
        check_seq_len(6, 4)


def test_parallel_dims_infers_dp_shard():
    dims = ParallelDims(dp_replicate=2, cp=2, world_size=8)
    assert (dims.dp_replicate, dims.dp_shard, dims.cp) == (2, 2, 2)
    assert dims.dp == 4 and dims.fsdp_size == 4


def test_parallel_dims_errors_print_every_degree():
    with pytest.raises(ValueError, match=r"dp_replicate\(1\) \* dp_shard\(3\) \* cp\(2\) != world_size\(8\)"):
        ParallelDims(dp_shard=3, cp=2, world_size=8)
    with pytest.raises(ValueError, match=r"world_size\(8\) is not divisible by dp_replicate\(1\) \* cp\(3\)"):
        ParallelDims(cp=3, world_size=8)
    with pytest.raises(ValueError, match="cp must be >= 1"):
        ParallelDims(cp=0, world_size=8)


def test_document_assignment_balances_one_document():
    """Note [Document-aware sharding]'s example: one document, cp 2, 8 chunks of work 1, 3, ..., 15."""
    from llama_cp.parallel.sharding import document_assignment

    from llama_cp.parallel.sharding import document_chunk_count

    assert document_assignment(torch.arange(16)[None], 2, chunks=8) == [[0, 3, 4, 7], [1, 2, 5, 6]]
    # 16 chunks per rank where the length allows, fewer where it does not (2 x cp always does)
    assert [document_chunk_count(L, cp) for L, cp in ((131072, 8), (96, 4), (96, 3), (20, 2), (14, 7))] == [
        128, 48, 48, 20, 14
    ]


def packed_rows(g: torch.Generator, seq_len: int, rows: int) -> torch.Tensor:
    """position_ids of rows of random documents: many short ones, a few of up to the whole row."""
    result = []
    for _ in range(rows):
        row = []
        while len(row) < seq_len:
            limit = seq_len if torch.rand((), generator=g) < 0.2 else seq_len // 16
            row += range(int(torch.randint(1, limit + 1, (), generator=g)))
        result.append(row[:seq_len])
    return torch.tensor(result)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_document_sharding_gives_equal_tokens_and_balanced_work(cp):
    """Every rank gets the same number of tokens, the ranks' tokens partition the row, and
    the busiest rank's attention work (visible pairs) is within 2% of the mean on every row
    (the zigzag is far off on the same rows)."""
    from llama_cp.parallel.sharding import document_starts, visible_pairs_per_token
    from llama_cp.parallel.sharding import document_index

    g, seq_len = torch.Generator().manual_seed(cp), 2048
    worst, worst_zigzag = 1.0, 1.0
    for positions in packed_rows(g, seq_len, 16):
        positions = positions[None]
        work = visible_pairs_per_token(document_starts(positions)).double()
        index = [document_index(positions, cp, r) for r in range(cp)]
        assert all(i.shape == (seq_len // cp,) for i in index)
        assert sorted(torch.cat(index).tolist()) == list(range(seq_len))
        per_rank = torch.stack([work[i].sum() for i in index])
        zigzag = torch.stack([work[zigzag_index(seq_len, cp, r)].sum() for r in range(cp)])
        worst = max(worst, float(per_rank.max() / per_rank.mean()))
        worst_zigzag = max(worst_zigzag, float(zigzag.max() / zigzag.mean()))
    assert worst < 1.02 and worst_zigzag > 1.2, (worst, worst_zigzag)


def test_shard_batch_refuses_unknown_layouts_and_chunk_counts():
    from llama_cp.parallel.sharding import shard_batch

    batch = {"input_ids": torch.zeros(1, 16, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"^unknown sharding layout 'zig'; choose one of \('zigzag', 'documents'\)$"):
        shard_batch(batch, None, layout="zig")
    with pytest.raises(ValueError, match=r"chunk count that is a multiple of cp \(1\) and divides the sequence "
                                         r"length \(16\); got chunks=3 \(0 chooses one\)$"):
        shard_batch(batch, None, layout="documents", chunks=3)


def test_document_layout_at_cp_1_is_the_row_and_unshard_inverts_any_order():
    from llama_cp.parallel.sharding import SEQ_INDEX, shard_batch, unshard

    batch = {"input_ids": torch.arange(32).view(2, 16), "position_ids": torch.tensor([[0, 1, 2, 3] * 4] * 2)}
    local = shard_batch(batch, None, layout="documents")
    assert torch.equal(local["input_ids"], batch["input_ids"]) and local[SEQ_INDEX].tolist() == list(range(16))
    order = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(unshard(batch["input_ids"][:, order], None, seq_index=order), batch["input_ids"])
