"""What fits a GPU: the bytes a GPU leaves to tensors, and the longest context whose planned
step (``llama_cp.plan.simulate.plan_step_memory``) fits in them."""

from __future__ import annotations

import copy

from llama_cp.config import TrainConfig
from llama_cp.plan import simulate
from llama_cp.plan.memory import GiB, MemoryBreakdown
from llama_cp.plan.simulate import load_model_config


def usable_bytes(gpu_memory_gb: float, headroom: float) -> int:
    """Bytes of a GPU of ``gpu_memory_gb`` GiB left to tensors after ``headroom`` (a fraction,
    for the CUDA context, NCCL/cuBLAS workspaces and the allocator's fragmentation)."""
    if not 0 <= headroom < 1:
        raise ValueError(f"--headroom is a fraction of the GPU memory in [0, 1), got {headroom}")
    return int(gpu_memory_gb * GiB * (1.0 - headroom))


def with_context(cfg: TrainConfig, context_length: int, **parallel) -> TrainConfig:
    """A copy of ``cfg`` with another context length (and optionally other parallel degrees)."""
    new = copy.deepcopy(cfg)
    new.data.context_length = context_length
    for name, value in parallel.items():
        setattr(new.parallel, name, value)
    return new


def find_max_context(
    cfg: TrainConfig, world_size: int, budget_bytes: int, *, model_config=None, granularity: int | None = None,
    limit: int = 1 << 26,
) -> tuple[int, MemoryBreakdown | None]:
    """The largest context length, a multiple of ``granularity`` (default and minimum: 2 x cp),
    whose planned peak per rank fits in ``budget_bytes``, and its breakdown; (0, None) when
    even ``granularity`` tokens do not fit.

    Memory grows with the context length and is close to affine in it, so the search takes
    secant steps from two lengths to a guess, then gallops from the guess to a bracket
    [fits, does not fit] and bisects it: the answer of a bisection from scratch in a few
    plans instead of ~30. ``limit`` caps the search.
    """
    config = model_config if model_config is not None else load_model_config(cfg.model.model_name)
    step = granularity or 2 * cfg.parallel.cp  # the context is searched in units of this many tokens
    if step % (2 * cfg.parallel.cp):
        raise ValueError(f"granularity {step} must be a multiple of 2 x cp = {2 * cfg.parallel.cp}")
    cache: dict[int, MemoryBreakdown] = {}

    def plan(units: int) -> MemoryBreakdown:
        if units not in cache:
            cache[units] = simulate.plan_step_memory(with_context(cfg, units * step), world_size, model_config=config)
        return cache[units]

    def fits(units: int) -> bool:
        return plan(units).total <= budget_bytes

    max_units = limit // step
    if not fits(1):
        return 0, None
    # secant steps on the (nearly affine) total from two lengths -> a close first guess
    x0, x1 = min(max(1, 8192 // step), max_units), min(max(2, 65536 // step), max_units)
    guess = x1
    for _ in range(4):
        y0, y1 = plan(x0).total, plan(x1).total
        if y1 <= y0 or x1 == x0:  # flat here (e.g. the optimizer phase is the peak): gallop up from x1
            guess = x1
            break
        guess = min(max(int(x1 + (budget_bytes - y1) * (x1 - x0) / (y1 - y0)), 1), max_units)
        if abs(guess - x1) <= 1:
            break
        x0, x1 = x1, guess
    # gallop from the guess: low fits, high does not (or is past the limit)
    low, high, stride = guess, guess + 1, 1
    if fits(low):
        while high <= max_units and fits(high):
            low, high, stride = high, high + 2 * stride, 2 * stride
        high = min(high, max_units + 1)
    else:
        high = low
        while True:
            low = max(1, high - stride)
            if fits(low):
                break
            high, stride = low, 2 * stride
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low * step, plan(low)
