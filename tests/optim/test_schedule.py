"""The learning-rate schedule (llama_cp/optim/schedule.py), step by step: the warm-up ramp, the peak,
the decay to --min_lr_ratio, against a table written out by hand and against transformers' own
schedules; and the rate each optimizer step is given through ``start_schedule``, from step 0 and
restarted at a resumed step.

The ramp: optimizer step s (0-based) of a warm-up of W steps uses --lr * (s + 1) / (W + 1), so
the first step learns (--lr / (W + 1), never 0) and step W is the first at the full --lr; the
decay runs from step W (progress 0) to the last step T (progress 1). That is transformers'
``get_*_schedule_with_warmup`` with W + 1 warm-up steps of T + 1, read one step on: transformers'
own step 0 is the lr-0 step this schedule leaves out.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers.optimization import (
    get_constant_schedule_with_warmup,
    get_cosine_with_min_lr_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)

from llama_cp.config import OptimConfig
from llama_cp.optim.schedule import lr_factor, start_schedule

TOTAL = 12


def _transformers_factors(scheduler: str, warmup: int, total: int, floor: float) -> list[float]:
    """transformers' factor of each of our steps 0 .. total (module docstring: one step on)."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    if scheduler == "cosine":
        schedule = get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup + 1, total + 1, min_lr_rate=floor)
    elif scheduler == "linear":  # decays to 0: compared with --min_lr_ratio 0 only
        schedule = get_linear_schedule_with_warmup(optimizer, warmup + 1, total + 1)
    else:
        schedule = get_constant_schedule_with_warmup(optimizer, warmup + 1)
    factor = schedule.lr_lambdas[0]
    return [factor(step + 1) for step in range(total + 1)]


def test_the_ramp_and_the_decay_written_out():
    """Warm-up 3 of 7 steps, cosine to 0.1: the first step at a quarter of --lr, the peak at step 3."""
    optim = OptimConfig(lr=1.0, warmup_steps=3, lr_scheduler="cosine", min_lr_ratio=0.1)
    got = [lr_factor(step, 7, optim) for step in range(9)]
    half_cosine = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(5)]  # steps 3 .. 7
    want = [0.25, 0.5, 0.75, *half_cosine, 0.1]  # step 8, past the end: the floor
    assert got == pytest.approx(want, abs=1e-12)
    assert got[0] > 0 and got[3] == 1.0 and max(got) == 1.0


@pytest.mark.parametrize("warmup", [0, 1, 2, 5])
@pytest.mark.parametrize(("scheduler", "floor"), [("cosine", 0.0), ("cosine", 0.1), ("linear", 0.0), ("constant", 0.0)])
def test_each_step_matches_transformers_schedule(scheduler, floor, warmup):
    optim = OptimConfig(lr=1.0, warmup_steps=warmup, lr_scheduler=scheduler, min_lr_ratio=floor)
    got = [lr_factor(step, TOTAL, optim) for step in range(TOTAL + 1)]
    assert got == pytest.approx(_transformers_factors(scheduler, warmup, TOTAL, floor), abs=1e-12)
    assert got[0] == pytest.approx(1 / (warmup + 1))  # the first step learns: never lr 0
    assert all(a < b for a, b in zip(got[: warmup + 1], got[1 : warmup + 1]))  # strictly up to the peak
    assert got[warmup] == 1.0 and max(got) == 1.0  # the peak at step warmup, and nowhere higher
    assert got[TOTAL] == pytest.approx(floor if scheduler != "constant" else 1.0)


@pytest.mark.parametrize("warmup", [0, 1, 3])
def test_the_optimizer_steps_at_each_steps_rate_also_when_restarted(warmup):
    """The rate in the param groups at each optimizer.step() is --lr x lr_factor(step), from step 0 and
    from a schedule started afresh at a resumed step (Note [Changing settings on resume])."""
    optim = OptimConfig(lr=0.02, warmup_steps=warmup, lr_scheduler="cosine", min_lr_ratio=0.1)
    want = [0.02 * lr_factor(step, TOTAL, optim) for step in range(TOTAL)]

    def rates(first: int) -> list[float]:
        param = torch.nn.Parameter(torch.zeros(2))
        optimizer = torch.optim.SGD([param], lr=123.0)  # start_schedule writes --lr in
        scheduler = start_schedule(optimizer, optim, TOTAL, first)
        seen = []
        for _ in range(first, TOTAL):
            param.grad = torch.ones_like(param)
            seen.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return seen

    assert rates(0) == pytest.approx(want, rel=1e-12)
    assert rates(0)[0] == pytest.approx(0.02 / (warmup + 1))
    for resumed in (1, warmup, warmup + 2):
        assert rates(resumed) == pytest.approx(want[resumed:], rel=1e-12), resumed


@pytest.mark.parametrize("total", [9, 10, 11, 12])
def test_the_start_line_says_when_the_warm_up_outlasts_the_run(total):
    """A run whose last step is still warming up never uses --lr: its start line says so, exactly
    when no step's rate is --lr (warm-up 10: runs of 10 steps or fewer)."""
    from llama_cp.config import TrainConfig
    from llama_cp.flags.defaults import said_defaults

    cfg = TrainConfig.from_flags(model_name="org/llama", dataset="org/texts", max_steps=total)
    cfg.save_every = cfg.resolved_save_every(total)
    reached = max(lr_factor(step, total, cfg.optim) for step in range(total)) == 1.0
    line = said_defaults(cfg, total)
    assert line.startswith(f"{total} steps (--max_steps {total}), --lr 2e-05")
    assert ("(not reached: --warmup_steps 10 is longer than the run)" in line) == (not reached), line
    assert reached == (total > 10)
