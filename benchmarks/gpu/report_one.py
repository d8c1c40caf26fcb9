"""The one-GPU report (``benchmarks/gpu_report.py``) as markdown: what ran, then one table a part."""

from __future__ import annotations

import json
from typing import Any

from benchmarks.gpu.report import _gib, _num


def read_rows(path: str) -> list:
    """A part's rows as written so far (``Rows``), or [] before its first."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return []


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [f"# llama-cp on one GPU: {env.get('device', '?')}", "",
             ", ".join(f"{k} {v}" for k, v in env.items() if k not in ("device", "gpu_memory_bytes")) + ".",
             f"Model: Llama-3-8B shapes cut to {report['layers']} decoder layers, random weights"
             + (" (--dry_run: the embedded Llama; figures mean nothing)" if report["dry_run"] else "") + ".",
             "", "Parts: " + "; ".join(f"{k} {v}" for k, v in report["parts"].items()) + "."]
    lines += _correctness(report["correctness"])
    lines += _speed(report["speed"] + report["profile"])
    lines += _memory(report["memory"] + report["long"], report["plan"])
    lines += _plan(report["plan"])
    lines += _kernels(report.get("kernels", []))
    lines += _profile(report["profile"])
    return "\n".join(lines) + "\n"


def _correctness(rows: list[dict]) -> list[str]:
    lines = ["", "## Exactness on the GPU's kernels (relative error vs transformers fp32; yardstick: transformers bf16)",
             "", "| check | ranks | backend | loss | logits | gradients | bf16 loss | bf16 logits | bf16 gradients "
             "| pass |", "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r.get('check', '-')} | 1 | error: {r['error']} |||||||")
            continue
        if "llama_cp_bf16_error" not in r:  # adamw8bit
            detail = {k: v for k, v in r.items() if k not in ("check", "pass")}
            lines.append(f"| {r['check']} | 1 | {str(detail)[:200]} ||||||| {r.get('pass')} |")
            continue
        ours, ref = r["llama_cp_bf16_error"], r["transformers_bf16_error"]
        keys = ("loss", "logits", "gradients")  # QLoRA's: the loss and the LoRA gradients
        lines.append(f"| {r['check']} | 1 | {r.get('attention_backend', '-')} | "
                     + " | ".join(_num(d.get(k, d.get(f"lora_{k}")), ".2e") for d in (ours, ref) for k in keys)
                     + f" | {r['pass']} |")
    return lines


def _speed(rows: list[dict]) -> list[str]:
    lines = ["", "## Speed (one GPU, activation checkpointing on every row)", "",
             "| context | mode | run | s/step | tokens/s | model TFLOP/s | MFU | vs llama-cp | peak GiB | losses |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---|"]
    ours = {(r["context_length"], r["mode"]): r for r in rows if r.get("run") == "llama-cp" and "error" not in r}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['context_length']} | {r['mode']} | {r['run']} | error: {r['error']} |||||||")
            continue
        base = ours.get((r["context_length"], r["mode"]))
        ratio = r["tokens_per_sec_per_gpu"] / base["tokens_per_sec_per_gpu"] if base else None
        losses = ", ".join(f"{x:.4f}" for x in r["losses"])
        lines.append(f"| {r['context_length']} | {r['mode']} | {r['run']} | {r['seconds_per_step']:.3f} | "
                     f"{r['tokens_per_sec_per_gpu']:.0f} | {r['model_tflops_per_gpu']:.1f} | {_num(r.get('mfu'), '.1%')} "
                     f"| {_num(ratio, '.2f')} | {_gib(r['measured_peak_bytes'])} | {losses} |")
    return lines


def _memory(rows: list[dict], plans: list[dict]) -> list[str]:
    planned = {(p["mode"], p["context_length"], p["lever"]): p.get("planned_bytes") for p in plans
               if "lever" in p and "context_length" in p}
    lines = ["", "## Peak memory per step: planned vs measured (GiB; torch.cuda.max_memory_allocated)", "",
             "| mode | context | levers | planned | measured | planned / measured | first step |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        plan = r.get("planned_bytes") or planned.get((r["mode"], r["context_length"], r["lever"]))
        if "error" in r:
            lines.append(f"| {r['mode']} | {r['context_length']} | {r['lever']} | {_gib(plan)} | error: {r['error']} |||")
            continue
        got = r["measured_peak_bytes"]
        lines.append(f"| {r['mode']} | {r['context_length']} | {r['lever']} | {_gib(plan)} | {_gib(got)} | "
                     f"{_num(plan / got if plan and got else None, '.3f')} | {_gib(r['first_step_peak_bytes'])} |")
    return lines


def _plan(rows: list[dict]) -> list[str]:
    lines = ["", "## The whole Llama-3-8B on this GPU, planned (--memory auto's choice; the longest context)", "",
             "| mode | context | levers | planned GiB | budget GiB |", "|---|---:|---|---:|---:|"]
    for r in rows:
        if r.get("model") != "llama3-8b":
            continue
        if "planned_max_context" in r or "lever" in r:
            got = r.get("planned_max_context", r.get("error"))
            lines.append(f"| {r['mode']} | longest: {got} | {r['lever']} | {_gib(r.get('planned_bytes'))} | "
                         f"{_gib(r['budget_bytes'])} |")
        else:
            lines.append(f"| {r['mode']} | {r['context_length']} | {r.get('auto', r.get('error'))} | "
                         f"{_gib(r.get('planned_bytes'))} | {_gib(r['budget_bytes'])} |")
    return lines


def _profile(rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        if "top" not in r:
            continue
        lines += ["", f"## Where one {'LoRA' if r['mode'] == 'lora' else 'full fine-tuning'} step's time goes: "
                  f"{r['run'].removesuffix(', profiled')} ({r['context_length']} "
                  f"tokens; {r['profiled_ms']:.0f} ms "
                  "of kernels, top 15)", "", "| kernel | calls | ms | share |", "|---|---:|---:|---:|"]
        lines += [f"| {t['name'][:90]} | {t['calls']} | {t['ms']:.1f} | {t['share']:.1%} |" for t in r["top"]]
    return lines


def _kernels(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = ["", f"## torch's attention kernels alone ({rows[0]['context_length']} tokens, 32 heads, 8 KV heads, 128; "
             "forward + backward)", "", "| kernel | ms | TFLOP/s | bytes beyond the inputs (GiB) |", "|---|---:|---:|---:|"]
    packed = [r for r in rows if r["kernel"].startswith("llama-cp")]
    for r in (r for r in rows if r not in packed):
        if "error" in r:
            lines.append(f"| {r['kernel']} | error: {r['error']} |||")
        else:
            lines.append(f"| {r['kernel']} | {r['ms']:.0f} | {r['tflops']:.0f} | {_gib(r.get('peak_extra_bytes'))} |")
    if packed:  # benchmarks/gpu/one_gpu.py packed_window_calls
        lines += ["", "llama-cp's attention over packed documents under a sliding window (one process, forward + "
                  "backward):", "", "| path | kernel calls | ms | largest difference of the two |", "|---|---:|---:|---:|"]
        for r in packed:
            if "error" in r:
                lines.append(f"| {r['kernel']} | error: {r['error']} |||")
            else:
                difference = r.get("max_abs_difference")
                lines.append(f"| {r['kernel']} | {r['calls_per_pass']} | {r['ms']:.0f} | "
                             f"{'' if difference is None else f'{difference:.2e}'} |")
    return lines
