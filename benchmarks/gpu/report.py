"""The GPU acceptance report: what ran (the environment), each check's verdict, and the report as
markdown tables, one section per part (the format docs/benchmarks.md shows)."""

from __future__ import annotations

import math
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch

from benchmarks.gpu.settings import Settings

GiB = 1 << 30


def installed_version(*names: str) -> str:
    """The installed version of the first of ``names`` that is installed, or "not installed"."""
    for name in names:
        try:
            return version(name)
        except PackageNotFoundError:
            pass
    return "not installed"


def environment(s: Settings, exact: list[dict]) -> dict[str, Any]:
    """What ran: the device, the GPUs used and visible, the versions that decide what runs, and
    the attention backends the exactness checks saw run (``AttentionKernels``)."""
    cuda = s.device_type == "cuda"
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu (--dry_run)",
        "gpus": s.nproc, "visible_gpus": torch.cuda.device_count() if cuda else 0, "cuda": torch.version.cuda,
        "torch": torch.__version__, "transformers": installed_version("transformers"), "bitsandbytes": installed_version("bitsandbytes"),
        "flash_attn": installed_version("flash-attn", "flash_attn"),
        "attention_backends": sorted({b for e in exact if "attention_backend" in e
                                      for b in e["attention_backend"].split("+")}),
    }


def verdict(result: dict) -> str:
    if "error" in result:
        return f"error: {result['error']}"
    return "pass" if result.get("pass") is True else "FAIL"


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GiB:.2f}"


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _errors(ours: dict, ref: dict, keys: tuple[str, ...]) -> str:
    return " | ".join(f"{d[k]:.2e}" for d in (ours, ref) for k in keys)


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown tables (the format docs/benchmarks.md shows)."""
    lines = (header_lines(report) + correctness_lines(report) + memory_lines(report) + speed_lines(report)
             + longest_lines(report))
    return "\n".join(lines) + "\n"


def header_lines(report: dict[str, Any]) -> list[str]:
    """The title, what ran, and how many checks pass."""
    env, checks = report["environment"], report["checks"]
    failing = [f"{name} ({v})" for name, v in checks.items() if v != "pass"]
    return [f"# llama-cp GPU acceptance: {env['gpus']} x {env['device']}", "",
            f"torch {env['torch']} (CUDA {env['cuda']}), transformers {env['transformers']}, bitsandbytes "
            f"{env['bitsandbytes']}, flash-attn {env['flash_attn']}; {env['visible_gpus']} GPUs visible; attention "
            f"backends that ran: {', '.join(env['attention_backends']) or '-'}.", "",
            f"Checks: {len(checks) - len(failing)} of {len(checks)} pass" + (
                "; not passing: " + "; ".join(failing) if failing else "."), ""]


def correctness_lines(report: dict[str, Any]) -> list[str]:
    """Part 1: the exactness table, then QLoRA's and adamw8bit's."""
    lines = ["## 1. Exactness (relative error vs transformers fp32; yardstick: transformers bf16)", "",
             "| case | strategy | documents | cp | backend | loss | logits | gradients | bf16 loss | bf16 logits "
             "| bf16 gradients | feature effect | pass |",
             "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for e in report["exactness"]:
        case, strategy, documents = e["check"].split("/")[1:]
        if "error" in e:
            lines.append(f"| {case} | {strategy} | {documents} | {e['error']} |||||||||")
            continue
        degree = f" (u {e['ulysses_degree']})" if e["ulysses_degree"] else ""
        lines.append(f"| {case} | {strategy}{degree} | {documents} | {e['cp']} | {e['attention_backend']} | "
                     + _errors(e["llama_cp_bf16_error"], e["transformers_bf16_error"], ("loss", "logits", "gradients"))
                     + f" | {_num(e['feature_effect'], '.2e')} | {e['pass']} |")
    lines += _one_row_table(
        "QLoRA (NF4 base + LoRA, bf16, vs transformers + bitsandbytes + peft in fp32; yardstick: the same in bf16):",
        "| cp | NF4 layers | codes identical | loss | LoRA gradients | bf16 loss | bf16 LoRA gradients | pass |",
        "|---:|---:|---|---:|---:|---:|---:|---|", report["qlora"], _qlora_row)
    lines += _one_row_table(
        "adamw8bit (fp32; updates after the steps vs the same optimizer in one process; yardstick: that run vs fp32 "
        "AdamW):", "| cp | steps | 8-bit state share | update error | yardstick | finite | pass |",
        "|---:|---:|---:|---:|---:|---|---|", report["adamw8bit"], _adamw8bit_row)
    return lines


def _one_row_table(caption: str, header: str, align: str, result: dict, row) -> list[str]:
    """The table of a check with one result: ``row(result)``, or the error that stopped it."""
    columns = header.count("|") - 1
    return ["", caption, "", header, align,
            f"| {result['error']} " + "|" * (columns - 1) if "error" in result else row(result)]


def _qlora_row(q: dict) -> str:
    return (f"| {q['cp']} | {q['nf4_layers']} | {q['nf4_codes_identical']} | "
            + _errors(q["llama_cp_bf16_error"], q["transformers_bf16_error"], ("loss", "lora_gradients"))
            + f" | {q['pass']} |")


def _adamw8bit_row(a: dict) -> str:
    return (f"| {a['cp']} | {a['steps']} | {a['state_8bit_share']:.1%} | "
            f"{a['update_error_vs_one_process']:.2e} | {a['yardstick_8bit_vs_fp32_adamw']:.2e} | "
            f"{a['finite']} | {a['pass']} |")


def memory_lines(report: dict[str, Any]) -> list[str]:
    """Part 2: planned against measured peak of each lever and length."""
    lines = ["", "## 2. Per-step peak memory per GPU (GiB), cp = all GPUs", "",
             "| lever | context | planned | measured | planned / measured |", "|---|---:|---:|---:|---:|"]
    for m in report["memory"]:
        measured = _gib(m["measured_bytes"]) if m["error"] is None else f"({m['error'][:40]})"
        lines.append(f"| {m['lever']} | {m['context_length']} | {_gib(m['planned_bytes'])} | {measured} | "
                     f"{_num(m['planned_over_measured'], '.3f')} |")
    return lines


def speed_lines(report: dict[str, Any]) -> list[str]:
    """Part 3: the throughput table and the ring's efficiency."""
    lines = ["", "## 3. Speed", "",
             "| cp | strategy | documents | context | tokens/s/GPU | model TFLOP/s/GPU | MFU |",
             "|---:|---|---|---:|---:|---:|---:|"]
    for r in report["speed"]:
        lines.append(f"| {r['cp']} | {r['strategy']} | {r['documents']} | {r['context_length']} | "
                     f"{_num(r.get('tokens_per_sec_per_gpu'), '.1f')} | {_num(r.get('model_tflops_per_gpu'), '.2f')} | "
                     f"{_num(r.get('mfu'), '.1%')} |")
    e = report["ring_efficiency"]
    lines += ["", f"Ring efficiency at cp {e['cp']} ({e['context_length']} tokens) vs one GPU alone on its "
              f"{e['local_tokens']} local tokens: {_num(e['efficiency'], '.1%')}."]
    return lines


def longest_lines(report: dict[str, Any]) -> list[str]:
    """Part 4, when it ran: the longest context that runs and the first that does not."""
    longest = report["longest"]
    if longest and "error" in longest:
        return ["", "## 4. Longest context", "", f"failed: {longest['error']}"]
    if longest:
        return ["", "## 4. Longest context", "",
                f"cp {longest['cp']}, activation checkpointing: {longest['longest_context']} tokens run, "
                f"{longest['first_failing']} do not."]
    return []
