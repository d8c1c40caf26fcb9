"""The data position through a checkpoint (llama_cp/train/resume.py): a loader's ``state_dict`` saved as
the trainer saves it (``extra["loader"]``, written by rank 0), and ``load_resumed_state`` restoring
it into a fresh loader of each dp rank; the resumed ranks read exactly the rows the uninterrupted
run reads next, mid-epoch, at an epoch's end and into the next epochs. One process, a gloo group
of one (the checkpoint's barriers). The loader alone: tests/data/test_data.py; a whole run crashed
and resumed: tests/train/test_recipe.py (slow)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from llama_cp.data.loader import DistributedRowLoader
from llama_cp.train.checkpoint import save_checkpoint
from llama_cp.train.resume import load_resumed_state

DP = 2
#: 11 rows, 2 per rank and 2 ranks: 2 steps an epoch, 3 rows left out of each
ROWS = [{"input_ids": torch.full((4,), i), "labels": torch.full((4,), i)} for i in range(11)]


@pytest.fixture
def world_of_one():
    """A process group of one rank for the test (the one already there, if any, is kept)."""
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if started:
        dist.destroy_process_group()


def _loaders() -> list[DistributedRowLoader]:
    return [DistributedRowLoader(ROWS, batch_size=2, dp_rank=rank, dp_size=DP, seed=7) for rank in range(DP)]


def _take(loader: DistributedRowLoader, iterator, count: int):
    """``count`` batches' row numbers, the next epoch started at an epoch's end as the trainer does;
    returns them and the iterator to go on with."""
    taken = []
    while len(taken) < count:
        try:
            taken.append(next(iterator)["input_ids"][:, 0].tolist())
        except StopIteration:
            iterator = iter(loader)
    return taken, iterator


def test_resumed_ranks_read_the_rows_the_uninterrupted_run_reads_next(world_of_one, tmp_path):
    total = 7  # three epochs and a half
    straight = [_take(loader, iter(loader), total)[0] for loader in _loaders()]
    assert straight[0][:2] != straight[0][2:4]  # the epochs are shuffled apart: a lost epoch shows
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for done in (1, 2, 3):  # mid-epoch, at an epoch's end, mid-way through the next epoch
        loaders = _loaders()
        iterators = [iter(loader) for loader in loaders]
        for rank, loader in enumerate(loaders):
            taken, iterators[rank] = _take(loader, iterators[rank], done)
            assert taken == straight[rank][:done]
        path = save_checkpoint(str(tmp_path / f"run{done}"), done, model, optimizer,
                               extra={"loader": loaders[0].state_dict()})  # the trainer's: rank 0's position
        for rank, resumed in enumerate(_loaders()):
            assert load_resumed_state(path, model, optimizer, resumed) == done
            assert resumed.state_dict() == loaders[rank].state_dict()
            rest, _ = _take(resumed, iter(resumed), total - done)
            assert rest == straight[rank][done:], (done, rank)
