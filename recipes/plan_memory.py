"""Does a long-context fine-tune fit, and how long can the context be? Plans one rank's memory.

    python -m recipes.plan_memory --model_name llama3-8b --context_length 131072 --num_gpus 8 --cp 8 --use_peft
    python -m recipes.plan_memory --model_name llama3-8b --num_gpus 8 --cp 8 --find_max_context
    python -m recipes.plan_memory --model_name llama3-8b --use_peft --plot max_context.png

Runs the trainer's own model build and optimizer step for one simulated rank under fake
tensors (``llama_cp.plan.simulate``), in seconds on a CPU. Training flags are the trainer's
(``llama_cp/config.py``, also from ``--config preset.yaml``); the planner adds:

    --num_gpus          world size of the planned job (default 8)
    --gpu_memory_gb     memory of one GPU in GiB (default 80)
    --headroom          fraction of it kept free for the CUDA context, NCCL and fragmentation (0.1)
    --find_max_context  also search the largest context that fits (a multiple of 2 x cp)
    --context_step N    search the context in steps of N tokens (a multiple of 2 x cp; default 2 x cp)
    --plot PATH         PNG: max context vs number of GPUs (1..32), FSDP only vs FSDP + CP,
                        each rounded down to a multiple of 1024 tokens
    --breakdown         also list the tensors the step creates that are alive at its peak, grouped by
                        dtype, shape, op and the code that made them, with bytes per token
                        (llama_cp/plan/breakdown.py; simulates every layer: a minute for 32)
    --json              print one JSON object as the last line
    --memory auto       first choose the levers as the trainer's --memory auto does, then plan
                        (and search the max context) with them

--attention_backend names the GPU attention kernel whose workspace the plan includes; "auto"
(default) plans what an sm80+ GPU with flash-attn installed runs: flash_attn in bf16/fp16, and
sdpa_efficient for the layers whose heads are over 256 (Gemma 4's full layers) (Note [GPU attention
kernels' workspace] in llama_cp/attention/workspace.py). sdpa_cpu plans the CPU kernel.
"""

from __future__ import annotations

import json as json_lib


from llama_cp.attention.workspace import ModelledBackend
from llama_cp.config import TrainConfig
from llama_cp.train.cli import run_cli
from llama_cp.plan.fit import find_max_context as search_max_context  # main's flag has the same name
from llama_cp.plan.fit import usable_bytes, with_context
from llama_cp.plan.memory import GiB, MemoryBreakdown
from llama_cp.plan.simulate import load_model_config, plan_step_memory, planned_attention_backend

#: Planner defaults where they differ from the trainer's (flags and --config override them).
PLAN_DEFAULTS = {"model_name": "llama3-8b", "context_length": 131072, "gpu_memory_gb": 80.0}

PLOT_GPUS = (1, 2, 4, 8, 16, 32)
#: The plot's (and table's) search step in tokens: a multiple of 2 x cp for every cp <= 512.
PLOT_GRANULARITY = 1024


def build_config(config: str | None, num_gpus: int, flags: dict) -> TrainConfig:
    """The TrainConfig of the planned job; its degrees checked against ``--num_gpus``.
    PLAN_DEFAULTS fill what neither the preset nor the flags set (a preset for a real
    checkpoint usually leaves --model_name to the command line)."""
    preset = preset_flag_names(config) if config is not None else set()
    flags = {**{k: v for k, v in PLAN_DEFAULTS.items() if k not in preset}, **flags}
    cfg = TrainConfig.from_flags(config, **flags)
    try:
        cfg.parallel.dims(num_gpus)
    except ValueError as error:
        raise ValueError(f"--num_gpus {num_gpus} does not match the parallel degrees: {error}") from None
    return cfg


def resolved_defaults() -> dict:
    """Every flag's value in a plan given no flags (PLAN_DEFAULTS, and the auto settings resolved for
    that model: Note [Defaults by run] in llama_cp/flags/defaults.py), as --help shows them."""
    import inspect

    return TrainConfig.flatten(build_config(None, inspect.signature(main).parameters["num_gpus"].default, {}).to_dict())


def preset_flag_names(path: str) -> set[str]:
    """The flags a YAML preset sets (flat or nested by section)."""
    import yaml

    with open(path) as f:
        preset = yaml.safe_load(f) or {}
    return set(TrainConfig.flatten(preset))


def describe(cfg: TrainConfig, num_gpus: int, attention_backend: str) -> str:
    p, m = cfg.parallel, cfg.model
    dims = p.dims(num_gpus)
    tuning = f"LoRA r={cfg.peft.lora_r}" if cfg.peft.use_peft else "full fine-tune"
    if cfg.peft.quantization == "4bit":
        tuning = f"QLoRA (NF4 base) r={cfg.peft.lora_r}"
    return (
        f"{m.model_name}, {tuning}, {cfg.data.context_length} tokens x batch {cfg.data.batch_size}, "
        f"{num_gpus} GPUs = dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard} x cp {dims.cp} "
        f"({p.cp_strategy}), dtype {m.dtype}, activation checkpointing {'on' if m.activation_checkpointing else 'off'}, "
        f"{cfg.optim.optimizer}, attention {attention_backend}{levers(cfg)}"
    )


def levers(cfg: TrainConfig) -> str:
    """The long-context levers that are on, for the description line."""
    m = cfg.model
    on = [f"{flag} {value}" for flag, value in (
        ("frozen_dtype", m.frozen_dtype if m.frozen_dtype != "auto" else None),
        ("offload_checkpoints", "on" if m.offload_checkpoints else None),
        ("mlp_tile_size", m.mlp_tile_size or None), ("norm_tile_size", m.norm_tile_size or None),
        ("loss_chunk_size", m.loss_chunk_size or None),
        ("gradient_accumulation_steps", cfg.optim.gradient_accumulation_steps
         if cfg.optim.gradient_accumulation_steps > 1 else None),
    ) if value is not None]
    return f", {', '.join(on)}" if on else ""


#: GPUs per node, for the host memory a node needs (a job of fewer GPUs: all on one node).
GPUS_PER_NODE = 8


def host_contents(plan: MemoryBreakdown) -> str:
    """What the host bytes of ``plan`` hold: --offload_params' sharded state, the offloaded checkpoints."""
    state = plan.tracked.get("Host State", 0)
    parts = ["sharded parameters, gradients and AdamW state (--offload_params)" if state else "",
             "offloaded checkpoint inputs (--offload_checkpoints)" if plan.host > state else ""]
    return " and ".join(part for part in parts if part)


def table(plan: MemoryBreakdown, budget: int, gpu_memory_gb: float, headroom: float, num_gpus: int = 1) -> str:
    gpus_per_node = min(num_gpus, GPUS_PER_NODE)
    rows = [(name, value) for name, value in plan.to_dict().items() if name != "total"]
    lines = [f"  {name:<14}{value / GiB:>10.2f} GiB" for name, value in rows]
    verdict = "fits" if plan.total <= budget else "does NOT fit"
    lines.append(f"  {'total':<14}{plan.total / GiB:>10.2f} GiB  per rank (peak)")
    if plan.host:
        lines.append(f"  {'host memory':<14}{plan.host / GiB:>10.2f} GiB  per rank, pinned (not GPU memory): "
                     f"{host_contents(plan)}; a node of {gpus_per_node} GPU{'s' * (gpus_per_node > 1)} needs "
                     f"{gpus_per_node * plan.host / GiB:.2f} GiB")
    lines.append(
        f"  {verdict} in {budget / GiB:.2f} GiB ({gpu_memory_gb:g} GiB GPU, {headroom:.0%} kept for "
        "CUDA context, NCCL and fragmentation)"
    )
    return "\n".join(lines)


def plot_max_context(cfg: TrainConfig, config, budget: int, path: str, gpu_memory_gb: float) -> list[dict]:
    """Max context vs number of GPUs: FSDP only (cp=1, every GPU shards parameters) vs
    FSDP + CP (cp = number of GPUs), for ``cfg`` and the HF model ``config``. Returns the
    points and writes the PNG."""
    points = []
    for gpus in PLOT_GPUS:
        for layout, cp in (("FSDP only", 1), ("FSDP + CP", gpus)):
            if layout == "FSDP + CP" and cfg.parallel.cp_strategy == "ulysses" and config.num_attention_heads % cp:
                continue
            planned = with_context(cfg, cfg.data.context_length, cp=cp, dp_shard=-1, dp_replicate=1)
            length, _ = search_max_context(planned, gpus, budget, model_config=config, granularity=PLOT_GRANULARITY)
            points.append({"num_gpus": gpus, "layout": layout, "max_context_length": length})
            print(f"  {gpus:>3} GPUs  {layout:<10} max context {length:>10,}", flush=True)
    tuning = ("QLoRA" if cfg.peft.quantization == "4bit" else "LoRA") if cfg.peft.use_peft else "full FT"
    ckpt = ", act. ckpt" if cfg.model.activation_checkpointing else ""
    draw_max_context(points, path, f"{cfg.model.model_name} {tuning}{ckpt}, {gpu_memory_gb:g} GiB GPUs")
    return points


def draw_max_context(points: list[dict], path: str, title: str) -> None:
    """The PNG of :func:`plot_max_context`'s points (a length of 0: nothing fits, not drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for layout, style in (("FSDP only", "s--"), ("FSDP + CP", "o-")):
        mine = [p for p in points if p["layout"] == layout and p["max_context_length"] > 0]
        ax.plot([p["num_gpus"] for p in mine], [p["max_context_length"] for p in mine], style, label=layout)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(PLOT_GPUS, [str(g) for g in PLOT_GPUS])
    ax.yaxis.set_major_formatter(FuncFormatter(
        lambda y, _: f"{y / (1 << 20):g}M" if y >= 1 << 20 else f"{y / 1024:g}K"
    ))
    ax.set_xlabel("GPUs")
    ax.set_ylabel("max context (tokens)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(
    config: str | None = None,
    num_gpus: int = 8,
    find_max_context: bool = False,
    context_step: int | None = None,
    plot: str | None = None,
    breakdown: bool = False,
    json: bool = False,
    **flags,
) -> None:
    """Plan one rank's peak memory; see the module docstring for the flags."""
    cfg = build_config(config, num_gpus, flags)
    gpu_memory_gb, headroom = cfg.model.gpu_memory_gb, cfg.model.headroom  # the trainer's flags, 80 GiB here
    budget = usable_bytes(gpu_memory_gb, headroom)
    config_hf = load_model_config(cfg.model.model_name)
    backend = planned_attention_backend(cfg, config_hf)  # refused here in one line if it cannot be planned
    if flags.get("memory") == "auto":  # the trainer's choice of levers (llama_cp/plan/auto.py): its plan is this one
        from llama_cp.plan.auto import apply_levers, choose_levers

        choice = choose_levers(cfg, num_gpus, budget, model_config=config_hf)
        print(f"--memory auto: {choice.describe()} -> planned peak {choice.plan.total / GiB:.2f} GiB "
              f"({choice.plans} plans{', from the cache' if not choice.plans else ''})")
        apply_levers(cfg, choice.levers)
        plan = choice.plan
    else:
        plan = plan_step_memory(cfg, num_gpus, model_config=config_hf)
    print(describe(cfg, num_gpus, backend.describe() if isinstance(backend, ModelledBackend) else backend))
    print(table(plan, budget, gpu_memory_gb, headroom, num_gpus))
    result = {
        "per_rank_bytes": plan.to_dict(),
        "host_bytes_per_rank": plan.host,
        "host_bytes_per_node": min(num_gpus, GPUS_PER_NODE) * plan.host,
        "fits": plan.total <= budget,
        "gpu_memory_bytes": int(gpu_memory_gb * GiB),
        "usable_bytes": budget,
        "attention_backend": backend,
        **({"attention_backend_heads_over_256": "sdpa_efficient"}
           if isinstance(backend, ModelledBackend) and backend.auto else {}),
    }
    if breakdown:
        from llama_cp.plan.breakdown import describe_groups, step_peak_tensors

        tokens = cfg.data.context_length // cfg.parallel.cp
        print(f"tensors made in the step and alive at its peak (T = {tokens:,} tokens per rank):")
        print(describe_groups(step_peak_tensors(cfg, num_gpus, model_config=config_hf), tokens))
    if find_max_context:
        length, at_max = search_max_context(cfg, num_gpus, budget, model_config=config_hf, granularity=context_step)
        result["max_context_length"] = length
        if at_max is None:
            print("max context: not even the shortest context fits")
        else:
            host = f", {at_max.host / GiB:.2f} GiB host memory per rank" if at_max.host else ""
            print(f"max context: {length:,} tokens ({at_max.total / GiB:.2f} GiB per rank{host})")
            result["max_context_per_rank_bytes"] = at_max.to_dict()
            result["max_context_host_bytes_per_rank"] = at_max.host
    if plot:
        print(f"max context vs GPUs ({'LoRA' if cfg.peft.use_peft else 'full'}):")
        result["plot"] = plot_max_context(cfg, config_hf, budget, plot, gpu_memory_gb)
        print(f"wrote {plot}")
    if json:
        print(json_lib.dumps(result))


if __name__ == "__main__":
    run_cli(main, usage="python -m recipes.plan_memory [--config preset.yaml] [--num_gpus N] [--gpu_memory_gb G] "
                        "[--headroom F] [--find_max_context] [--plot PNG] [--breakdown] [--json] [--flag value ...] [--debug]",
            defaults=resolved_defaults())
