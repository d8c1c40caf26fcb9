"""Single-process checks of the zigzag layout and of ParallelDims validation."""

import pytest
import torch

from llama_cp.mesh import ParallelDims
from llama_cp.sharding import check_seq_len, shard_sequence, unshard_sequence, zigzag_index


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
    from llama_cp.sharding import cp_rank_and_size

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
