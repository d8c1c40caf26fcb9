"""benchmarks/gpu_acceptance.py --dry_run: the GPU acceptance pipeline end to end on the CPU
(gloo, 2 ranks, tiny shapes), so that the command a GPU owner runs cannot rot."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(__file__))

pytestmark = pytest.mark.slow  # one group of 2 processes and a few memory plans: tens of seconds


def test_dry_run_writes_the_json_and_the_table(tmp_path):
    result = subprocess.run(
        [sys.executable, "benchmarks/gpu_acceptance.py", "--dry_run", "--output_dir", str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    with open(tmp_path / "gpu_acceptance.json") as f:
        report = json.load(f)
    assert report["dry_run"] is True and report["gpus"] == 2
    # 1. ring and Ulysses, one document and packed, all exact within transformers' own bf16 error
    exact = report["exactness"]
    assert [(e["strategy"], e["documents"]) for e in exact] == [
        ("ring", "one"), ("ring", "packed"), ("ulysses", "one"), ("ulysses", "packed")]
    for e in exact:
        assert e["pass"] is True and e["cp"] == 2, e
        assert set(e["llama_cp_bf16_error"]) == set(e["transformers_bf16_error"]) == {"loss", "logits", "gradients"}
        assert 0 < e["transformers_bf16_error"]["logits"] < 0.05, e  # bf16 is not fp32, and not far off
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
    for heading in ("## 1. Exactness", "## 2. Per-step peak memory", "## 3. Speed", "## 4. Longest context"):
        assert heading in table
    assert "| ring | packed | 2 |" in table and "192 tokens run, 200 do not." in table
