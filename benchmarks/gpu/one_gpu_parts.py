"""The parts of the one-GPU report (``benchmarks/gpu_report.py``), each run in a process of its own
with a time limit of its own: its rows go to a JSON file as each is measured, so a part stopped
by its limit or by an error keeps what it measured before.

- ``correctness``: llama-cp bf16 against transformers fp32 with transformers bf16 as the yardstick
  (Note [The acceptance yardsticks] in benchmarks/gpu/correctness.py) on the GPU's kernels: one
  document and packed documents (the varlen kernel), the attention in blocks smaller than the row
  for every strategy (the log-sum-exp merges the ring and all-gather make), a sliding window and
  soft-capped scores; QLoRA and adamw8bit where bitsandbytes is installed.
- ``speed``: llama-cp (cp = 1), and with ``--compile``, against transformers + peft (and Liger Kernel)
  at each speed length, LoRA and full; ``--offload_params`` and ``--offload_checkpoints`` against the
  plain step.
- ``memory``: the planner's peak against the measured one, LoRA and full, with the levers.
- ``profile``: the kernels of one full fine-tuning step, then one LoRA step, at the longest speed
  length, by GPU time: llama-cp's and transformers' (+ peft).
- ``kernels``: torch's attention kernels alone at the longest speed length: speed and bytes per call.
- ``long``: one step at the longest memory length, measured against its plan.
- ``plan`` (CPU, beside the others): every row's planned peak, the levers ``--memory auto`` picks for
  the whole 32-layer model on this GPU, and the longest context planned for it.
"""

from __future__ import annotations

import gc
import json
import os
import time
from typing import Any, Callable

import torch

from benchmarks.gpu.report_one import read_rows
from benchmarks.gpu.settings import llama_config
from llama_cp.files import write_text
from llama_cp.plan.auto import NO_LEVERS

#: The memory levers of the rows (flags), by name: each as ``--memory auto`` sets it (every other lever
#: off, ``--attention_block_size 0`` included; llama_cp.plan.auto.candidates).
AC = {"activation_checkpointing": True}
LEVERS = {name: {**NO_LEVERS, **flags} for name, flags in {
    "none": {},
    "checkpointing": AC,
    "checkpointing + offload_checkpoints": {**AC, "offload_checkpoints": True},
    "checkpointing + blocks + tiles": {**AC, "attention_block_size": 16384, "mlp_tile_size": 8192,
                                       "norm_tile_size": 8192},
    "checkpointing + offload_params": {**AC, "offload_params": True},
}.items()}
MODES = {"lora": {"use_peft": True}, "full": {}}


def shapes(dry_run: bool, layers: int) -> dict[str, Any]:
    """The model and lengths of a run: a Llama-3-8B cut to ``layers`` decoder layers on the GPU, the
    embedded Llama at a few hundred tokens in ``--dry_run``."""
    from llama_cp.modules.causal_lm import EMBEDDED_LLAMA
    from llama_cp.plan.simulate import MODEL_PRESETS

    if dry_run:
        model = {**EMBEDDED_LLAMA, "num_hidden_layers": 2}
        speed, mem, steps = [128], (128, 256), 2
        full_model = {**EMBEDDED_LLAMA}
    else:
        model = {**MODEL_PRESETS["llama3-8b"], "num_hidden_layers": layers, "max_position_embeddings": 1 << 24}
        speed, mem, steps = [16384, 65536], (32768, 131072), 3
        full_model = {**MODEL_PRESETS["llama3-8b"], "max_position_embeddings": 1 << 24}
    short, longer = mem
    # the rows that tell most first (a part stopped at its limit keeps what it measured): the H200's
    # runs measured all but the parameter-offload row, which comes first now
    memory = [("full", longer // 2, "checkpointing + offload_params"), ("full", short, "checkpointing"),
              ("full", longer, "checkpointing"), ("lora", longer, "checkpointing"),
              ("lora", longer, "checkpointing + blocks + tiles"), ("lora", short, "checkpointing"),
              ("full", short, "none"), ("lora", longer, "checkpointing + offload_checkpoints"), ("lora", short, "none")]
    if dry_run:  # the pipeline, not the figures: one row of each kind
        memory = [memory[5], memory[7], memory[0]]
    return {"model": model, "full_model": full_model, "speed_lens": speed, "memory": memory,
            "long": ("lora", "checkpointing + offload_checkpoints"), "steps": steps, "dry_run": dry_run}


def flags_of(mode: str, lever: str) -> dict:
    return {**MODES[mode], **LEVERS[lever]}


class Rows:
    """A part's rows, written whole to ``path`` after each one."""

    def __init__(self, path: str):
        self.path, self.rows = path, []

    def add(self, row: dict) -> None:
        self.rows.append(row)
        write_text(self.path, json.dumps(self.rows, indent=1))

    def measure(self, name: dict, work: Callable[[], dict]) -> dict:
        """``name`` (the row's keys) and what ``work()`` measured, or the last line of its error
        (an out-of-memory error ends the row, not the part); ``row_seconds``: the whole row's wall
        time, its build and clean-up included (the first H200 run spent about 12 s a speed row
        outside the timed steps, unexplained)."""
        print(f"[gpu_report] {name}", flush=True)
        start = time.perf_counter()
        try:
            row = {**name, **work()}
        except Exception as error:  # noqa: BLE001 - recorded, and the part goes on
            lines = [line for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
            row = {**name, "error": f"{type(error).__name__}: {lines[-1][:300]}"}
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        row["row_seconds"] = round(time.perf_counter() - start, 2)
        self.add(row)
        print(f"[gpu_report]   -> {json.dumps(row)[:400]}", flush=True)
        return row


def _device() -> torch.device:
    from llama_cp.parallel.mesh import init_distributed

    device_type = init_distributed(timeout_s=120, cpu_collectives=True)  # a world of one (gloo for host norms)
    return torch.device(device_type, torch.cuda.current_device() if device_type == "cuda" else 0)


def exactness_runs(exact_len: int, dry_run: bool) -> list[tuple[tuple[str, str, bool, int], str | None]]:
    """The exactness checks of the correctness part, in the order they run: ((case, strategy, packed,
    block size), attention backend or None for the default)."""
    quarter = exact_len // 4
    cases = [("llama", "ring", False, 0), ("llama", "ring", True, 0)]
    cases += [("llama", strategy, packed, quarter) for strategy in ("ring", "allgather") for packed in (False, True)]
    # the window in one call a row (a causal square), then in blocks shorter than the window (640 tokens of
    # a 2048-token row on the GPU): full blocks the window cuts, two calls each (windows.window_parts), some
    # with fewer queries than keys, where flash's window is aligned bottom-right; then packed documents,
    # whose windowed and shorter squares go to the varlen kernel in one call a block, with the window
    # (Note [Varlen document calls])
    window_blocks = ("mistral_window", "ring", False, exact_len // 16)
    cases += [("llama", "ulysses", False, quarter), ("mistral_window", "ring", False, 0), window_blocks,
              ("mistral_window", "ring", True, 0), ("gemma2_softcap", "ring", False, 0)]
    if dry_run:  # the pipeline, not the figures: one case of each kind
        return [(case, None) for case in (cases[1], cases[3], cases[5], window_blocks)]
    # The kernel auto does not take for a case, named, right after the two cases whose references they
    # reuse: on an H100 without flash-attn auto runs one document a row on sdpa_cudnn and packed
    # documents on sdpa_flash's varlen kernel (kernels.AUTO_GPUS, pieces._resolve), so
    # sdpa_flash is checked on the one-document cases and sdpa_cudnn (one call per piece) on the packed
    named = [(("llama", "ring", False, 0), "sdpa_flash"), (("llama", "ring", True, 0), "sdpa_cudnn"),
             (("llama", "ring", False, quarter), "sdpa_flash"), (("llama", "allgather", True, quarter), "sdpa_cudnn")]
    return [(case, None) for case in cases[:2]] + named + [(case, None) for case in cases[2:]]


def correctness(rows: Rows, dry_run: bool) -> None:
    from benchmarks.gpu.correctness import adamw8bit, checkpoint_load, exactness, qlora
    from benchmarks.gpu.settings import Settings
    from benchmarks.gpu.wide_heads import wide_heads

    device = _device()
    s = Settings.of(dry_run, 1, 2)
    references: dict = {}
    for (case, strategy, packed, block), backend in exactness_runs(s.exact_len, dry_run):
        name = {"check": f"exact/{case}/{strategy}/{'packed' if packed else 'one'}" + (f"/blocks {block}" if block else "")
                + (f"/{backend}" if backend else "")}
        rows.measure(name, lambda: exactness(s, case, strategy, packed, 0, references, block_size=block, backend=backend))
    references.clear()
    rows.measure({"check": "checkpoint load/gemma3 vision-language"}, lambda: checkpoint_load(s))
    rows.measure({"check": "kernel/heads of 512"}, lambda: wide_heads(device, s.exact_len))
    if dry_run:  # their CPU rehearsal is gpu_acceptance's (tests/test_gpu_acceptance.py)
        return
    rows.measure({"check": "qlora"}, lambda: qlora(s, os.path.dirname(rows.path)))
    rows.measure({"check": "adamw8bit"}, lambda: adamw8bit(s))


def speed(rows: Rows, shape: dict) -> None:
    from benchmarks.gpu.one_gpu import llama_cp_steps, transformers_steps

    device, config, steps = _device(), llama_config(shape["model"]), shape["steps"]
    shortest = min(shape["speed_lens"])  # the offloaded rows' length
    for length in sorted(shape["speed_lens"], reverse=True):  # the longest first: a part at its limit cuts the rest
        for mode in MODES:
            lora = mode == "lora"
            base = {"context_length": length, "mode": mode}
            rows.measure({**base, "run": "llama-cp"}, lambda: llama_cp_steps(
                config, length, flags_of(mode, "checkpointing"), steps=steps, device=device,
                build_on_cpu=mode == "full" and length == shortest))  # the offloaded rows' weights
            if length == max(shape["speed_lens"]):  # the MFU goal's length; compiling costs ~30 s a row
                # the norms, MLPs and attention layers compiled (Note [Compiled per-token modules]); its first
                # step compiles and is not timed. (Runs 2 and 4 compared sdpa_cudnn with sdpa_flash here:
                # docs/benchmarks.md.)
                rows.measure({**base, "run": "llama-cp, --compile"}, lambda: llama_cp_steps(
                    config, length, {**flags_of(mode, "checkpointing"), "compile": True}, steps=steps, device=device))
            rows.measure({**base, "run": "transformers + peft" if lora else "transformers"},
                         lambda: transformers_steps(config, length, lora=lora, steps=steps, device=device))
    for lever in ("checkpointing + offload_params", "checkpointing + offload_checkpoints"):
        rows.measure({"context_length": shortest, "mode": "full", "run": f"llama-cp, {lever}"}, lambda: llama_cp_steps(
            config, shortest, flags_of("full", lever), steps=steps, device=device, build_on_cpu=True))
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        return
    # last: Liger patches transformers' Llama for this whole process; measured in runs 2 and 4, so these
    # are the rows the part's limit cuts first
    for length in shape["speed_lens"]:
        for mode in MODES:
            rows.measure({"context_length": length, "mode": mode,
                          "run": "transformers + liger" + (" + peft" if mode == "lora" else "")},
                         lambda: transformers_steps(config, length, lora=mode == "lora", steps=steps, device=device,
                                                    liger=True))


def memory(rows: Rows, shape: dict, which: list) -> None:
    from benchmarks.gpu.one_gpu import llama_cp_steps

    device, config = _device(), llama_config(shape["model"])
    for mode, length, lever in which:
        # LoRA's optimizer state is a few MB, so its first step's peak is the steady one (the report
        # shows both where there are two); full fine-tuning's first step has no AdamW state yet
        steps = 1 if mode == "lora" and length > min(m[1] for m in shape["memory"]) else 2
        rows.measure({"mode": mode, "context_length": length, "lever": lever}, lambda: llama_cp_steps(
            config, length, flags_of(mode, lever), steps=steps, device=device))


def kernels(rows: Rows, shape: dict) -> None:
    """torch's attention kernels alone at the longest speed length: their speed and what a call
    allocates, the figures a planner model of sdpa_cudnn needs; then llama-cp's packed documents under
    a window, varlen calls against a call per piece."""
    from benchmarks.gpu.one_gpu import attention_kernels, packed_window_calls

    device = _device()
    length = shape["speed_lens"][-1]
    for measure in (attention_kernels, packed_window_calls):  # each one's rows kept before the next runs
        for row in measure(length, device):
            rows.add({"context_length": length, **row})


def profile(rows: Rows, shape: dict, out_dir: str) -> None:
    """The kernels of one step at the longest speed length by GPU time, llama-cp's (its default
    attention backend) and then transformers' (+ peft for LoRA), each in its own file: where the time
    goes, and what one does that the other does not. Full fine-tuning first: after the fourth H200
    run its step is the one still slower than transformers' (0.86x at 64K, LoRA 1.00x)."""
    from torch.profiler import ProfilerActivity

    from benchmarks.gpu.one_gpu import llama_cp_steps, transformers_steps

    device, config = _device(), llama_config(shape["model"])
    length = shape["speed_lens"][-1]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for mode in ("full", "lora"):
        suffix = "_full" if mode == "full" else ""
        runs = {"llama-cp": (f"profile{suffix}.json", lambda prof: llama_cp_steps(
                    config, length, flags_of(mode, "checkpointing"), steps=2, device=device, profile=prof)),
                "transformers" + (" + peft" if mode == "lora" else ""): (
                    f"profile_transformers{suffix}.json", lambda prof: transformers_steps(
                        config, length, lora=mode == "lora", steps=2, device=device, profile=prof))}
        for run, (file, steps) in runs.items():
            rows.measure({"context_length": length, "mode": mode, "run": f"{run}, profiled"},
                         lambda: _profiled(steps, activities, os.path.join(out_dir, file)))


def _profiled(steps, activities, path: str) -> dict:
    """``steps(profiler)``'s figures, the 40 busiest kernels of its profiled step written to ``path``
    (on the GPU the kernels alone: an op's self device time is its kernels' again, counted once; on
    the CPU each op's own time) and the top 15 of them."""
    from torch.autograd import DeviceType

    prof = torch.profiler.profile(activities=activities)
    result = steps(prof)
    kernels = [e for e in prof.key_averages() if getattr(e, "device_type", None) == DeviceType.CUDA]
    key = "device_time_total" if kernels else "self_cpu_time_total"
    events = [e for e in kernels or prof.key_averages() if getattr(e, key, 0) > 0]
    total = sum(getattr(e, key) for e in events)
    top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:40]
    table = [{"name": e.key[:120], "calls": e.count, "ms": getattr(e, key) / 1e3,
              "share": getattr(e, key) / total} for e in top]
    write_text(path, json.dumps(table, indent=1))
    return {**result, "profiled_ms": total / 1e3, "top": table[:15]}


def _cfg_of(length: int, flags: dict):
    from benchmarks.gpu.settings import set_flags
    from llama_cp.config import TrainConfig

    cfg = TrainConfig()
    cfg.data.context_length, cfg.data.document_mask = length, True
    set_flags(cfg, flags)
    return cfg


#: The plan part's row that the long part runs: the cut model's longest planned context.
CUT_LONGEST = "llama3-8b cut"


def longest(rows: Rows, shape: dict, plan_path: str) -> None:
    """The longest context the planner says fits this GPU for the cut model, with ``shape["long"]``'s
    mode and levers (LoRA with checkpointing and checkpoint offload, what --memory auto takes last),
    run for one step: the longest context measured on one GPU, its peak beside the plan. The length
    is the plan part's (``CUT_LONGEST``, planned on the CPU with CUDA hidden, beside the GPU parts)."""
    from benchmarks.gpu.one_gpu import llama_cp_steps

    mode, lever = shape["long"]
    deadline = time.monotonic() + 60  # the plan part runs beside, from the start: its row may still be coming
    while not (planned := [r for r in read_rows(plan_path) if r.get("model") == CUT_LONGEST and
                           r.get("planned_max_context")]) and time.monotonic() < deadline:
        time.sleep(1)
    if not planned:
        rows.add({"mode": mode, "lever": lever, "context_length": None,
                  "error": "the plan part has not planned the cut model's longest context (run the plan part too)"})
        return
    length, planned_bytes = planned[0]["planned_max_context"], planned[0]["planned_bytes"]
    device, config = _device(), llama_config(shape["model"])
    rows.measure({"mode": mode, "context_length": length, "lever": lever, "planned_bytes": planned_bytes,
                  "budget_bytes": planned[0]["budget_bytes"]},
                 lambda: llama_cp_steps(config, length, flags_of(mode, lever), steps=1, device=device))


def plan(rows: Rows, shape: dict, gpu_memory_gb: float) -> None:
    """Every measured row's planned peak and the cut model's longest context (the long part runs
    it), then for the whole model (all its layers) on this GPU: the levers ``--memory auto`` picks
    at each speed and memory length, and the longest context planned with all of them (LoRA, and
    full fine-tuning with parameter offload)."""
    from llama_cp.plan.auto import NothingFits, choose_levers, describe_levers
    from llama_cp.plan.fit import find_max_context, usable_bytes
    from llama_cp.plan.simulate import plan_step_memory

    search = dict(granularity=128, limit=1024) if shape["dry_run"] else dict(granularity=8192)  # --dry_run: a few plans
    config = llama_config(shape["model"])
    budget = usable_bytes(gpu_memory_gb, 0.1)
    mode, lever = shape["long"]

    def cut_longest() -> dict:
        length, plan_ = find_max_context(_cfg_of(2, flags_of(mode, lever)), 1, budget, model_config=config, **search)
        return {"planned_max_context": length, "planned_bytes": plan_.total if plan_ else None}
    # first: the long part waits for this row (in the fifth H200 run, ~40 s behind the memory rows' plans)
    rows.measure({"model": CUT_LONGEST, "mode": mode, "lever": lever, "budget_bytes": budget}, cut_longest)
    for mode, length, lever in shape["memory"]:
        rows.measure({"mode": mode, "context_length": length, "lever": lever}, lambda: {
            "planned_bytes": plan_step_memory(_cfg_of(length, flags_of(mode, lever)), 1, model_config=config).total})
    whole = llama_config(shape["full_model"])
    for mode in MODES:
        lengths = sorted({*shape["speed_lens"], *(m[1] for m in shape["memory"])})
        for length in lengths[:1] if shape["dry_run"] else lengths:
            def choose() -> dict:
                try:
                    choice = choose_levers(_cfg_of(length, MODES[mode]), 1, budget, model_config=whole,
                                           cache_dir=os.path.dirname(rows.path))
                except NothingFits as refusal:
                    return {"auto": f"nothing fits: {refusal}"}
                return {"auto": describe_levers(choice.levers), "planned_bytes": choice.plan.total}
            rows.measure({"model": "llama3-8b", "mode": mode, "context_length": length, "budget_bytes": budget}, choose)
    for mode, lever in (("lora", "checkpointing + offload_checkpoints"), ("full", "checkpointing + offload_params")):
        flags = flags_of(mode, lever)
        if mode == "full":
            flags["offload_checkpoints"] = True
        def longest() -> dict:
            length, plan_ = find_max_context(_cfg_of(2, flags), 1, budget, model_config=whole, **search)
            return {"planned_max_context": length, "planned_bytes": plan_.total if plan_ else None}
        rows.measure({"model": "llama3-8b", "mode": mode, "lever": lever + (" + offload_checkpoints" if mode == "full"
                                                                             else ""), "budget_bytes": budget}, longest)
