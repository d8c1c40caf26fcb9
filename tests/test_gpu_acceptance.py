"""benchmarks/gpu_acceptance.py --dry_run: the GPU acceptance pipeline end to end on the CPU
(gloo, 2 ranks, tiny shapes), so that the command a GPU owner runs cannot rot."""

import json
import os
import runpy
import sys
from importlib.metadata import PackageNotFoundError, version

import pytest
import torch
import transformers

from llama_cp.modules.quantize import installed_qlora_refusal
from probes import bnb_cpu_optimizer_problem

ROOT = os.path.dirname(os.path.dirname(__file__))
STRATEGIES = ("ring", "ulysses", "allgather", "hybrid")
#: Every check of part 1: each strategy on a Llama (one document and packed), on a Mistral with a
#: sliding window and on a Gemma 2 with soft-capped attention; QLoRA; adamw8bit.
CHECKS = [
    *(f"exact/llama/{strategy}/{documents}" for documents in ("one", "packed") for strategy in STRATEGIES),
    *(f"exact/{case}/{strategy}/one" for case in ("mistral_window", "gemma2_softcap") for strategy in STRATEGIES),
    "qlora", "adamw8bit",
]

pytestmark = pytest.mark.slow  # one group of 2 processes and a few memory plans: tens of seconds


def _installed(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def test_dry_run_writes_the_json_and_the_table(tmp_path, monkeypatch):
    # `python benchmarks/gpu_acceptance.py --dry_run` run as that script, in this process (runpy
    # makes it __main__, so its spawned ranks start from the script as they do from the command):
    # this process has torch and transformers imported already.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the ranks' threads, as the command's subprocess had
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts the repository first
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["benchmarks/gpu_acceptance.py", "--dry_run", "--output_dir", str(tmp_path)])
    try:
        runpy.run_path(os.path.join(ROOT, "benchmarks", "gpu_acceptance.py"), run_name="__main__")
    except SystemExit as exit_info:
        assert exit_info.code in (0, None), exit_info
    with open(tmp_path / "gpu_acceptance.json") as f:
        report = json.load(f)
    env = report["environment"]
    assert report["dry_run"] is True and env["gpus"] == 2 and env["device"] == "cpu (--dry_run)", env
    assert (env["torch"], env["transformers"]) == (torch.__version__, transformers.__version__), env
    assert env["bitsandbytes"] == _installed("bitsandbytes") and env["flash_attn"] == _installed("flash-attn"), env
    assert env["attention_backends"] == ["math", "sdpa_cpu"], env  # CPU: torch's CPU kernel, llama-cp's dense one

    # 1. every check present, each passing where this machine can run it
    checks = report["checks"]
    assert list(checks) == CHECKS, checks
    unrunnable = {"qlora": installed_qlora_refusal(), "adamw8bit": bnb_cpu_optimizer_problem()}
    for name, verdict in checks.items():
        assert verdict == "pass" or (unrunnable.get(name) and verdict.startswith("error: ")), (name, verdict)
    exact = {e["check"]: e for e in report["exactness"]}
    assert list(exact) == CHECKS[:-2]
    for name, e in exact.items():
        assert e["pass"] is True and e["cp"] == 2 and e["tokens"] == 64, e
        assert set(e["llama_cp_bf16_error"]) == set(e["transformers_bf16_error"]) == {"loss", "logits", "gradients"}
        assert 0 < e["transformers_bf16_error"]["logits"] < 0.05, e  # bf16 is not fp32, and not far off
        assert e["ulysses_degree"] == (1 if e["strategy"] == "hybrid" else None), e  # N = 2 is prime
        if e["case"] == "llama":
            assert e["feature_effect"] is None and e["attention_backend"] == "sdpa_cpu", e
            assert e["attention_ops"] == ["aten::_scaled_dot_product_flash_attention_for_cpu"], e
        else:  # the window or the cap moves the logits by far more than bf16 rounding
            assert e["feature_effect"] > 0.1 > 4 * e["transformers_bf16_error"]["logits"], e
    # every soft-capped score goes through llama-cp's exact dense kernel on CPU: no attention op
    assert {exact[f"exact/gemma2_softcap/{s}/one"]["attention_backend"] for s in STRATEGIES} == {"math"}
    if checks["qlora"] == "pass":
        q = report["qlora"]
        assert q["nf4_codes_identical"] is True and q["nf4_layers"] == 2 * 7 and q["cp"] == 2, q
        assert 0 < q["llama_cp_bf16_error"]["lora_gradients"] <= 2 * q["transformers_bf16_error"]["lora_gradients"]
    if checks["adamw8bit"] == "pass":
        a = report["adamw8bit"]
        assert a["finite"] is True and a["steps"] == 3 and a["state_8bit_share"] > 0.99, a
        assert a["update_error_vs_one_process"] < a["yardstick_8bit_vs_fp32_adamw"] / 10, a
        assert a["losses"] == pytest.approx(a["one_process_losses"], rel=1e-5), a

    # 2. every lever planned and measured
    levers = [m["lever"] for m in report["memory"]]
    assert levers == ["none", "activation_checkpointing", "+ offload_checkpoints", "+ tiled mlp, norms", "lora"]
    for m in report["memory"]:
        assert m["error"] is None and m["planned_bytes"] > 0 and m["measured_bytes"] > 0, m
    # 3. cp 1 and 2, ring and Ulysses, one document and packed, with throughput figures (no MFU on a CPU)
    speed = {(r["cp"], r["strategy"], r["documents"]): r for r in report["speed"]}
    assert set(speed) == {(1, "ring", "one"), (1, "ring", "packed"), (2, "ring", "one"), (2, "ring", "packed"),
                          (2, "ulysses", "one"), (2, "ulysses", "packed")}
    for r in speed.values():
        assert r["tokens_per_sec_per_gpu"] > 0 and r["model_tflops_per_gpu"] > 0 and "mfu" not in r, r
    # packed rows of 16-token documents: far fewer attention pairs, so fewer model FLOPs per token
    one, packed = speed[(2, "ring", "one")], speed[(2, "ring", "packed")]
    assert (packed["model_tflops_per_gpu"] / packed["tokens_per_sec_per_gpu"]
            < one["model_tflops_per_gpu"] / one["tokens_per_sec_per_gpu"])
    assert report["ring_efficiency"]["efficiency"] > 0 and report["ring_efficiency"]["local_tokens"] == 64
    # 4. the bisection: 128 and 192 tokens run, longer counts as out of memory in a dry run
    assert report["longest"]["longest_context"] == 192 and report["longest"]["first_failing"] == 200
    assert report["longest"]["tried"] == {"128": True, "192": True, "200": False, "208": False, "224": False,
                                          "256": False}
    with open(tmp_path / "gpu_acceptance.md") as f:
        table = f.read()
    for heading in ("## 1. Exactness", "QLoRA (NF4", "adamw8bit (fp32", "## 2. Per-step peak memory", "## 3. Speed",
                    "## 4. Longest context"):
        assert heading in table
    passing = sum(verdict == "pass" for verdict in checks.values())
    assert f"Checks: {passing} of {len(CHECKS)} pass" in table
    assert "| llama | ring | packed | 2 | sdpa_cpu |" in table and "192 tokens run, 200 do not." in table


@pytest.mark.parametrize("n", range(1, 9))
def test_shapes_split_for_every_strategy_on_1_to_8_gpus(n):
    """What the GPU run chooses from N: heads Ulysses and the hybrid split, a hybrid degree that
    divides N and the heads (both halves over several ranks where N has a divisor between), and
    lengths the zigzag cuts into 2 x N chunks (the exactness rows into documents of L / 8 too)."""
    sys.path.insert(0, ROOT)
    try:
        from benchmarks.gpu import settings
    finally:
        sys.path.remove(ROOT)

    shape = settings.heads_for(n, 16, 64)
    heads = shape["num_attention_heads"]
    assert heads >= 16 and heads % n == 0 and heads % shape["num_key_value_heads"] == 0, shape
    assert shape["hidden_size"] % 256 == 0, shape  # whole blocks of adamw8bit's state in every shard
    u = settings.hybrid_degree(n, heads)
    assert n % u == 0 and heads % u == 0 and (1 < u < n or all(n % d for d in range(2, n))), (n, u)
    for length in (8192, 2048):
        exact = settings.round_up(length, 16 * n)
        assert exact % (2 * n) == 0 and (exact // 8) % (2 * n) == 0 and exact - length < 16 * n
