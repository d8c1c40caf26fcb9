"""``ShardLocalOptimizer`` (``--optimizer adamw8bit``) alone, on plain tensors: what bitsandbytes is
given. The FSDP2 case (LoRA A with fewer rows than ranks) is checked in test_fsdp.py."""

import pytest
import torch
from torch import nn

from llama_cp.optim.optimizers import ShardLocalOptimizer

from probes import bnb_cpu_optimizer_problem

bnb = pytest.importorskip("bitsandbytes")
if bnb_cpu_optimizer_problem():
    pytest.skip(bnb_cpu_optimizer_problem(), allow_module_level=True)


def test_empty_shards_never_reach_bitsandbytes():
    empty, rows = nn.Parameter(torch.zeros(0, 8)), nn.Parameter(torch.linspace(-1, 1, 16).reshape(2, 8))
    reference = nn.Parameter(rows.detach().clone())
    optimizer = ShardLocalOptimizer([empty, rows], bnb.optim.AdamW8bit, lr=0.1, weight_decay=0.1)
    ref_optimizer = bnb.optim.AdamW8bit([reference], lr=0.1, weight_decay=0.1)
    assert [p.shape for group in optimizer.param_groups for p in group["params"]] == [(2, 8)]
    updated = []
    inner_update = optimizer.inner.update_step
    optimizer.inner.update_step = lambda group, p, *index: (updated.append(p.shape), inner_update(group, p, *index))
    for step in range(2):
        empty.grad = torch.zeros(0, 8)
        rows.grad = reference.grad = torch.full((2, 8), 0.5 - step)
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        assert empty.grad is None and rows.grad is None
    assert updated == [(2, 8), (2, 8)]
    torch.testing.assert_close(rows, reference, rtol=0, atol=0)


def test_a_rank_that_owns_no_element_keeps_a_schedule_and_an_empty_state():
    empty = nn.Parameter(torch.zeros(0, 8))
    optimizer = ShardLocalOptimizer([empty], bnb.optim.AdamW8bit, lr=0.1, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))
    empty.grad = torch.zeros(0, 8)
    optimizer.step()
    scheduler.step()
    assert optimizer.inner is None and optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    again = ShardLocalOptimizer([nn.Parameter(torch.zeros(0, 8))], bnb.optim.AdamW8bit, lr=0.1, weight_decay=0.0)
    again.load_state_dict(optimizer.state_dict())
    assert again.param_groups[0]["lr"] == pytest.approx(0.05) and not again.state
