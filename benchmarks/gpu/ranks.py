"""Running the GPU acceptance jobs: one process per GPU (torchrun's environment, as
``llama_cp.train.launcher`` does), a group of processes that runs the jobs while they succeed,
and a fresh group after one fails (an out-of-memory error stops every rank of its group)."""

from __future__ import annotations

import gc
import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.gpu.correctness import adamw8bit, exactness, qlora
from benchmarks.gpu.longest import longest_context
from benchmarks.gpu.settings import Settings
from benchmarks.gpu.step import training_step
from llama_cp.parallel.mesh import free_port


def _worker(rank: int, port: int, world: int, jobs: list[dict], path: str, settings: Settings) -> None:
    """One rank of a group: runs ``jobs`` in order; rank 0 notes each result (and each length the
    longest-context search decides) as a JSON line of ``path``."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if settings.device_type == "cpu":
        torch.set_num_threads(1)
    from llama_cp.parallel.mesh import end_distributed, init_distributed

    init_distributed(timeout_s=600)

    def note(entry: dict) -> None:
        if rank == 0:
            with open(path, "a") as f:
                f.write(json.dumps(entry) + "\n")

    references: dict = {}  # the exactness checks' single-process runs, shared by the strategies of a case
    try:
        for job in jobs:
            kind, args = job["kind"], job["args"]
            if kind != "exactness":
                references.clear()  # before any peak of parts 2-4 is measured
            if kind == "exactness":
                result = exactness(settings, **args, references=references)
            elif kind == "qlora":
                result = qlora(settings, os.path.dirname(path))
            elif kind == "adamw8bit":
                result = adamw8bit(settings)
            elif kind == "longest":
                tried = {int(k): v for k, v in args["tried"].items()}
                result = longest_context(settings, tried, lambda e: note({"id": job["id"], **e}))
            else:
                result = training_step(settings, **args)
            note({"id": job["id"], "result": result})
            gc.collect()  # the job's model and optimizer: gone before the next job's peak is measured
            if settings.device_type == "cuda":
                torch.cuda.empty_cache()
    except BaseException:  # the driver reads what was noted, and goes on in a fresh group
        dist.destroy_process_group()
        raise
    end_distributed()  # Note [Leaving a gloo job] in llama_cp/parallel/mesh.py


def run_jobs(jobs: list[dict], settings: Settings, meanwhile=None) -> dict[str, dict]:
    """Run ``jobs`` on ``settings.nproc`` ranks, in one group of processes while they succeed. A
    job that fails gets its error and the rest go on in a fresh group; the longest-context
    search goes on after the length that ran out of memory, which it counts as not running.
    ``meanwhile()`` runs here while the first group works."""
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "results.jsonl")  # its directory also holds the QLoRA check's checkpoint
        while remaining := [job for job in jobs if job["id"] not in results]:
            error = None
            group = mp.start_processes(_worker, args=(free_port(), settings.nproc, remaining, path, settings),
                                       nprocs=settings.nproc, join=False, start_method="spawn")
            if meanwhile is not None:
                meanwhile, work = None, meanwhile
                try:
                    work()
                except BaseException:
                    for process in group.processes:  # this group's ranks, started above
                        process.kill()
                    raise
            try:
                while not group.join():
                    pass
            except Exception as exc:  # noqa: BLE001 - any rank's failure ends this group
                error = exc
            trying = None
            if os.path.exists(path):
                with open(path) as f:
                    for entry in map(json.loads, f):
                        if "result" in entry:
                            results[entry["id"]] = entry["result"]
                        elif "trying" in entry:
                            trying = entry["trying"]
                        else:
                            trying = None
                            next(j for j in jobs if j["id"] == entry["id"])["args"]["tried"][str(entry["tried"])] = \
                                entry["runs"]
                os.remove(path)
            failed = next((job for job in remaining if job["id"] not in results), None)
            if failed is None:
                continue
            lines = [line for line in str(error or "no result").splitlines() if line.strip()]
            message = lines[-1][:300] if lines else "failed"
            if failed["kind"] == "longest" and trying is not None and _out_of_memory(message):
                failed["args"]["tried"][str(trying)] = False  # go on in a fresh group
            else:
                results[failed["id"]] = {"error": message}
    return results


def _out_of_memory(message: str) -> bool:
    return any(marker in message.lower() for marker in ("out of memory", "outofmemoryerror"))
