"""benchmarks/gpu_report.py --dry_run: the one-GPU report end to end on the CPU (every part in its own
process, the planner beside them, tiny shapes), so the command a lent GPU runs cannot rot."""

import json
import os
import subprocess
import sys
import types

import pytest
import torch
import transformers

from benchmarks.gpu.report_one import markdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL_PARTS = "plan,correctness,speed,memory,kernels,profile,long"


@pytest.mark.slow  # eight processes of tiny steps and plans: about a minute
def test_dry_run_writes_every_part(tmp_path):
    out = tmp_path / "report"
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_report.py"), "--dry_run", "--parts",
                    ALL_PARTS, "--output_dir", str(out)], check=True, cwd=tmp_path, capture_output=True, timeout=600)
    report = json.loads((out / "gpu_report.json").read_text())
    env = report["environment"]
    assert (env["torch"], env["transformers"], env["device"]) == (torch.__version__, transformers.__version__,
                                                                 "cpu (--dry_run)"), env
    assert all(report["parts"][part].startswith("done") for part in ALL_PARTS.split(",")), report["parts"]
    assert env["cuda_allocator"].startswith(("expandable_segments:True (llama-cp's default)", "PYTORCH_")), env
    # exactness: every check ran and passes on the CPU's kernels, the blocks' merges among them (QLoRA's and
    # adamw8bit's are gpu_acceptance's functions, rehearsed by tests/test_gpu_acceptance.py)
    checks = {row["check"]: row for row in report["correctness"]}
    assert {"exact/llama/ring/packed", "exact/llama/ring/packed/blocks 16", "exact/llama/allgather/packed/blocks 16",
            "exact/mistral_window/ring/one/blocks 4", "checkpoint load/gemma3 vision-language",
            "kernel/heads of 512"} == checks.keys(), list(checks)
    assert all(row.get("pass") is True for row in checks.values()), checks
    # speed: llama-cp and transformers side by side at each length, the same first loss
    runs = {(r["context_length"], r["mode"], r["run"]): r for r in report["speed"]}
    for mode in ("lora", "full"):
        ours, theirs = runs[128, mode, "llama-cp"], runs[128, mode, "transformers + peft" if mode == "lora" else
                                                          "transformers"]
        assert ours["tokens_per_sec_per_gpu"] > 0 and theirs["tokens_per_sec_per_gpu"] > 0
        assert abs(ours["losses"][0] - theirs["losses"][0]) < 0.05, (ours["losses"], theirs["losses"])
    # each row's whole time, build and clean-up included, beside its timed steps
    assert all(r["row_seconds"] >= sum(r["step_seconds"]) > 0 for r in runs.values()), runs
    offloaded = runs[128, "full", "llama-cp, checkpointing + offload_params"]
    assert offloaded["losses"] == pytest.approx(runs[128, "full", "llama-cp"]["losses"], rel=1e-6)
    # memory: every measured row has its plan; the whole model's levers and longest context
    planned = {(p["mode"], p["context_length"], p["lever"]) for p in report["plan"] if "planned_bytes" in p
               and "lever" in p and "context_length" in p}
    assert all((m["mode"], m["context_length"], m["lever"]) in planned and m["measured_peak_bytes"] > 0
               for m in report["memory"]), report["memory"]
    assert {p["mode"] for p in report["plan"] if p.get("planned_max_context", 0) > 0} == {"lora", "full"}
    # long: one step at the cut model's longest planned context, beside its plan
    (longest,) = report["long"]
    cut = next(p for p in report["plan"] if p.get("model") == "llama3-8b cut")
    assert longest["context_length"] == cut["planned_max_context"] > 0 and longest["measured_peak_bytes"] > 0
    assert longest["planned_bytes"] == cut["planned_bytes"] <= cut["budget_bytes"], (longest, cut)
    for file in ("profile_full.json", "profile_transformers_full.json", "profile.json", "profile_transformers.json"):
        profile = json.loads((out / file).read_text())
        assert profile and abs(sum(row["share"] for row in profile) - 1) < 0.5
    assert [(r["mode"], r["run"]) for r in report["profile"]] == [
        ("full", "llama-cp, profiled"), ("full", "transformers, profiled"),
        ("lora", "llama-cp, profiled"), ("lora", "transformers + peft, profiled")]
    text = (out / "gpu_report.md").read_text()
    assert "## Where one full fine-tuning step's time goes: transformers (" in text
    kernels = [row["kernel"] for row in report["kernels"]]
    assert kernels[:2] == ["sdpa math, GQA expanded", "sdpa math, GQA enable_gqa"], kernels
    # llama-cp's packed documents under a window (the CPU stand-in of torch's flash kernel): varlen calls,
    # fewer than a call per piece, the same values
    varlen, per_piece = report["kernels"][2:]
    assert varlen["kernel"].endswith("varlen calls") and per_piece["kernel"].endswith("a call per piece")
    assert 0 < varlen["calls_per_pass"] < per_piece["calls_per_pass"] and varlen["max_abs_difference"] < 1e-4
    for section in ("## Exactness", "## Speed", "## Peak memory", "## The whole Llama-3-8B", "## torch's attention",
                    "## Where one LoRA"):
        assert section in text, section


def test_an_unknown_part_is_refused_in_one_line(tmp_path, capsys):
    # the script's main() in this process: argparse's refusal is SystemExit(2) with the line on stderr
    from benchmarks.gpu_report import main

    with pytest.raises(SystemExit) as refused:
        main(["--parts", "speed,fast", "--output_dir", str(tmp_path)])
    assert refused.value.code == 2 and "--parts: unknown fast" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # refused before anything was written or started


def test_the_window_row_in_blocks_makes_calls_with_fewer_queries_than_keys():
    """The correctness part's windowed row in blocks, at the GPU run's sizes, sends the kernel what a
    window in one causal square does not: full calls the window cuts (windows.window_parts), among
    them windowed ones with fewer queries than keys, whose flash window is aligned bottom-right."""
    from benchmarks.gpu.one_gpu_parts import exactness_runs
    from benchmarks.gpu.settings import Settings
    from llama_cp.attention import windows
    from llama_cp.attention.documents import DocumentLayout, tiles
    from llama_cp.parallel.sharding import document_starts

    length = 2048  # Settings.of(False, 1, 2).feature_len, without a GPU to build it
    window = Settings.window.fget(types.SimpleNamespace(feature_len=length))
    ((_, _, _, block),) = [case for case, _ in exactness_runs(8192, dry_run=False)
                           if case[0] == "mistral_window" and case[3]]
    assert 0 < block < window
    pieces = tiles(DocumentLayout(document_starts(torch.arange(length)[None])).ring_pieces(0, window), block)
    calls = [(rows.stop - rows.start, keys.stop - keys.start, part_lag)
             for p in pieces if not p.causal and p.lag is not None
             for rows, keys, part_lag in windows.window_parts(p.q.stop - p.q.start, p.k.stop - p.k.start, False,
                                                              p.call_lag)]
    assert any(part_lag == 0 and num_q < num_k for num_q, num_k, part_lag in calls), calls


def test_the_named_kernel_checks_run_right_after_the_references_they_reuse(tmp_path, capsys):
    """A GPU run's correctness part may be stopped at its limit (the first took 71 of its 75 s): the
    checks of the kernel auto does not take for a case (sdpa_flash for one document a row, sdpa_cudnn
    for packed documents, on an H100 without flash-attn) come third to sixth, after the two cases that
    compute the references they reuse; every check runs once. Also: a part's limit can be set."""
    from benchmarks.gpu.one_gpu_parts import exactness_runs

    runs = exactness_runs(8192, dry_run=False)
    assert [backend for _, backend in runs] == [None, None] + ["sdpa_flash", "sdpa_cudnn"] * 2 + [None] * 9
    assert {(case[0], case[2]) for case, _ in runs[2:6]} == {(case[0], case[2]) for case, _ in runs[:2]}
    assert all(backend == ("sdpa_cudnn" if packed else "sdpa_flash") for (_, _, packed, _), backend in runs[2:6])
    assert len(set(runs)) == len(runs) == 15
    assert {case for case, _ in exactness_runs(8192, dry_run=True)} <= {case for case, _ in runs}
    from benchmarks.gpu_report import main

    with pytest.raises(SystemExit) as refused:  # in this process, as the unknown part's test
        main(["--limit", "memory=x", "--output_dir", str(tmp_path / "unused")])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "--limit 'memory=x': give PART=SECONDS" in err, err
    assert not (tmp_path / "unused").exists()  # refused before anything was written


def test_rows_that_failed_are_shown_with_their_error():
    report = {"environment": {"device": "GPU"}, "dry_run": False, "layers": 4, "parts": {"speed": "done in 1 s"},
              "correctness": [{"check": "qlora", "error": "ValueError: refused"}],
              "speed": [{"context_length": 16, "mode": "lora", "run": "transformers + peft",
                         "error": "OutOfMemoryError: out"}], "profile": [], "memory": [], "long": [], "plan": [],
              "kernels": [{"context_length": 64, "kernel": "sdpa flash, GQA expanded", "error": "RuntimeError: no"},
                          {"context_length": 64, "kernel": "llama-cp sdpa_flash, 3 documents, window 16: varlen calls",
                           "ms": 2.0, "calls_per_pass": 1, "max_abs_difference": 0.0},
                          {"context_length": 64, "kernel": "llama-cp sdpa_flash, 3 documents, window 16: a call per piece",
                           "error": "RuntimeError: out"}]}
    text = markdown(report)
    assert "| qlora | 1 | error: ValueError: refused |" in text
    assert "| 16 | lora | transformers + peft | error: OutOfMemoryError: out |" in text
    assert "| sdpa flash, GQA expanded | error: RuntimeError: no |" in text
    assert "| llama-cp sdpa_flash, 3 documents, window 16: varlen calls | 1 | 2 | 0.00e+00 |" in text
    assert "| llama-cp sdpa_flash, 3 documents, window 16: a call per piece | error: RuntimeError: out |" in text


def test_the_attention_backend_that_ran_is_read_off_its_op():
    """The exactness rows name the kernel that ran, not the one asked for: the cuDNN op reads as
    sdpa_cudnn (the real op, on meta tensors)."""
    from benchmarks.gpu.correctness import AttentionKernels

    q = torch.empty(1, 2, 8, 16, device="meta", dtype=torch.bfloat16)
    with AttentionKernels() as kernels:
        torch.ops.aten._scaled_dot_product_cudnn_attention(q, q, q, None, True, 0.0, True, False)
    assert kernels.backends("sdpa_flash") == "sdpa_cudnn"


def test_the_packed_window_row_sends_windowed_varlen_calls():
    """The correctness part's packed window row, at the GPU run's sizes (one process): windowed
    squares and a shorter document in one varlen call with the window, fewer calls than pieces."""
    from benchmarks.gpu.correctness import packed_document_length
    from benchmarks.gpu.one_gpu_parts import exactness_runs
    from benchmarks.gpu.settings import Settings, random_row
    from llama_cp.attention.documents import DocumentLayout, tiles
    from llama_cp.attention.varlen import varlen_windows
    from llama_cp.parallel.sharding import document_starts

    assert ("mistral_window", "ring", True, 0) in [case for case, _ in exactness_runs(8192, dry_run=False)]
    length = 2048  # Settings.of(False, 1, 2).feature_len, without a GPU to build it
    window = Settings.window.fget(types.SimpleNamespace(feature_len=length))
    row = random_row(types.SimpleNamespace(vocab_size=8), length, packed_document_length("mistral_window", length))
    block = tiles(DocumentLayout(document_starts(row["position_ids"])).ring_pieces(0, window), 0)
    ((call,),) = varlen_windows(block)
    assert {s.window for s in call} == {(window - 1, 0)} and len(call) == len(block) == 3
    assert sorted(s.piece.lag is None for s in call) == [False, False, True]


def test_the_kernels_part_keeps_each_measures_rows_before_the_next_runs(tmp_path, monkeypatch):
    """The kernels part writes torch's kernels' rows before the packed window calls run: a part past its
    time limit is killed, and a part that had added nothing yet would leave no row."""
    from benchmarks.gpu import one_gpu, one_gpu_parts

    def killed(length, device):
        raise KeyboardInterrupt("killed at its time limit")

    monkeypatch.setattr(one_gpu_parts, "_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(one_gpu, "attention_kernels", lambda length, device: [{"kernel": "math", "ms": 1.0}])
    monkeypatch.setattr(one_gpu, "packed_window_calls", killed)
    rows = one_gpu_parts.Rows(str(tmp_path / "kernels.json"))
    with pytest.raises(KeyboardInterrupt):
        one_gpu_parts.kernels(rows, one_gpu_parts.shapes(True, 2))
    with open(tmp_path / "kernels.json") as f:
        assert json.load(f) == [{"context_length": 128, "kernel": "math", "ms": 1.0}]
