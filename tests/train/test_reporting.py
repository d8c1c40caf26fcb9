"""Reporters: --report_to checks, and the W&B path against a stand-in ``wandb`` module (the real
one is optional and not installed for the tests; TensorBoard is read back in test_recipe.py)."""

import importlib.machinery
import os
import sys
import types

import pytest
import torch

from llama_cp.config import TrainConfig, check_report_to
from llama_cp.train.reporting import WANDB_ID_FILE, Reporter


class FakeRun:
    def __init__(self, calls, run_id):
        self.calls, self.id = calls, run_id

    def log(self, values, step):
        self.calls.append(("log", values, step))

    def finish(self):
        self.calls.append(("finish",))


@pytest.fixture
def fake_wandb(monkeypatch):
    calls = []
    module = types.ModuleType("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)

    def init(**kwargs):
        calls.append(("init", kwargs))
        return FakeRun(calls, kwargs["id"] or "run123")

    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def test_wandb_gets_the_rows_and_a_resume_continues_its_run(tmp_path, fake_wandb):
    info = {"config": {"lr": 1e-3}, "versions": {"torch": "x"}}
    reporter = Reporter(str(tmp_path), ["wandb"], run_info=info, start_step=0)
    reporter.log({"step": 1, "loss": 2.5, "lr": 1e-3, "eval_loss": 2.0, "skipped": True}, step=1)
    reporter.close()
    assert fake_wandb[0] == ("init", {"project": "llama-cp", "dir": str(tmp_path), "id": None, "resume": None,
                                      "config": info})
    assert fake_wandb[1] == ("log", {"train/loss": 2.5, "train/lr": 1e-3, "eval/eval_loss": 2.0,
                                     "train/skipped": 1.0}, 1)
    assert fake_wandb[2] == ("finish",)
    assert (tmp_path / WANDB_ID_FILE).read_text() == "run123"
    Reporter(str(tmp_path), ["wandb"], run_info=info, start_step=3).close()
    assert fake_wandb[3][1]["id"] == "run123" and fake_wandb[3][1]["resume"] == "allow"


def test_nothing_is_reported_off_rank_zero(tmp_path, fake_wandb):
    Reporter(str(tmp_path), ["tensorboard", "wandb"], run_info={}, enabled=False).log({"loss": 1.0}, step=1)
    assert fake_wandb == [] and not (tmp_path / "tensorboard").exists()


@pytest.mark.parametrize("value, message", [
    ("mlflow", "--report_to 'mlflow': choose from tensorboard, wandb or none"),
    ("none,tensorboard", "--report_to none cannot be combined with other reporters"),
])
def test_bad_report_to_is_refused(value, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig.from_flags(report_to=value)


def test_wandb_without_the_package_names_the_fix(monkeypatch):
    monkeypatch.setattr("llama_cp.flags.checks._importable", lambda name: name != "wandb")
    with pytest.raises(ValueError, match="--report_to wandb needs the wandb package: pip install wandb"):
        check_report_to(["wandb"])
    assert TrainConfig.from_flags(report_to="none").report_to == ("none",)


def test_peak_memory_on_cuda_resets_and_reads_the_allocator_peak(monkeypatch):
    from llama_cp.train.reporting import PeakMemory

    calls = []
    monkeypatch.setattr("torch.cuda.reset_peak_memory_stats", lambda: calls.append("reset"))
    monkeypatch.setattr("torch.cuda.max_memory_allocated", lambda: calls.append("read") or 12345)
    peak = PeakMemory("cuda")
    peak.reset()
    assert peak.read() == 12345 and calls == ["reset", "read"]


def peak_rise(size: int) -> tuple[int, int, int]:
    """PeakMemory("cpu") before, while and after a float32 tensor of ``size`` bytes (every page touched)
    lives, the peak reset before and after it."""
    from llama_cp.train.reporting import PeakMemory

    peak = PeakMemory("cpu")
    peak.reset()
    before = peak.read()
    big = torch.ones(size // 4)
    during = peak.read()
    del big
    peak.reset()
    return before, during, peak.read()


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="the peak RSS cannot be reset here")
def test_peak_memory_on_cpu_is_the_peak_resident_set_since_the_reset():
    # In a process forked from the suite's preloaded server (Note [Ranks forked from a preloaded server]):
    # glibc maps a block over its mmap threshold (32 MiB at most) fresh, so 256 MiB raises the resident set
    # by its size there. In pytest's own process, after the whole suite, it once did not (the peak did
    # not move: resident memory served it), while the file alone passed.
    from dist_harness import map_in_processes

    size = 256 * 2**20
    ((before, during, after),) = map_in_processes(peak_rise, [size], processes=1)
    assert during - before >= 0.9 * size, (before, during)
    assert during - after >= 0.9 * size, (during, after)  # the reset forgot the freed tensor's pages
