"""Part 3 of the GPU acceptance run, speed: tokens/s/GPU, model TFLOP/s/GPU and MFU at each cp that
divides N (and N), ring and Ulysses, one document and packed documents; and the ring's efficiency
against one GPU running the same local tokens alone."""

from __future__ import annotations

from typing import Any

from benchmarks.gpu.settings import Settings


def speed_jobs(s: Settings) -> list[dict]:
    """Part 3's steps, with activation checkpointing: every cp of 1, 2, 4, 8 that divides N, and N;
    ring and Ulysses (where the heads split); one document and packed; then one GPU alone on the
    local tokens of cp = N."""
    n = s.nproc
    heads = s.model["num_attention_heads"]
    cps = sorted({c for c in (1, 2, 4, 8) if c <= n and n % c == 0} | {n})
    jobs = []
    speed_flags = {"activation_checkpointing": True}
    for cp in cps:
        for st in ("ring", "ulysses") if cp > 1 else ("ring",):
            if heads % cp and st == "ulysses":
                continue
            for p in (False, True):
                jobs.append({"id": f"speed/{cp}/{st}/{'packed' if p else 'one'}", "kind": "step",
                             "args": dict(context_length=s.speed_len, cp=cp, strategy=st, packed=p, flags=speed_flags)})
    jobs.append({"id": "speed/local", "kind": "step",  # one GPU alone on the local tokens of cp = N
                 "args": dict(context_length=s.speed_len // n, cp=1, flags=speed_flags)})
    return jobs


def speed_rows(s: Settings, jobs: list[dict], results: dict[str, dict]) -> list[dict[str, Any]]:
    """The report's ``speed``: the figures of every speed job but the one GPU alone, in job order."""
    rows = []
    for job in jobs:
        if job["id"].startswith("speed/") and job["id"] != "speed/local":
            _, cp, st, docs = job["id"].split("/")
            rows.append({"cp": int(cp), "strategy": st, "documents": docs,
                         "context_length": s.speed_len, **results[job["id"]]})
    return rows


def ring_efficiency(s: Settings, results: dict[str, dict]) -> dict[str, Any]:
    """The report's ``ring_efficiency``: model TFLOP/s/GPU of ring at cp = N over that of one GPU
    alone on the same local tokens (L / N)."""
    n = s.nproc
    ring, alone = results.get(f"speed/{n}/ring/one", {}), results["speed/local"]
    return {
        "cp": n, "context_length": s.speed_len, "local_tokens": s.speed_len // n,
        "ring_tflops_per_gpu": ring.get("model_tflops_per_gpu"), "alone_tflops_per_gpu": alone.get("model_tflops_per_gpu"),
        "efficiency": (ring["model_tflops_per_gpu"] / alone["model_tflops_per_gpu"]
                       if "model_tflops_per_gpu" in ring and "model_tflops_per_gpu" in alone else None),
    }
