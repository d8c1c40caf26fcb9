"""The command line: --help, flags checked before anything runs, errors as one line printed once."""

import os
import re
import runpy
import subprocess
import sys
import warnings

import pytest
import torch

from llama_cp.config import TrainConfig
from llama_cp.train.cli import run_cli
from recipes import finetune_longctx, plan_memory

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("module", [finetune_longctx, plan_memory])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_every_flag_with_its_doc(module, flag, capsys):
    run_cli(module.main, usage=module.__name__, argv=[flag])
    out = capsys.readouterr().out
    for name, _, doc in TrainConfig.flag_docs():
        assert f"--{name} (default " in out and doc in out, name


def test_plan_memory_help_shows_what_it_plans(monkeypatch, capsys):
    """``python -m recipes.plan_memory --help`` shows the planner's defaults (llama3-8b at
    131072 tokens), not the trainer's: every flag's shown default is what a plan without
    flags uses. The module's ``__main__`` block runs as written, in this process (runpy, as
    ``python -m`` does): the process boundary is not what this checks."""
    monkeypatch.setattr(sys, "argv", ["plan_memory", "--help"])
    with warnings.catch_warnings():  # runpy: "found in sys.modules" (the test module imported it)
        warnings.simplefilter("ignore", RuntimeWarning)
        runpy.run_module("recipes.plan_memory", run_name="__main__", alter_sys=True)
    stdout = capsys.readouterr().out
    planned = plan_memory.build_config(None, 8, {}).to_dict()
    flat = {k: v for section in TrainConfig.SECTIONS for k, v in planned.pop(section).items()} | planned
    assert flat["model_name"] == "llama3-8b" and flat["context_length"] == 131072
    for name, value in flat.items():
        shown = ",".join(value) if isinstance(value, tuple) else value
        assert f"\n  --{name} (default {shown}): " in stdout, (name, shown)


@pytest.mark.parametrize("flags, message", [
    (["--keep_last", "0"], "--keep_last must be >= 1, got 0"),
    (["--log_every", "0"], "--log_every must be >= 1, got 0"),
    (["--max_steps", "-5"], "--max_steps must be >= 0 (or -1: auto), got -5"),
    (["--warmup_steps", "-3"], "--warmup_steps must be >= 0, got -3"),
    (["--save_every", "-2"], "--save_every must be >= 0 (or -1: auto), got -2"),
    (["--eval_every", "-1"], "--eval_every must be >= 0, got -1"),
    (["--max_nonfinite_steps", "0"], "--max_nonfinite_steps must be >= 1, got 0"),
    (["--contex_length", "512"], "unknown flag --contex_length; did you mean --context_length?"),
    (["--dataset", "/no/such/file.jsonl", "--max_steps", "1"], "--dataset '/no/such/file.jsonl': no such file"),
    (["--collective_timeout", "0"], "--collective_timeout must be >= 1.0, got 0.0"),
    (["--peak_tflops", "-1"], "--peak_tflops must be >= 0.0, got -1.0"),
    (["--model_name", "/no/such/model"], "--model_name '/no/such/model': no such directory"),
    (["--cp", "2"], "--cp 2 --dp_shard -1 --dp_replicate 1 need 2 processes, and this is one: launch with "
                    "torchrun --nproc_per_node 2 -m recipes.finetune_longctx"),
    (["--attention_backend", "flash_attn", "--max_steps", "1"],
     "--attention_backend flash_attn cannot run here: flash_attn needs CUDA tensors, not cpu; backends that "
     "would run (cpu, float32, head size 32): sdpa_cpu, math"),
    (["--cp", "2", "--dp_shard", "2"], "need 4 processes, and this is one: launch with torchrun --nproc_per_node 4"),
])
def test_bad_input_is_one_line_before_anything_runs(flags, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(finetune_longctx.main, usage="x", argv=[*flags, "--output_dir", str(tmp_path / "run")])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not torch.distributed.is_initialized(), "refused after the process group was started"


def test_every_broken_parallel_rule_is_in_one_message(monkeypatch, capsys, tmp_path):
    """--cp 3 on 2 ranks breaks two rules (1024 tokens are not a multiple of 6; 2 ranks are not
    a multiple of 3): both in the one line, not one after the other is fixed."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun --nproc_per_node 2 sets it
    with pytest.raises(SystemExit):
        run_cli(finetune_longctx.main, usage="x", argv=["--cp", "3", "--output_dir", str(tmp_path / "run")])
    assert capsys.readouterr().err == (
        "error: --context_length 1024 must be a multiple of 2 x cp = 6 (each row is split into 2 x cp equal "
        "chunks); the padded length would be 1026: use --context_length 1026; and world_size(2) is not divisible "
        "by dp_replicate(1) * cp(3), so dp_shard=-1 cannot be inferred: choose --dp_replicate, --dp_shard and --cp "
        "for 2 processes (rerun with --debug for the traceback)\n")
    # a single process (a notebook's Trainer, plain python -m): the launch hint joins the context rule
    from llama_cp import Trainer

    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    cfg = TrainConfig()
    cfg.parallel.cp, cfg.output_dir = 3, str(tmp_path / "run")
    with pytest.raises(ValueError) as error:
        Trainer(cfg).fit()
    assert str(error.value).startswith("--context_length 1024 must be a multiple of 2 x cp = 6 ") and str(
        error.value).endswith("; and --cp 3 --dp_shard -1 --dp_replicate 1 need 3 processes, and this is one: launch "
                              "with torchrun --nproc_per_node 3 -m recipes.finetune_longctx ... (or "
                              "llama_cp.launch(cfg, nprocs=3) from a notebook)"), error.value
    assert not (tmp_path / "run").exists()


def test_model_directories_without_config_or_tokenizer_are_refused(capsys, tmp_path):
    from llama_cp.modules.causal_lm import build_causal_lm, embedded_llama_config

    build_causal_lm(embedded_llama_config(num_hidden_layers=1)).save_pretrained(tmp_path / "weights_only")
    (tmp_path / "nothing").mkdir()
    (tmp_path / "adapter").mkdir()  # a run's final/ with --use_peft, given as the model to train
    (tmp_path / "adapter" / "adapter_config.json").write_text('{"base_model_name_or_path": "/models/base"}')
    capsys.readouterr()  # save_pretrained's progress bar
    for directory, message in (("nothing", "has no config.json: it is not an HF model directory"),
                               ("adapter", "is a LoRA adapter (adapter_config.json), not a model: train from its base "
                                           "(--model_name /models/base), or merge it into its base first (python -m "
                                           f"recipes.export --checkpoint {tmp_path / 'adapter'} --merge_lora"),
                               ("weights_only", "has no tokenizer (none of tokenizer.json, tokenizer.model")):
        with pytest.raises(SystemExit):
            run_cli(finetune_longctx.main, usage="x",
                    argv=["--model_name", str(tmp_path / directory), "--output_dir", str(tmp_path / "run")])
        err = capsys.readouterr().err
        assert err.startswith(f"error: --model_name '{tmp_path / directory}' {message}"), err
        assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()  # refused before the run claimed anything



def test_checkpoints_llama_cp_cannot_train_are_refused_before_the_run_starts(capsys, tmp_path):
    """A family refused (here Phi) and a checkpoint stored quantized (fp8) are said in one line from
    the directory's config, before anything is built or written."""
    import json

    from transformers import AutoConfig

    for name, config in (("phi", AutoConfig.for_model("phi", num_hidden_layers=1)),
                         ("fp8", AutoConfig.for_model("llama", num_hidden_layers=1))):
        directory = tmp_path / name
        config.save_pretrained(directory)
        (directory / "tokenizer.json").write_text("{}")  # present: the config's check comes after the tokenizer's
        if name == "fp8":
            fields = json.loads((directory / "config.json").read_text())
            fields["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
            (directory / "config.json").write_text(json.dumps(fields))
    for directory, message in (("phi", r"model family 'phi' \(PhiForCausalLM\) is not supported by llama-cp: "),
                               ("fp8", rf"--model_name '{tmp_path / 'fp8'}': the checkpoint's weights are quantized ")):
        with pytest.raises(SystemExit):
            run_cli(finetune_longctx.main, usage="x",
                    argv=["--model_name", str(tmp_path / directory), "--output_dir", str(tmp_path / "run")])
        err = capsys.readouterr().err
        assert re.match(f"error: {message}", err), err
        assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()

@pytest.mark.slow
def test_an_empty_dataset_is_one_line(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    result = subprocess.run(
        [sys.executable, "-m", "recipes.finetune_longctx", "--dataset", str(tmp_path / "empty.jsonl"),
         "--output_dir", str(tmp_path / "run")], capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert errors == [f"error: --dataset '{tmp_path / 'empty.jsonl'}' is empty: it holds no rows "
                      "(rerun with --debug for the traceback)"], result.stderr[-2000:]
    assert not (tmp_path / "run").exists()  # refused before the run left anything (.lock, config.yaml)


@pytest.mark.slow
def test_a_log_file_gets_a_plain_line_every_log_every_steps(tmp_path):
    """stdout and stderr not a terminal (CI, SLURM, `> file 2>&1`): no progress bar and its
    carriage returns, only the metrics row every --log_every steps (tokens/s and memory in it)."""
    result = subprocess.run(
        [sys.executable, "-m", "recipes.finetune_longctx", "--context_length", "128", "--max_steps", "4",
         "--log_every", "2", "--num_passkey_samples", "8", "--num_eval_samples", "1", "--report_to", "none",
         "--output_dir", str(tmp_path / "run")],
        capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "\r" not in result.stdout + result.stderr and "train:" not in result.stderr, result.stderr[-2000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("step=")]
    assert [row.split()[0] for row in rows] == ["step=2", "step=4"], result.stdout
    assert all(re.search(r" tokens_per_sec=[\d.]+ .*peak_memory_bytes=\d+", row) for row in rows), rows


def test_debug_shows_the_traceback():
    with pytest.raises(ValueError, match="--log_every must be >= 1"):
        run_cli(finetune_longctx.main, usage="x", argv=["--log_every", "0", "--debug"])


def test_flag_table_matches_the_config():
    """docs/flags.md's table is the config's fields, defaults and docs (so --help and the docs agree);
    regenerate it with ``llama_cp.config.flag_table()``."""
    from llama_cp.config import flag_table

    with open(os.path.join(ROOT, "docs", "flags.md")) as f:
        text = f.read()
    rows = re.findall(r"^\| `--(\w+)` \| `([^`]*)` \| (.*) \|$", text, flags=re.M)
    from llama_cp.flags.help import shown as _shown

    want = [(name, _shown(d), doc) for name, d, doc in TrainConfig.flag_docs()]
    assert rows == want
    assert flag_table() in text


@pytest.mark.slow
def test_an_input_error_on_two_ranks_is_printed_once(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "recipes.finetune_longctx", "--dataset", str(tmp_path / "missing.jsonl"),
         "--output_dir", str(tmp_path / "run")],
        capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "missing.jsonl': no such file" in errors[0], result.stderr[-3000:]
    assert "llama_cp/" not in result.stderr  # no traceback from the ranks (torchrun reports the exit itself)


def test_a_read_only_output_dir_is_refused_before_training(capsys, tmp_path):
    from probes import tmpfs

    disk = tmp_path / "ro"
    disk.mkdir()
    with tmpfs(disk, "ro,size=1m"), pytest.raises(SystemExit):
        run_cli(finetune_longctx.main, usage="x", argv=["--output_dir", str(disk / "run")])
    err = capsys.readouterr().err
    assert err.startswith(f"error: --output_dir {disk / 'run'} is not writable (Read-only file system); "
                          "choose another --output_dir"), err


def test_a_structural_change_on_resume_is_one_line_before_anything_is_built(capsys, tmp_path):
    """A checkpoint records its run's config; --resume --lora_r 16 on an r=8 run is refused in one line
    (it used to be a 62-line traceback from the model load). The checkpoint here is only its marker and
    config: the refusal must come before anything would read more."""
    from llama_cp.train.checkpoint_files import checkpoint_dir
    from llama_cp.train.run_dir import yaml_dump

    out = tmp_path / "run"
    saved = checkpoint_dir(str(out), 2)
    os.makedirs(saved)
    open(os.path.join(saved, "COMPLETE"), "w").close()
    with open(os.path.join(saved, "config.yaml"), "w") as f:
        f.write(yaml_dump(TrainConfig.from_flags(use_peft=True, output_dir=str(out)).to_dict()))
    with pytest.raises(SystemExit):
        run_cli(finetune_longctx.main, usage="x",
                argv=["--resume", "--use_peft", "--lora_r", "16", "--output_dir", str(out)])
    err = capsys.readouterr().err
    assert err == (
        f"error: --resume cannot change --lora_r (8 -> 16): the checkpoint holds another model or optimizer state. "
        f"Resume with --lora_r 8 as the checkpoints in {out / 'checkpoints'} were trained, or start a new run "
        "(--overwrite or another --output_dir) (rerun with --debug for the traceback)\n"
    ), err


def test_the_export_command_lists_its_own_flags_and_refuses_a_typo_before_reading(capsys, tmp_path):
    """``python -m recipes.export --help`` shows its five flags, not the training flags; a mistyped
    flag or a missing checkpoint is one line, before anything is read or written."""
    from recipes.export import FLAGS, cli

    cli(["--help"])
    out = capsys.readouterr().out
    assert all(f"\n  --{name} (" in out for name in FLAGS) and "--context_length" not in out, out
    for argv, message in ((["--checkpont", "x", "--output_dir", "y"], "unknown flag --checkpont; did you mean --checkpoint?"),
                          (["--checkpoint", str(tmp_path / "none"), "--output_dir", str(tmp_path / "out")],
                           "no such directory"),
                          (["--checkpoint", str(tmp_path), "--output_dir", str(tmp_path / "out")],
                           "is neither a run's output_dir, a checkpoint directory"),
                          (["--checkpoint", str(tmp_path), "--output_dir", str(tmp_path / "out"), "--export_dtype",
                            "fp8"], "--export_dtype must be one of auto, float32, bfloat16, float16")):
        with pytest.raises(SystemExit):
            cli(argv)
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err, err
    assert not (tmp_path / "out").exists()


def test_an_error_while_a_progress_bar_is_open_is_printed_on_its_own_line(capsys):
    """A refusal raised while tqdm draws (packing rows, DPO's reference pass) was printed at the end
    of the bar's last refresh, ``packing train: 0%| | 0/61 error: ...``: the bar is closed first."""
    from tqdm import tqdm

    def main():
        bar = tqdm(total=61, desc="packing train", file=sys.stderr)
        bar.update(0)
        raise ValueError("preference pair 0: no chosen completion")

    with pytest.raises(SystemExit):
        run_cli(main, usage="demo", argv=[])
    err = capsys.readouterr().err
    assert "packing train" in err
    assert any(line.startswith("error: preference pair 0") for line in err.split("\n")), repr(err)


def test_the_notes_a_caller_added_to_an_error_are_in_its_line(monkeypatch, capsys):
    """An unknown --dataset is tried as a hub id; offline, datasets' own error names no flag, and the
    note that says what was tried (``add_note``) is printed in the same line, not dropped. (The data
    loader alone: a Trainer here would start a process group in pytest's own process.)"""
    import datasets

    from llama_cp.data.sources import load_examples

    def offline(name, *args, **kwargs):
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(SystemExit):
        run_cli(lambda: load_examples("someone/corpus"), usage="x", argv=[])
    (line,) = capsys.readouterr().err.strip().split("\n")
    assert line == (
        "error: Couldn't reach 'someone/corpus' on the Hub (LocalEntryNotFoundError); --dataset 'someone/corpus' is "
        "not a local path (no such file or directory), so it was treated as a HuggingFace hub dataset id: give a "
        "local file or directory, or a hub id this machine can reach (rerun with --debug for the traceback)")


def test_a_quiet_rank_waits_for_rank_0_to_say_an_error_of_every_rank(monkeypatch, capsys):
    """An input error fails every rank; rank 0 prints it, and the others wait before they exit,
    so that torchrun (which ends every worker as soon as one fails) does not end rank 0 before
    its line is out (Note [An error on every rank]; CI of 977b2d2 lost the line so): before the
    process group exists, QUIET_RANK_GRACE_S; with it, until rank 0 has set ERROR_SAID_KEY in the
    group's store (a stop by SIGTERM to torchrun must not wait out the grace). An error of one rank
    only is printed at once by that rank, with its rank, and nobody waits."""
    from datetime import timedelta

    from llama_cp.train import cli

    waits, store = [], None

    class Store:  # the group's TCPStore: what rank 0 sets and what the others wait for
        def __init__(self):
            self.calls = []

        def set(self, key, value):
            self.calls.append(("set", key, value))

        def wait(self, keys, timeout):
            self.calls.append(("wait", keys, timeout))

    monkeypatch.setattr(cli.time, "sleep", waits.append)
    monkeypatch.setattr(cli, "_group_store", lambda: store)

    def run(rank, error):
        def main():
            raise error

        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        with pytest.raises(SystemExit) as stop:
            run_cli(main, usage="demo", argv=[])
        assert stop.value.code == 1
        return capsys.readouterr().err

    missing = FileNotFoundError("--dataset 'x.jsonl': no such file")
    assert run(1, missing) == "" and waits == [cli.QUIET_RANK_GRACE_S]  # no group yet: the grace
    assert run(0, missing).startswith("error: --dataset") and waits == [cli.QUIET_RANK_GRACE_S]
    assert run(1, RuntimeError("CUDA error")).startswith("error (rank 1): CUDA error") \
        and waits == [cli.QUIET_RANK_GRACE_S]
    assert cli.QUIET_RANK_GRACE_S >= 5  # the ranks of one launch reach the same check seconds apart under load
    store = Store()  # the group is up: rank 1 waits for rank 0's word, rank 0 gives it after its line
    assert run(1, missing) == "" and waits == [cli.QUIET_RANK_GRACE_S]
    assert store.calls == [("wait", [cli.ERROR_SAID_KEY], timedelta(seconds=cli.QUIET_RANK_GRACE_S))]
    assert run(0, missing).startswith("error: --dataset")
    assert store.calls[1:] == [("set", cli.ERROR_SAID_KEY, "1")]
    assert run(0, RuntimeError("CUDA error")) and len(store.calls) == 2  # one rank's error: nobody waits on it
