"""Part 2 of the GPU acceptance run, memory: the planner's per-step peak of each memory lever against
``torch.cuda.max_memory_allocated`` of a real step of the same job."""

from __future__ import annotations

from typing import Any

from benchmarks.gpu.settings import Settings, llama_config, set_flags
from llama_cp.config import TrainConfig

#: The memory levers of part 2: name -> flags.
LEVERS = {
    "none": {},
    "activation_checkpointing": {"activation_checkpointing": True},
    "+ offload_checkpoints": {"activation_checkpointing": True, "offload_checkpoints": True},
    "+ tiled mlp, norms": {"activation_checkpointing": True, "mlp_tile_size": 8192, "norm_tile_size": 8192},
    "lora": {"activation_checkpointing": True, "use_peft": True},
}


def memory_jobs(s: Settings) -> list[dict]:
    """Part 2's steps: each lever at each length, cp = N."""
    jobs = []
    for lever, flags in LEVERS.items():
        for length in s.memory_lens:
            jobs.append({"id": f"memory/{lever}/{length}", "kind": "step",
                         "args": dict(context_length=length, cp=s.nproc, flags=flags)})
    return jobs


def planned_peak(settings: Settings, context_length: int, flags: dict) -> int:
    """The planner's per-step peak bytes of one rank for that step (cp = N)."""
    from llama_cp.plan.simulate import plan_step_memory

    cfg = TrainConfig()
    cfg.data.context_length, cfg.parallel.cp = context_length, settings.nproc
    set_flags(cfg, flags)
    return plan_step_memory(cfg, settings.nproc, model_config=llama_config(settings.model)).total


def planned_peaks(s: Settings) -> dict[tuple[str, int], int]:
    """The planner's per-step peak of every (lever, length) of part 2, planned in this process."""
    planned = {}
    for lever, flags in LEVERS.items():
        for length in s.memory_lens:
            planned[lever, length] = planned_peak(s, length, flags)
    return planned


def memory_rows(s: Settings, results: dict[str, dict], planned: dict[tuple[str, int], int]) -> list[dict[str, Any]]:
    """The report's ``memory``: planned and measured bytes of each lever and length."""
    rows = []
    for lever, flags in LEVERS.items():
        for length in s.memory_lens:
            measured = results[f"memory/{lever}/{length}"]
            got = measured.get("measured_peak_bytes")
            rows.append({"lever": lever, "context_length": length, "planned_bytes": planned[lever, length],
                         "measured_bytes": got, "error": measured.get("error"),
                         "planned_over_measured": planned[lever, length] / got if got else None})
    return rows
