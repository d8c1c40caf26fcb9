"""Does llama-cp work on this GPU machine? One command, 1-8 CUDA GPUs, a JSON file and a table.

    python benchmarks/gpu_acceptance.py                       # every GPU of the machine
    python benchmarks/gpu_acceptance.py --nproc 4 --output_dir acceptance/
    python benchmarks/gpu_acceptance.py --dry_run             # CPU, gloo, 2 ranks, tiny shapes (CI)

It starts its own ranks (one process per GPU, torchrun's environment, as
``llama_cp.train.launcher`` does) and writes ``gpu_acceptance.json`` and
``gpu_acceptance.md`` into ``--output_dir``. The JSON's ``environment`` says what ran
(the device and how many GPUs, torch, CUDA, transformers, bitsandbytes and flash-attn
versions, the attention backends the exactness runs used); its ``checks`` give every
check of part 1 its verdict (pass, FAIL, or the error that stopped it):

1. exactness (Note [The acceptance yardsticks] in ``benchmarks/gpu/correctness.py``): every strategy (ring, Ulysses,
   all-gather, hybrid) at cp = N on a small Llama in bf16, one document and packed
   documents, against single-GPU transformers on the same weights and rows: the loss,
   the logits and every parameter's gradient. Every strategy again on a Mistral whose
   sliding window is shorter than the row, and on a Gemma 2 with soft-capped attention
   scores. QLoRA (``--quantization 4bit``) at cp = N against transformers + bitsandbytes +
   peft in one process, and ``--optimizer adamw8bit`` for a few steps at cp = N against
   the same optimizer in one process.
2. memory: a Llama-3-8B-shaped model cut to ``--layers`` decoder layers at 32K-512K
   tokens on N GPUs (cp = N), each lever (none, activation checkpointing, + offloaded
   checkpoints, + tiled MLP and norms, LoRA): the planner's per-step peak
   (``llama_cp.plan.simulate.plan_step_memory``, the ``recipes/plan_memory`` figures) against
   ``torch.cuda.max_memory_allocated`` of a real step, reset before it.
3. speed: tokens/s/GPU, model TFLOP/s/GPU and MFU (Note [Model FLOPs] in
   llama_cp/model/flops.py) of the same model at cp 1, 2, 4, 8 (those dividing N) and N, ring
   and Ulysses, one document and packed documents; and ring efficiency: model
   TFLOP/s/GPU of ring at cp = N over that of one GPU running the same local tokens
   (L / N) alone.
4. the longest context: the largest --context_length whose step runs at cp = N with
   activation checkpointing, doubling from 32K until a step runs out of memory, then
   bisecting to 1/16 of the last step.

Shapes follow N, so that 1 to 8 GPUs all run every part: the exactness model's heads
are a multiple of N and of 4 (4:1 GQA), which Ulysses and every hybrid degree divide,
and every length is a multiple of 2N (the zigzag's 2 x cp chunks; the exactness rows
of 16N, so that packed documents of L / 8 tokens fit whole).

Each measurement runs in a fresh group of processes, so one out-of-memory error
(which stops every rank of the group) fails that measurement only. A measurement
that fails is in the JSON with its error. ``--dry_run`` runs all of it on the CPU
with gloo, 2 ranks and the embedded model's shapes, so that the pipeline is tested
in CI; its figures mean nothing, and since a CPU does not run out of memory the
same way, its bisection treats lengths over ``DRY_RUN_FITS`` tokens as out of memory.
The parts live in ``benchmarks/gpu/``, each importable on its own: ``settings`` (the shapes),
``correctness`` (part 1), ``memory``, ``speed`` and ``longest`` (parts 2-4, from the measured
steps of ``step``), ``ranks`` (the groups of processes that run the jobs) and ``report`` (the
verdicts and the markdown tables). This script only puts them together.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import fire

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script from anywhere

from benchmarks.gpu.correctness import correctness_jobs  # noqa: E402
from benchmarks.gpu.longest import longest_job  # noqa: E402
from benchmarks.gpu.memory import memory_jobs, memory_rows, planned_peaks  # noqa: E402
from benchmarks.gpu.ranks import run_jobs  # noqa: E402
from benchmarks.gpu.report import environment, markdown, verdict  # noqa: E402
from benchmarks.gpu.settings import Settings  # noqa: E402
from benchmarks.gpu.speed import ring_efficiency, speed_jobs, speed_rows  # noqa: E402
from llama_cp.files import write_text  # noqa: E402


def main(dry_run: bool = False, output_dir: str = "gpu_acceptance", nproc: int | None = None, layers: int = 2,
         skip_longest: bool = False) -> None:
    """Run the four parts and write ``gpu_acceptance.json`` and ``gpu_acceptance.md``."""
    s = Settings.of(dry_run, nproc, layers)
    jobs = correctness_jobs(s)
    correctness = [job["id"] for job in jobs]
    jobs += memory_jobs(s) + speed_jobs(s)
    if not skip_longest:
        jobs.append(longest_job())
    planned = {}

    def plan_memory() -> None:  # in this process, while the ranks run
        planned.update(planned_peaks(s))

    results = run_jobs(jobs, s, meanwhile=plan_memory)
    exact = [{"check": j["id"], **results[j["id"]]} for j in jobs if j["kind"] == "exactness"]
    report: dict[str, Any] = {
        "environment": environment(s, exact), "dry_run": dry_run, "exact_model": s.exact_model, "model": s.model,
        "checks": {name: verdict(results[name]) for name in correctness},
        "exactness": exact, "qlora": results["qlora"], "adamw8bit": results["adamw8bit"],
        "memory": memory_rows(s, results, planned), "speed": speed_rows(s, jobs, results),
        "ring_efficiency": ring_efficiency(s, results),
        "longest": None if skip_longest else results["longest"],
    }
    os.makedirs(output_dir, exist_ok=True)
    write_text(os.path.join(output_dir, "gpu_acceptance.json"), json.dumps(report, indent=1))
    write_text(os.path.join(output_dir, "gpu_acceptance.md"), markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    fire.Fire(main)
