"""examples/longctx_lora.ipynb runs top to bottom, and launch() reports a child's failure.

The notebook runs the README's default job in its kernel (the check that it learns retrieval
lives here: one run of it serves both), loads its final/ with plain transformers and generates,
trains LoRA in the kernel's own process with a merged export, then runs the same config with
``launch(cfg, nprocs=2)`` at cp=2. Here we check what it displayed against what it wrote
under ``tmp_path``, and evaluate the default job's final/ under torchrun --cp 2 (started as soon
as the default job's cell has run, beside the notebook's later cells).
"""

import ast
import json
import math
import os
import re
import subprocess
import sys
import unittest.mock
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from llama_cp.config import TrainConfig
from llama_cp.parallel.mesh import free_port
from llama_cp import launch

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "longctx_lora.ipynb"
ROW_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "tokens_per_sec_per_gpu", "model_tflops_per_gpu",
            "peak_memory_bytes", "tokens_seen", "epoch", "eval_loss", "passkey_acc"}  # no mfu: a CPU has no peak




def _cell(nb, tag: str):
    (cell,) = [c for c in nb.cells if tag in c.metadata.get("tags", [])]
    return cell


def _displayed_row(cell) -> dict:
    """The dict a cell displayed as its value (its last expression)."""
    (result,) = [o for o in cell.outputs if o.output_type == "execute_result"]
    return ast.literal_eval(result.data["text/plain"])


def _stdout(cell) -> str:
    return "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")


def _last_logged_row(output_dir: Path) -> dict:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return json.loads(lines[-1])


def test_notebook_runs(tmp_path, monkeypatch):
    nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (pip install -e .[test])")
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install -e .[test])")
    monkeypatch.setenv("LLAMA_CP_OUTPUT_DIR", str(tmp_path))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    eval_cp2 = []  # the eval CLI on the default job's final/ under torchrun --cp 2, checked below

    def start_eval_cp2(cell, cell_index, execute_reply):
        """Once the default job's cell has run (its final/ written), its eval starts beside the later cells."""
        if "default" in cell.metadata.get("tags", []) and (execute_reply or {}).get("content", {}).get("status") == "ok":
            eval_cp2.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                 "recipes.eval_longctx", "--output_dir", str(tmp_path / "cp2"), "--model_name",
                 str(tmp_path / "default" / "final"), "--lengths", "1024", "--num_samples", "4", "--cp", "2",
                 "--passkey_digits", "1"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=NOTEBOOK.parents[1],
                env={**os.environ, "OMP_NUM_THREADS": "1"}))

    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}},
        on_cell_executed=start_eval_cp2,
    )
    try:
        client.execute()  # raises CellExecutionError on the first failing cell (the asserts of the check cell too)
        _check_notebook_outputs(nb, tmp_path, eval_cp2)
    finally:
        for proc in eval_cp2:
            if proc.returncode is None:  # not waited for by the checks: a failure before them
                proc.kill()
                proc.communicate()


def _check_notebook_outputs(nb, tmp_path: Path, eval_cp2: list) -> None:
    """What the executed notebook ``nb`` displayed and wrote, and the eval started beside it."""
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert errors == []

    # the default job learns to retrieve the passkey from full 1024-token rows: held-out accuracy from 0 (the
    # untrained model) to >= 0.9 (chance: 0.1, one digit and eos), printed as one line; --eval_needle writes the
    # trained model's grid (lengths 256 to 1024, every depth)
    line = re.search(r"passkey accuracy on 16 held-out rows of 1024 tokens: (\S+) before training -> (\S+) after",
                     _stdout(_cell(nb, "default")))
    assert line is not None and float(line[1]) == 0.0 and float(line[2]) >= 0.9, _stdout(_cell(nb, "default"))
    with open(tmp_path / "default" / "needle.json") as f:
        trained = json.load(f)
    assert trained["lengths"] == [256, 512, 1024] and trained["digits"] == 1 and trained["num_samples"] == 4
    assert trained["overall"] >= 0.9 and (tmp_path / "default" / "needle.png").exists(), trained
    # plain transformers' generate() on the export answers new prompts and stops at eos
    export = _stdout(_cell(nb, "export"))
    right = int(re.search(r"generate\(\) with plain transformers: (\d+)/10 keys right", export)[1])
    assert right >= 8 and export.count("in 2 tokens, stopped at eos: True") >= right, export
    # the eval CLI on the exported final/ under torchrun --cp 2 gives the trained grid's 1024-token row
    assert len(eval_cp2) == 1  # started when the default job's cell had run
    stdout, stderr = eval_cp2[0].communicate(timeout=600)
    result = subprocess.CompletedProcess(eval_cp2[0].args, eval_cp2[0].returncode, stdout, stderr)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "cp2" / "needle.json") as f:
        cp2 = json.load(f)
    assert cp2["accuracy"] == trained["accuracy"][-1:], (cp2, trained)
    assert f"passkey accuracy (1-digit keys, 4 samples per cell), overall {cp2['overall']:.2f}" in result.stdout

    # in-process LoRA run: the displayed row is the last row of metrics.jsonl
    row = _displayed_row(_cell(nb, "train"))
    assert set(row) == ROW_KEYS
    assert row["step"] == 24
    assert math.isfinite(row["loss"]) and math.isfinite(row["eval_loss"])
    assert 0.0 <= row["passkey_acc"] <= 1.0
    assert _last_logged_row(tmp_path / "lora") == row
    assert len((tmp_path / "lora" / "metrics.jsonl").read_text().splitlines()) == 24  # log_every=1
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (tmp_path / "lora" / "final" / name).is_file()
    assert (tmp_path / "lora" / "loss.png").is_file()
    assert "24 steps: mean loss" in _stdout(_cell(nb, "check"))
    assert "merged export vs trained model: largest logit difference" in _stdout(_cell(nb, "check"))
    assert (tmp_path / "lora" / "final_merged" / "model.safetensors").is_file()

    # launch(cfg, nprocs=2) at cp=2: rank 0's row came back through the launcher
    cp_row = _displayed_row(_cell(nb, "launch"))
    assert set(cp_row) == ROW_KEYS
    assert cp_row["step"] == 3
    assert math.isfinite(cp_row["loss"]) and math.isfinite(cp_row["eval_loss"])
    assert _last_logged_row(tmp_path / "lora_cp2") == cp_row
    assert (tmp_path / "lora_cp2" / "final" / "adapter_model.safetensors").is_file()
    assert "cp=2 result:" in _stdout(_cell(nb, "launch"))
    # same seed, data and warm-up lr: cp=2 must reproduce the one-process run's first steps
    one_process = [json.loads(line) for line in (tmp_path / "lora" / "metrics.jsonl").read_text().splitlines()]
    two_process = [json.loads(line) for line in (tmp_path / "lora_cp2" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in two_process] == [1, 2, 3]
    for key in ("loss", "grad_norm", "lr"):
        torch.testing.assert_close(
            [r[key] for r in two_process], [r[key] for r in one_process[:3]], rtol=1e-4, atol=0, msg=key
        )


def test_launch_raises_child_error(tmp_path):
    # cp=2 on a world of one fails in the child; the caller gets its message
    cfg = TrainConfig.from_flags(cp=2, context_length=64, max_steps=1, output_dir=str(tmp_path))
    with pytest.raises(mp.ProcessRaisedException, match=r"need 2 processes, and this is one"):
        launch(cfg, nprocs=1)
    assert not (tmp_path / "metrics.jsonl").exists()


class _Left(Exception):
    """What the patched os._exit raises: the process would have left here, with this status."""


@pytest.mark.parametrize("fails", [False, True], ids=["finishes", "fails"])
def test_a_launched_child_leaves_before_finalization(tmp_path, monkeypatch, fails):
    # A child that finished leaves with os._exit(0) after writing rank 0's row and tearing the
    # group down, not through the interpreter's finalization, where a gloo worker can abort it
    # (Note [Leaving a gloo job] in llama_cp/parallel/mesh.py). A child that failed raises, so torch's
    # spawn wrapper hands its traceback to the parent.
    import torch.distributed as dist

    import llama_cp.train.launcher
    import llama_cp.train.trainer

    class Trainer:
        def __init__(self, cfg):
            pass

        def fit(self):
            dist.init_process_group("gloo")
            if fails:
                raise ValueError("the step failed")
            return {"step": 1}

    def leave(status):
        raise _Left(status)

    monkeypatch.setattr(llama_cp.train.trainer, "Trainer", Trainer)
    monkeypatch.setattr(os, "_exit", leave)
    run = lambda: llama_cp.train.launcher._run_rank(0, TrainConfig(), 1, free_port(), str(tmp_path))  # noqa: E731
    # _run_rank sets RANK, WORLD_SIZE, MASTER_PORT, ... in this process: the environment is put back
    # afterwards (a later test's subprocesses must not inherit this MASTER_PORT)
    with unittest.mock.patch.dict(os.environ):
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(name, None)
        if fails:
            with pytest.raises(ValueError, match="the step failed"):
                run()
            assert not (tmp_path / llama_cp.train.launcher._RESULT_FILE).exists()
        else:
            with pytest.raises(_Left) as left:
                run()
            assert left.value.args == (0,)
            assert json.loads((tmp_path / llama_cp.train.launcher._RESULT_FILE).read_text()) == {"step": 1}
    assert not dist.is_initialized()
