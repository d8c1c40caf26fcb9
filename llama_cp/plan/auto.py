"""``--memory auto``: the cheapest memory levers whose planned peak fits the GPU (issue 37).

    choice = choose_levers(cfg, world_size=8, budget_bytes=usable_bytes(80, 0.1))
    apply_levers(cfg, choice.levers)       # what the trainer does on CUDA
    record = choose_for_run(cfg, world_size, device_type, gpu_memory_bytes, say)   # ... all of it

Note [Choosing the memory levers]
=================================

Every memory lever is exact (the step computes the same numbers) and costs time, so a run
wants the fewest, the cheapest first. The candidates are cumulative, from least to most
costly in time, and each is planned (``plan_step_memory``: one rank of the whole job under
fake tensors) until one fits ``--gpu_memory_gb`` less ``--headroom``:

    candidate  levers                               what it costs
    ---------  -----------------------------------  ------------------------------------------
    1          none                                 -
    2          + activation checkpointing            each decoder layer's forward runs twice
    3          + attention blocks of 16384           more, smaller kernel calls; fp32 merges
    4          + MLP/norm tiles of 8192              smaller GEMMs; a tile's recompute in backward
    5          + checkpoint offload                  pinned host memory; copies on a side stream
    6          + parameter offload (full FT only)    every layer's weights over PCIe each step,
                                                    AdamW on the CPU (0.61x tokens/s on an H200)

    plan 1 -> fits? -> no -> plan 2 -> fits? -> ... -> the first that fits is the run's
                                                       none fits: refused, one line

Frozen bf16 (issue 37 lists it third) is in every candidate where it is exact: with LoRA and
bf16 compute ``--frozen_dtype auto`` already stores the frozen base in bf16, which costs no
time (the weights are gathered and computed in bf16 either way). With float32 compute it
would round the base weights, a change of the math that auto does not make; so it is never
a step of its own. ``--offload_params`` is a step for a full fine-tune with torch's AdamW only:
the flag is for a full fine-tune whose state does not fit, it is refused with 4-bit weights and
8-bit AdamW, and its exactness is tested for a full fine-tune (tests/model/test_levers_world2.py).
The tiles are 8192 tokens, what ``benchmarks/gpu_acceptance.py`` measures: a tile's GEMMs
(8192 x 4096 by 4096 x 14336 for Llama-3-8B) are large enough to keep a GPU busy, and a tile's
MLP intermediates (84 KiB per token) are 0.66 GiB instead of the whole sequence's 10.5 GiB at
128K tokens.
The norms are not tiled with ``--lora_modules_to_save`` (their trainable copies are out of the
tiling's reach: ``parallelize_model`` refuses the pair).

When even the last candidate does not fit, the run is refused in one line with its planned
peak and the longest context that fits with it (``find_max_context`` in steps of about 1/32
of the asked context, a few plans). A planner that cannot plan the run (``--cp_strategy
allgather`` or hybrid, ``--optimizer adamw8bit``, ``--use_dora``, a model it cannot build)
leaves the levers as given, and the run says why.

The choice is cached (``cache_dir``, default ``$XDG_CACHE_HOME/llama_cp/memory_auto``, else
``~/.cache/...``), one JSON file per key: a hash of every flag that can change a step's memory,
the world size, the budget, the model's config, the versions of torch, transformers and peft,
and the source of the llama_cp package (a changed planner plans again). A refusal is cached
too. A second start of the same job reads its file and plans nothing.

In the trainer every rank chooses, before the process group exists (each rank is a process of
its own, and the planner needs torch.distributed uninitialised): the plans are deterministic,
so every rank reaches the same levers with nothing sent. Where a process group is already up
(a second run in one notebook) the planning runs in a child process, ``python -m
llama_cp.plan.auto``, which reads the request as JSON on stdin and answers one JSON line.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llama_cp.config import TrainConfig
from llama_cp.files import write_text

if TYPE_CHECKING:
    from llama_cp.plan.memory import MemoryBreakdown

# The planner (llama_cp.plan.simulate, FSDPMemTracker and the modelled kernels) is imported where
# a plan is made: a run that plans nothing (--memory manual, a CPU without --gpu_memory_gb) does
# not pay for its import.
GiB = 1 << 30

#: --attention_block_size of the attention-blocks step (the flag's default).
BLOCK_SIZE = 16384
#: --mlp_tile_size and --norm_tile_size of the tiles step (Note [Choosing the memory levers]).
TILE_SIZE = 8192

#: Every lever auto sets, off: the first candidate.
NO_LEVERS = {"activation_checkpointing": False, "attention_block_size": 0, "mlp_tile_size": 0, "norm_tile_size": 0,
             "offload_checkpoints": False, "offload_params": False}

#: Flags that cannot change a step's memory: left out of the cache key, so that another output
#: directory, seed or learning rate reads the same choice.
_NOT_MEMORY = {
    "output_dir", "resume", "overwrite", "allow_unverified_checkpoint", "max_steps", "num_epochs", "eval_every",
    "save_every", "keep_last", "log_every", "max_nonfinite_steps", "collective_timeout", "report_to",
    "data_cache_dir", "data_cache_shared", "num_proc", "peak_tflops", "eval_needle", "eval_perplexity",
    "export_dtype", "merge_lora", "seed", "lr", "warmup_steps", "lr_scheduler", "min_lr_ratio",
    "memory", "gpu_memory_gb", "headroom",  # the budget is in the key as bytes
}


class NothingFits(ValueError):
    """Even the last candidate's planned peak is over the budget. ``peak_bytes``: that peak;
    ``max_context``: the longest context that fits with it (0: none)."""

    def __init__(self, message: str, peak_bytes: int, max_context: int):
        super().__init__(message)
        self.peak_bytes, self.max_context = peak_bytes, max_context


@dataclass(frozen=True)
class LeverChoice:
    """What :func:`choose_levers` chose: the levers (every key of ``NO_LEVERS``), their planned
    step peak, and the plans it took (0: read from the cache)."""

    levers: dict[str, Any]
    plan: MemoryBreakdown
    plans: int

    def describe(self) -> str:
        return describe_levers(self.levers)


def candidates(cfg: TrainConfig) -> list[dict[str, Any]]:
    """The levers of each candidate for ``cfg``, cumulative, least costly in time first
    (Note [Choosing the memory levers])."""
    tiles = {"mlp_tile_size": TILE_SIZE} if cfg.peft.lora_modules_to_save else {
        "mlp_tile_size": TILE_SIZE, "norm_tile_size": TILE_SIZE}
    steps = [{"activation_checkpointing": True}, {"attention_block_size": BLOCK_SIZE}, tiles,
             {"offload_checkpoints": True}]
    if not cfg.peft.use_peft and cfg.peft.quantization == "none" and cfg.optim.optimizer == "adamw":
        steps.append({"offload_params": True})
    levers = [dict(NO_LEVERS)]
    for step in steps:
        levers.append({**levers[-1], **step})
    return levers


def describe_levers(levers: dict[str, Any]) -> str:
    """The levers that are on, in words: ``activation checkpointing, MLP/norm tiles of 8192``."""
    on = []
    if levers["activation_checkpointing"]:
        on.append("activation checkpointing")
    if levers["attention_block_size"]:
        on.append(f"attention blocks of {levers['attention_block_size']}")
    if levers["mlp_tile_size"]:
        norms = "/norm" if levers["norm_tile_size"] else ""
        on.append(f"MLP{norms} tiles of {levers['mlp_tile_size']}")
    if levers["offload_checkpoints"]:
        on.append("checkpoint offload")
    if levers["offload_params"]:
        on.append("parameter offload")
    return ", ".join(on) or "no lever"


def with_levers(cfg: TrainConfig, levers: dict[str, Any]) -> TrainConfig:
    """A copy of ``cfg`` with ``levers`` set."""
    new = copy.deepcopy(cfg)
    apply_levers(new, levers)
    return new


def apply_levers(cfg: TrainConfig, levers: dict[str, Any]) -> None:
    """Set ``levers`` (flag -> value of ModelConfig) in ``cfg``."""
    for name, value in levers.items():
        setattr(cfg.model, name, value)


def planned_model_config(model_name: str):
    """The HF config the plans use: the planner's (embedded, a preset, a local directory, a GGUF
    file), or a hub id's config.json (fetched, or from the hub cache)."""
    from llama_cp.plan import simulate

    from llama_cp.modules.gguf import gguf_path

    local = os.path.isdir(os.path.expanduser(model_name)) or gguf_path(model_name) is not None
    if model_name == "embedded" or model_name in simulate.MODEL_PRESETS or local:
        return simulate.load_model_config(os.path.expanduser(model_name))
    from transformers import AutoConfig

    from llama_cp.modules.checkpoints import text_config

    return text_config(AutoConfig.from_pretrained(model_name))


def choose_levers(
    cfg: TrainConfig, world_size: int, budget_bytes: int, *, model_config=None, cache_dir: str | None = None,
) -> LeverChoice:
    """The first of :func:`candidates` whose planned peak per rank of a ``world_size``-rank job
    fits ``budget_bytes``, planned cheapest first; :class:`NothingFits` (one line: the last
    candidate's planned peak and the longest context that fits with it) when none does. The
    planner's own refusals (a ``ValueError`` naming what it does not model) pass through. Read
    from and written to the cache in ``cache_dir`` (default :func:`default_cache_dir`; Note
    [Choosing the memory levers])."""
    from llama_cp.plan import simulate

    config = model_config if model_config is not None else planned_model_config(cfg.model.model_name)
    path = Path(cache_dir or default_cache_dir()) / f"{cache_key(cfg, world_size, budget_bytes, config)}.json"
    cached = _read(path)
    if cached is not None:
        if "nothing_fits" in cached:
            raise NothingFits(cached["nothing_fits"], cached["peak_bytes"], cached["max_context"])
        plan = plan_from_json(cached)
        return LeverChoice(cached["levers"], plan, plans=0)
    for plans, levers in enumerate(candidates(cfg), start=1):
        # a copy: the planner's model build sets fields of the config it is given (its dtype)
        plan = simulate.plan_step_memory(with_levers(cfg, levers), world_size, model_config=copy.deepcopy(config))
        if plan.total <= budget_bytes:
            _write(path, {"levers": levers, **plan_to_json(plan)})
            return LeverChoice(levers, plan, plans)
    refusal = _nothing_fits(with_levers(cfg, levers), world_size, budget_bytes, config, plan)
    _write(path, {"nothing_fits": str(refusal), "peak_bytes": refusal.peak_bytes, "max_context": refusal.max_context})
    raise refusal


def _nothing_fits(cfg: TrainConfig, world_size: int, budget_bytes: int, config, plan: MemoryBreakdown) -> NothingFits:
    """The refusal of ``cfg`` (the last candidate, planned to ``plan``): its peak, and the longest
    context that fits with its levers, searched in steps of about 1/32 of the asked length."""
    from llama_cp.plan import fit

    unit = 2 * cfg.parallel.cp
    step = unit * max(1, cfg.data.context_length // (32 * unit))
    length, _ = fit.find_max_context(cfg, world_size, budget_bytes, model_config=copy.deepcopy(config),
                                     granularity=step, limit=cfg.data.context_length)
    fits = (f"the longest --context_length that fits with them is {length:,} tokens (searched in steps of {step:,})"
            if length else f"not even {step:,} tokens fit with them: add GPUs")
    message = (f"with every lever ({describe_levers({k: getattr(cfg.model, k) for k in NO_LEVERS})}) the planned "
               f"peak of --context_length {cfg.data.context_length:,} is {plan.total / GiB:.2f} GiB per GPU, over "
               f"the {budget_bytes / GiB:.2f} GiB usable; {fits}")
    return NothingFits(message, plan.total, length)


# ----------------------------------------------------------------------------- the cache


def plan_to_json(plan: MemoryBreakdown) -> dict:
    """A plan as the cache and the child process keep it: its categories, host bytes and
    FSDPMemTracker's own categories (which say what the host bytes hold)."""
    return {"plan": plan.to_dict(), "host": plan.host, "tracked": plan.tracked}


def plan_from_json(entry: dict) -> MemoryBreakdown:
    """:func:`plan_to_json`'s plan back (the cache key covers the package source: every entry read was written so)."""
    from llama_cp.plan.memory import MemoryBreakdown

    return MemoryBreakdown(**entry["plan"], host=entry["host"], tracked=entry["tracked"])



def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/llama_cp/memory_auto`` (default ``~/.cache/llama_cp/memory_auto``)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "llama_cp", "memory_auto")


def cache_key(cfg: TrainConfig, world_size: int, budget_bytes: int, model_config) -> str:
    """The hash a choice is cached under (Note [Choosing the memory levers])."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "none"

    flags = {k: v for k, v in TrainConfig.flatten(cfg.to_dict()).items() if k not in _NOT_MEMORY}
    source = hashlib.sha256()
    package = Path(__file__).resolve().parents[1]
    for file in sorted(package.rglob("*.py")):
        source.update(file.relative_to(package).as_posix().encode() + b"\0" + file.read_bytes())
    key = {"flags": flags, "world_size": world_size, "budget_bytes": budget_bytes, "model": model_config.to_dict(),
           "versions": [torch.__version__, installed("transformers"), installed("peft")],
           "source": source.hexdigest()}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: plan
        return None


def _write(path: Path, entry: dict) -> None:
    """Written to a temporary name and renamed (ranks of one job may write the same entry at once);
    a cache that cannot be written (a read-only home) is skipped."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(entry))
    except OSError:
        pass


# ----------------------------------------------------------------------------- in the trainer


def choose_for_run(
    cfg: TrainConfig, world_size: int, device_type: str, gpu_memory_bytes: int | None,
    say: Callable[[str], None], *, cache_dir: str | None = None,
) -> dict[str, Any]:
    """The trainer's ``--memory auto``, before anything is built: choose the levers for
    ``cfg`` on ``world_size`` GPUs of ``--gpu_memory_gb`` (default ``gpu_memory_bytes``, the
    device's), set them in ``cfg`` on CUDA, and ``say`` the choice, its planned peak and the
    time it took. On CPU (``device_type`` not "cuda") the choice is planned and said only, and
    only when --gpu_memory_gb is given. A run that fits with no candidate raises
    :class:`NothingFits` on CUDA (one line); a run the planner cannot plan keeps its levers, and
    the line says why. Returns what run_info.json records."""
    m = cfg.model
    if m.memory != "auto":
        return {"memory": m.memory}
    gpu_gb = m.gpu_memory_gb or (gpu_memory_bytes or 0) / GiB
    if not gpu_gb:  # a CPU without --gpu_memory_gb: nothing to plan for
        return {"memory": "auto", "planned": False}
    start = time.perf_counter()  # the planner's import included
    from llama_cp.plan.fit import usable_bytes

    applied = device_type == "cuda"
    budget = usable_bytes(gpu_gb, m.headroom)
    gpu = f"{gpu_gb:.3g} GiB GPU, {m.headroom:.0%} headroom"
    kept = "" if applied else f"; the levers stay as given on {device_type}"
    record: dict[str, Any] = {"memory": "auto", "gpu_memory_gb": gpu_gb, "headroom": m.headroom,
                              "usable_bytes": budget, "applied": False}
    try:
        choose = plan_elsewhere if _distributed_is_up() else choose_levers
        choice = choose(cfg, world_size, budget, cache_dir=cache_dir)
    except NothingFits as refusal:
        line = f"--memory auto: this run does not fit one GPU ({gpu}): {refusal}"
        if applied:
            raise NothingFits(line, refusal.peak_bytes, refusal.max_context) from None
        say(line + kept)
        return {**record, "nothing_fits": str(refusal)}
    except Exception as error:  # noqa: BLE001 - the planner's refusals, and anything it cannot build: not the run's end
        reason = " ".join(str(error).split()) or type(error).__name__
        say(f"--memory auto could not plan this run, so the levers stay as given: {reason}")
        return {**record, "could_not_plan": reason}
    seconds = time.perf_counter() - start
    if applied:
        apply_levers(cfg, choice.levers)
    host = f" (+{choice.plan.host / GiB:.1f} GiB of host memory per GPU)" if choice.plan.host else ""
    took = f"{choice.plans} plan{'s' * (choice.plans != 1)}" if choice.plans else "from the cache"
    say(f"--memory auto: {choice.describe()} -> planned peak {choice.plan.total / GiB:.1f} GiB of "
        f"{budget / GiB:.1f} GiB usable ({gpu}){host}; chosen in {seconds:.1f} s ({took}){kept}")
    return {**record, "levers": choice.levers, "chosen": choice.describe(), "planned_peak_bytes": choice.plan.total,
            "planned_host_bytes": choice.plan.host, "plans": choice.plans, "seconds": round(seconds, 3),
            "applied": applied}


def _distributed_is_up() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def plan_elsewhere(cfg: TrainConfig, world_size: int, budget_bytes: int, *, cache_dir: str | None = None) -> LeverChoice:
    """:func:`choose_levers` in a child process (``python -m llama_cp.plan.auto``), for a process
    whose torch.distributed is initialised; its refusals are raised here as they were there."""
    request = {"config": cfg.to_dict(), "world_size": world_size, "budget_bytes": budget_bytes,
               "cache_dir": cache_dir}
    done = subprocess.run([sys.executable, "-m", "llama_cp.plan.auto"], input=json.dumps(request), text=True,
                          capture_output=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = " ".join(done.stderr.split()[-60:])
        raise RuntimeError(f"python -m llama_cp.plan.auto failed (exit {done.returncode}): {tail}")
    return read_answer(json.loads(lines[-1]))


def read_answer(answer: dict) -> LeverChoice:
    """The parent's side of :func:`plan_elsewhere`: the child's :func:`answer` -> the choice, or
    the child's refusal raised again."""
    if "nothing_fits" in answer:
        raise NothingFits(answer["nothing_fits"], answer["peak_bytes"], answer["max_context"])
    if "could_not_plan" in answer:
        raise ValueError(answer["could_not_plan"])
    return LeverChoice(answer["levers"], plan_from_json(answer), answer["plans"])


def answer(request: dict) -> dict:
    """The child's side of :func:`plan_elsewhere`: ``request`` -> the JSON answer (:func:`read_answer`)."""
    flags = {**TrainConfig.flatten(request["config"]), "memory": "manual"}  # its levers as they are, checked
    try:
        cfg = TrainConfig.from_flags(**flags)
        choice = choose_levers(cfg, request["world_size"], request["budget_bytes"], cache_dir=request["cache_dir"])
    except NothingFits as refusal:
        return {"nothing_fits": str(refusal), "peak_bytes": refusal.peak_bytes, "max_context": refusal.max_context}
    except Exception as error:  # noqa: BLE001 - sent back whole: the parent says why it could not plan
        return {"could_not_plan": " ".join(str(error).split()) or type(error).__name__}
    return {"levers": choice.levers, **plan_to_json(choice.plan), "plans": choice.plans}


if __name__ == "__main__":
    print(json.dumps(answer(json.loads(sys.stdin.read()))), flush=True)
