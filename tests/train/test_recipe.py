"""The recipe end to end: the CLI on 1 and 2 processes, crash + resume, 8-bit AdamW, LoRA export.

CLI runs are subprocesses (plain python and torchrun); the in-process checks run
in a world-1 gloo process group (dist_harness), like a notebook would: two such worlds side by
side, each running half of the checks (Note [Worlds side by side] in tests/dist_harness.py).
"""

import contextlib
import io
import json
import math
import os
import subprocess
import sys
import tempfile

import peft
import pytest
import torch

from dist_harness import Checks

SMALL = [
    "--context_length", "256", "--num_passkey_samples", "16", "--num_eval_samples", "4",
    "--max_steps", "4", "--log_every", "1", "--warmup_steps", "1", "--lr", "3e-3", "--save_every", "0",
]


#: An accelerate config file for one machine with 2 processes (accelerate runs torchrun underneath).
ACCELERATE_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
num_processes: 2
num_machines: 1
machine_rank: 0
mixed_precision: 'no'
rdzv_backend: static
same_network: true
"""


def start_cli(output_dir, *flags, nproc=1, launcher_name="torchrun") -> subprocess.Popen:
    """Start the recipe on ``nproc`` processes (plain python, torchrun or `accelerate launch`);
    :func:`finish_cli` waits for it. Runs started together share the cores: a one-process run
    leaves one of two idle."""
    launcher = [sys.executable, "-m", "recipes.finetune_longctx"]
    if nproc > 1 and launcher_name == "torchrun":
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                    "-m", "recipes.finetune_longctx"]
    elif nproc > 1:
        config = os.path.join(output_dir, "accelerate.yaml")
        os.makedirs(output_dir, exist_ok=True)
        with open(config, "w") as f:
            f.write(ACCELERATE_CONFIG.replace("num_processes: 2", f"num_processes: {nproc}"))
        # through this interpreter, not the `accelerate` script on PATH (a venv used without activating it)
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "-m",
                    "recipes.finetune_longctx"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [*launcher, *SMALL, "--output_dir", str(output_dir), *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )


def finish_cli(proc: subprocess.Popen, check=True) -> subprocess.CompletedProcess:
    try:
        stdout, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    result = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    if check:
        assert result.returncode == 0, result.stderr[-4000:]
    return result


def run_cli(output_dir, *flags, nproc=1, check=True, launcher_name="torchrun"):
    return finish_cli(start_cli(output_dir, *flags, nproc=nproc, launcher_name=launcher_name), check=check)


def read_metrics(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def single_runs(tmp_path_factory):
    """The single-process reference runs: batch 1 and batch 2 per step."""
    runs, started = {}, {}
    for batch_size in (1, 2):  # side by side: each takes one core (OMP_NUM_THREADS=1)
        runs[batch_size] = out = tmp_path_factory.mktemp(f"single_b{batch_size}")
        # --peak_tflops: an mfu on CPU too (Note [Model FLOPs]); it changes no loss
        started[batch_size] = start_cli(out, "--batch_size", str(batch_size),
                                        *(["--peak_tflops", "0.5"] if batch_size == 1 else []))
    try:
        for batch_size, proc in started.items():
            result = finish_cli(proc)
            (runs[batch_size] / "stdout.txt").write_text(result.stdout)
    finally:
        for proc in started.values():
            proc.kill()  # none is left running when one failed (a no-op on one that exited)
    return runs


def test_single_process_run_writes_everything(single_runs):
    out = single_runs[1]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for key in ("loss", "lr", "grad_norm", "tokens_per_sec", "peak_memory_bytes"):
        assert all(key in r for r in rows), key
    assert "eval_loss" in rows[-1] and "passkey_acc" in rows[-1]
    assert os.path.exists(os.path.join(out, "loss.png"))
    # the rows, read back from TensorBoard's event files; the config and versions beside them
    scalars = tensorboard_scalars(out)
    for key in ("loss", "lr", "grad_norm", "tokens_per_sec", "tokens_per_sec_per_gpu", "model_tflops_per_gpu", "mfu"):
        assert_series(scalars[f"train/{key}"], [(r["step"], r[key]) for r in rows])
    # throughput per GPU (one here): model FLOPs per token of the passkey rows of 256 tokens, the
    # same whatever the speed. The default warm-up (--passkey_warmup 0.9 of the 4 rows read: all 4)
    # packs two documents of 128 tokens per row: 2 x 128 x 129 / 2 causal pairs over 256 tokens,
    # where one document would count 257 / 2 per token; mfu against --peak_tflops 0.5
    from llama_cp.model.flops import model_flops
    from llama_cp.modules.causal_lm import embedded_llama_config

    flops = model_flops(embedded_llama_config())
    for r in rows:
        assert r["tokens_per_sec_per_gpu"] == pytest.approx(r["tokens_per_sec"])
        per_token = r["model_tflops_per_gpu"] * 1e12 / r["tokens_per_sec_per_gpu"]
        assert per_token == pytest.approx(flops.per_token + flops.per_pair * 2 * (128 * 129 / 2) / 256)
        assert r["mfu"] == pytest.approx(r["model_tflops_per_gpu"] / 0.5)
    summary = [line for line in (out / "stdout.txt").read_text().splitlines() if line.startswith("throughput")]
    assert len(summary) == 1 and summary[0].startswith("throughput over 3 steps: ") and " of 0.5 TFLOP/s" in summary[0]
    assert_series(scalars["eval/eval_loss"], [(4, rows[-1]["eval_loss"])])
    with open(os.path.join(out, "run_info.json")) as f:
        info = json.load(f)
    assert info["config"]["data"]["context_length"] == 256 and info["versions"]["torch"] == torch.__version__
    assert info["versions"]["peft"] == peft.__version__  # read from its metadata, not imported
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(os.path.join(out, "final"))
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(out, "final"))
    assert model.config.vocab_size >= len(tokenizer)
    # the export's special-token ids are its tokenizer's (they were 1 and 2 against <|bos|> 257, <|eos|> 258):
    # generate() stops at the eos the model was trained to write
    from transformers import GenerationConfig

    generation = GenerationConfig.from_pretrained(os.path.join(out, "final"))
    for config in (model.config, generation):
        assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == \
            (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (257, 258, 256)


def test_special_token_ids_follow_the_tokenizer_at_export():
    from transformers import LlamaForCausalLM

    from llama_cp.data.tokenizer import byte_tokenizer
    from llama_cp.modules.causal_lm import embedded_llama_config
    from llama_cp.train.export import align_special_tokens

    tokenizer = byte_tokenizer()
    model = LlamaForCausalLM(embedded_llama_config(bos_token_id=1, eos_token_id=[2, 258], pad_token_id=None))
    changed = align_special_tokens(model, tokenizer)
    assert (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id) == (257, [2, 258], 256)
    assert "LlamaConfig.bos_token_id 1 -> 257" in changed and not any("eos" in line for line in changed)
    assert align_special_tokens(model, tokenizer) == []


@pytest.mark.parametrize("flags, reference_batch, launcher", [  # the ring under accelerate, which runs torchrun
    (["--cp", "2", "--cp_strategy", "ulysses"], 1, "torchrun"), (["--dp_shard", "2"], 2, "torchrun"),
    (["--cp", "2"], 1, "accelerate"),
])
def test_two_processes_match_the_single_process_trajectory(tmp_path, single_runs, flags, reference_batch, launcher):
    """torchrun, or `accelerate launch` with an accelerate config file, on 2 processes."""
    out = tmp_path / "run"
    run_cli(out, *flags, nproc=2, launcher_name=launcher)
    got, want = read_metrics(out), read_metrics(single_runs[reference_batch])
    for key in ("loss", "grad_norm", "lr"):
        torch.testing.assert_close(
            torch.tensor([r[key] for r in got]), torch.tensor([r[key] for r in want]), rtol=1e-4, atol=1e-6,
            msg=lambda m: f"{key}: {m}",
        )
    torch.testing.assert_close(got[-1]["eval_loss"], want[-1]["eval_loss"], rtol=1e-4, atol=1e-6)
    # per GPU: half the step's tokens and half its model FLOPs, whichever way the 2 ranks split it
    for g, w in zip(got, want, strict=True):
        assert g["tokens_per_sec_per_gpu"] == pytest.approx(g["tokens_per_sec"] / 2)
        assert g["model_tflops_per_gpu"] / g["tokens_per_sec_per_gpu"] == pytest.approx(
            w["model_tflops_per_gpu"] / w["tokens_per_sec_per_gpu"])


def write_chat_jsonl(path, count: int = 120) -> str:
    """Many short chat examples: packed, every row holds several documents."""
    with open(path, "w") as f:
        for i in range(count):
            messages = [{"role": "user", "content": f"What is {i} plus {i % 7}?"},
                        {"role": "assistant", "content": f"{i} plus {i % 7} is {i + i % 7}."}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return str(path)


def test_packed_chat_rows_on_two_processes_match_one(tmp_path):
    """Document masks (on by default) under cp 2, ring and Ulysses, give the single-process
    trajectory on packed rows of short chat examples."""
    data = write_chat_jsonl(tmp_path / "chat.jsonl")
    runs = {name: tmp_path / name for name in ("single", "ring", "ulysses")}
    # the one-process run beside the ring run (one core each), then the Ulysses run
    single = start_cli(runs["single"], "--dataset", data, "--context_length", "128")
    try:
        run_cli(runs["ring"], "--dataset", data, "--context_length", "128", "--cp", "2", nproc=2)
        finish_cli(single)
    finally:
        single.kill()
    run_cli(runs["ulysses"], "--dataset", data, "--context_length", "128", "--cp", "2", "--cp_strategy", "ulysses",
            nproc=2)
    want = read_metrics(runs["single"])
    for name in ("ring", "ulysses"):
        got = read_metrics(runs[name])
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(
                torch.tensor([r[key] for r in got]), torch.tensor([r[key] for r in want]), rtol=1e-4, atol=1e-6,
                msg=lambda m: f"{name} {key}: {m}",
            )


def test_dpo_on_a_preference_file_under_torchrun_cp2_matches_one_process(tmp_path):
    """--objective dpo (full fine-tune: the reference computed once, stored with the prepared pairs)
    on a preference jsonl: torchrun cp 2 (ring) gives the single process's losses, reward metrics
    and eval, and writes TRL's metric names."""
    data = tmp_path / "pairs.jsonl"
    with open(data, "w") as f:
        for i in range(40):
            f.write(json.dumps({"prompt": f"What is {i} plus {i % 7}?", "chosen": f" {i + i % 7}.",
                                "rejected": f" {i * (i % 7) + 1}, I think."}) + "\n")
    flags = ["--dataset", str(data), "--objective", "dpo", "--context_length", "128", "--batch_size", "2",
             "--num_eval_samples", "2", "--eval_fraction", "0.3"]
    single = start_cli(tmp_path / "single", *flags, "--data_cache_dir", str(tmp_path / "cache1"))
    try:
        run_cli(tmp_path / "cp2", *flags, "--cp", "2", "--data_cache_dir", str(tmp_path / "cache2"), nproc=2)
        finish_cli(single)
    finally:
        single.kill()
    want, got = read_metrics(tmp_path / "single"), read_metrics(tmp_path / "cp2")
    names = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
             "logps/chosen", "logps/rejected")
    assert len(got) == len(want) == 4
    for key in names:
        torch.testing.assert_close(torch.tensor([r[key] for r in got]), torch.tensor([r[key] for r in want]),
                                   rtol=1e-4, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}")
    for key in ("eval_loss", "eval_rewards/margins", "eval_rewards/accuracies"):
        torch.testing.assert_close(got[-1][key], want[-1][key], rtol=1e-4, atol=1e-5)
    # step 1: the policy is its reference (the stored sums are the initial weights' own), every margin 0
    assert got[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and got[0]["rewards/margins"] == 0
    assert got[-1]["loss"] != pytest.approx(math.log(2), abs=1e-3)
    assert len(list((tmp_path / "cache2").glob("*/reference/*-train.npz"))) == 1
    scalars = tensorboard_scalars(tmp_path / "cp2")  # TRL's names in TensorBoard too
    assert [value for _, value in scalars["train/rewards/accuracies"]] == [r["rewards/accuracies"] for r in got]
    assert scalars["eval/eval_rewards/margins"][-1][1] == pytest.approx(got[-1]["eval_rewards/margins"])


def test_unknown_flag_is_a_clear_error(tmp_path, monkeypatch, capsys):
    # The module's __main__ block as `python -m recipes.finetune_longctx` runs it, in this process (runpy):
    # a subprocess spent ~3 s importing the library to refuse a flag. The exit status of a real
    # `python -m` refusal: tests/train/test_cli.py::test_an_empty_dataset_is_one_line.
    import runpy
    import warnings

    monkeypatch.setattr(sys, "argv", ["finetune_longctx", *SMALL, "--output_dir", str(tmp_path),
                                      "--contex_length", "512"])
    with warnings.catch_warnings(), pytest.raises(SystemExit) as exit_info:
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: "found in sys.modules" (imported by another test)
        runpy.run_module("recipes.finetune_longctx", run_name="__main__", alter_sys=True)
    assert exit_info.value.code not in (0, None)
    assert "unknown flag --contex_length; did you mean --context_length?" in capsys.readouterr().err


# ---------------------------------------------------------------- in-process checks (world 1)
# Each check trains in its own world of one, one core each: two worlds at once (Note [Worlds side by side]).
checks = Checks(worlds=2)


def _config(output_dir, **flags):
    from llama_cp import TrainConfig

    base = dict(context_length=256, num_passkey_samples=16, num_eval_samples=4, max_steps=4, log_every=1,
                warmup_steps=1, lr=3e-3, save_every=0, output_dir=output_dir)
    return TrainConfig.from_flags(**{**base, **flags})


@checks.add
def crash_and_resume_continue_the_trajectory():
    from llama_cp import Trainer

    class CrashAfterThreeSteps(Trainer):
        def train_step(self):
            if getattr(self, "_steps_run", 0) == 3:
                raise KeyboardInterrupt("simulated crash after step 3")
            self._steps_run = getattr(self, "_steps_run", 0) + 1
            return super().train_step()

    with tempfile.TemporaryDirectory() as straight, tempfile.TemporaryDirectory() as crashed:
        Trainer(_config(straight, save_every=2)).fit()
        with pytest.raises(KeyboardInterrupt):
            CrashAfterThreeSteps(_config(crashed, save_every=2)).fit()
        assert [r["step"] for r in read_metrics(crashed)] == [1, 2, 3]  # step 3 logged, never saved
        Trainer(_config(crashed, save_every=2, resume=True)).fit()  # from step 2: step 3's row is redone
        got, want = read_metrics(crashed), read_metrics(straight)
        assert [r["step"] for r in got] == [1, 2, 3, 4]
        for g, w in zip(got, want, strict=True):
            for key in ("loss", "grad_norm", "lr"):
                assert abs(g[key] - w[key]) <= 1e-6 * max(1.0, abs(w[key])), (g, w)
        # TensorBoard shows the resumed trajectory once: the crashed attempt's step 3 is purged
        assert_series(tensorboard_scalars(crashed)["train/loss"], [(r["step"], r["loss"]) for r in got])


def assert_series(got, want):
    """Two (step, value) series: the same steps, values equal to float32 precision."""
    assert [step for step, _ in got] == [step for step, _ in want], (got, want)
    assert [value for _, value in got] == pytest.approx([value for _, value in want], rel=1e-6), (got, want)


def tensorboard_scalars(output_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of ``output_dir/tensorboard``, read back from the event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(output_dir, "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@checks.add
def adamw8bit_runs_on_cpu_and_resumes():
    from llama_cp import Trainer

    with tempfile.TemporaryDirectory() as straight, tempfile.TemporaryDirectory() as resumed:
        row = Trainer(_config(straight, optimizer="adamw8bit", max_steps=4, save_every=2)).fit()
        assert row["step"] == 4 and torch.isfinite(torch.tensor(row["loss"]))
        losses = [r["loss"] for r in read_metrics(straight)]
        assert losses[-1] < losses[0], losses
        # keep only the step-2 checkpoint of that run, then resume: the rows of steps 3 and 4 are rewritten (a
        # copy of its directory: a second identical run, as this made, wrote the same files, in 4 more steps)
        import shutil

        shutil.copytree(straight, resumed, dirs_exist_ok=True)
        shutil.rmtree(os.path.join(resumed, "checkpoints", "step_00000004"))
        Trainer(_config(resumed, optimizer="adamw8bit", max_steps=4, save_every=2, resume=True)).fit()
        assert [r["step"] for r in read_metrics(resumed)] == [1, 2, 3, 4]
        got = [r["loss"] for r in read_metrics(resumed)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(losses), rtol=1e-6, atol=1e-7)


class ScriptedPeakMemory:
    """Stands in for ``llama_cp.train.reporting.PeakMemory`` (as the trainer reads it) and records its
    calls: the window before the first reset after start-up (loading) peaks at 10**9 bytes, the
    window of step k at 1000 k bytes."""

    calls: list[str] = []

    def __init__(self, device_type):
        self.windows = 0

    def reset(self):
        self.calls.append("reset")
        self.windows += 1

    def read(self):
        self.calls.append("read")
        return 10**9 if self.windows == 1 else 1000 * (self.windows - 1)


@checks.add
def peak_memory_is_per_step_and_loading_is_reported_apart():
    import llama_cp.train.trainer
    from llama_cp import Trainer

    with pytest.MonkeyPatch.context() as patch, tempfile.TemporaryDirectory() as out:
        patch.setattr(llama_cp.train.trainer, "PeakMemory", ScriptedPeakMemory, raising=False)
        Trainer(_config(out, max_steps=5, log_every=2)).fit()
        rows = read_metrics(out)
        with open(os.path.join(out, "run_info.json")) as f:
            info = json.load(f)
    # start-up: reset, read; then every step: reset, read
    assert ScriptedPeakMemory.calls == ["reset", "read"] + ["reset", "read"] * 5, ScriptedPeakMemory.calls
    assert info["load_peak_memory_bytes"] == 10**9
    # rows at steps 2, 4 and 5 (the last): the largest step peak since the previous row
    assert [(r["step"], r["peak_memory_bytes"]) for r in rows] == [(2, 2000), (4, 4000), (5, 5000)], rows


@checks.add
def lora_export_reloads_with_peft_and_reproduces_logits():
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from llama_cp import Trainer
    from llama_cp.modules.causal_lm import embedded_llama_config

    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(_config(out, use_peft=True, max_steps=3, lr=1e-2))
        trainer.fit()
        final = os.path.join(out, "final")
        assert os.path.exists(os.path.join(final, "adapter_model.safetensors"))
        torch.manual_seed(0)  # the embedded base model is the seed's random init
        base = LlamaForCausalLM(embedded_llama_config())
        reloaded = PeftModel.from_pretrained(base, final)
        input_ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            want = trainer.model(input_ids=input_ids).logits
            got = reloaded(input_ids=input_ids).logits
            with reloaded.disable_adapter():
                without_adapter = reloaded(input_ids=input_ids).logits
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert (got - without_adapter).abs().max() > 1e-3, "the adapter did not change the model"


@checks.add
def full_finetune_of_a_bf16_checkpoint_keeps_fp32_shards_and_state():
    """A bf16 checkpoint is trained with float32 sharded parameters and AdamW state (bf16 would
    round every update away) and loads its bf16 values exactly. (The planner's side:
    tests/plan/test_plan_cli.py.)"""
    from torch.distributed.tensor import DTensor
    from transformers import LlamaForCausalLM

    from llama_cp import Trainer
    from llama_cp.data.tokenizer import byte_tokenizer
    from llama_cp.modules.causal_lm import embedded_llama_config

    with tempfile.TemporaryDirectory() as root:
        torch.manual_seed(3)
        bf16 = LlamaForCausalLM(embedded_llama_config(num_hidden_layers=2)).to(torch.bfloat16)
        bf16.save_pretrained(os.path.join(root, "bf16"))
        byte_tokenizer().save_pretrained(os.path.join(root, "bf16"))
        trainer = Trainer(_config(os.path.join(root, "run"), model_name=os.path.join(root, "bf16"), max_steps=2))
        trainer.fit()
        params = [p for p in trainer.model.parameters() if p.requires_grad]
        assert params and all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in params)
        states = [t for state in trainer.optimizer.state.values() for t in state.values() if t.dim() > 0]
        assert states and all(t.dtype == torch.float32 for t in states), {t.dtype for t in states}
        # the weights loaded are the checkpoint's bf16 values, held in float32
        fresh = Trainer(_config(os.path.join(root, "run2"), model_name=os.path.join(root, "bf16")))
        fresh.setup()
        loaded = {k: v.full_tensor() for k, v in fresh.model.state_dict().items()}
        for name, value in bf16.state_dict().items():
            assert torch.equal(loaded[name], value.float()), name
        # final/ is written in the checkpoint's bf16 (--export_dtype auto): the trained weights, rounded
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        from llama_cp.train.export import export_pretrained
        from recipes.export import main as export

        final = load_file(os.path.join(root, "run", "final", "model.safetensors"))
        trained = {k: v.full_tensor() for k, v in trainer.model.state_dict().items()}
        assert set(final) == set(trained) and all(t.dtype == torch.bfloat16 for t in final.values())
        for name, value in final.items():
            assert torch.equal(value, trained[name].to(torch.bfloat16)), name
        assert json.load(open(os.path.join(root, "run", "final", "config.json")))["dtype"] == "bfloat16"
        # shard by shard: several files and their index, as from_pretrained reads them
        export_pretrained(trainer.model, os.path.join(root, "sharded"), dtype=torch.float32, max_shard_bytes=1 << 20)
        index = json.load(open(os.path.join(root, "sharded", "model.safetensors.index.json")))
        assert len(set(index["weight_map"].values())) > 2 and set(index["weight_map"]) == set(trained)
        sharded = AutoModelForCausalLM.from_pretrained(os.path.join(root, "sharded"), dtype=torch.float32)
        for name, value in sharded.state_dict().items():
            assert torch.equal(value, trained[name]), name
        # recipes.export turns final/ into float32 (the bf16 values, exactly), and the run's checkpoint (its
        # float32 shards) into the trained weights, in the base's bf16 by default
        export(checkpoint=os.path.join(root, "run", "final"), output_dir=os.path.join(root, "fp32"),
               export_dtype="float32")
        for name, value in load_file(os.path.join(root, "fp32", "model.safetensors")).items():
            assert value.dtype == torch.float32 and torch.equal(value, final[name].float()), name
        export(checkpoint=os.path.join(root, "run"), output_dir=os.path.join(root, "from_checkpoint"))
        exported = load_file(os.path.join(root, "from_checkpoint", "model.safetensors"))
        assert set(exported) == set(trained)
        for name, value in exported.items():
            assert value.dtype == torch.bfloat16 and torch.equal(value, trained[name].to(torch.bfloat16)), name


@checks.add
def eval_never_builds_the_full_logits():
    """Eval on a text dataset (no passkey metric) keeps the loss chunked; the passkey metric
    comes from the same chunks. The largest logits product has at most loss_chunk_size rows."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from llama_cp import Trainer
    from llama_cp.modules.causal_lm import EMBEDDED_LLAMA

    vocab, chunk = EMBEDDED_LLAMA["vocab_size"], 64

    class LargestLogits(TorchDispatchMode):
        rows = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            matmul = func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm)
            if matmul and out.shape[-1] == vocab:
                self.rows = max(self.rows, out.numel() // vocab)
            return out

    with tempfile.TemporaryDirectory() as root:
        data = os.path.join(root, "text.jsonl")
        with open(data, "w") as f:
            for i in range(60):
                f.write(json.dumps({"text": f"document {i}: " + "lorem ipsum dolor sit amet " * 40}) + "\n")
        for dataset in (data, "passkey"):
            trainer = Trainer(_config(os.path.join(root, "run"), dataset=dataset, context_length=512,
                                      loss_chunk_size=chunk, num_eval_samples=2))
            trainer.setup()
            labeled = sum(int((b["labels"] != -100).sum()) for b in trainer.eval_batches)
            with LargestLogits() as largest:
                result = trainer.evaluate()
            assert 0 < largest.rows <= chunk, (dataset, largest.rows, labeled)
            assert ("passkey_acc" in result) == (dataset == "passkey"), result
            if dataset == data:
                assert labeled > 4 * chunk, labeled  # the full logits would have been far larger


@checks.add
def packed_chat_rows_train_with_document_masks_by_default():
    """The trainer's loss on packed rows of short chat examples is single-process
    transformers' loss on the same rows (which masks across documents); with
    --document_mask false it is not."""
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM

    from llama_cp import Trainer
    from llama_cp.model.loss import causal_lm_loss_sum
    from llama_cp.modules.causal_lm import embedded_llama_config
    from llama_cp.parallel.sharding import document_starts

    with tempfile.TemporaryDirectory() as root:
        data = write_chat_jsonl(os.path.join(root, "chat.jsonl"))
        losses = {}
        for document_mask, flags in ((True, {}), (False, {"document_mask": False})):  # the default, then off
            trainer = Trainer(_config(os.path.join(root, "run"), dataset=data, context_length=256, batch_size=2,
                                      **flags))
            trainer.setup()
            batch = next(iter(trainer.loader))
            assert int((document_starts(batch["position_ids"]) > 0).sum()) > 0  # several documents per row
            local = trainer._to_device(batch)
            valid = int((batch["labels"] != -100).sum())
            with torch.no_grad():
                losses[document_mask] = (causal_lm_loss_sum(trainer.model, local) / valid).item()
        reference = LlamaForCausalLM(embedded_llama_config())
        reference.load_state_dict({k: v.full_tensor() for k, v in trainer.model.state_dict().items()})
        with torch.no_grad():
            logits = reference(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                               use_cache=False).logits
        want = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100).item()
        assert abs(losses[True] - want) <= 1e-5 * want, (losses, want)
        assert abs(losses[False] - want) > 1e-3, (losses, want)


@checks.add
def a_gemma3_vision_language_checkpoint_trains_its_text_model_as_transformers_computes_it():
    """The trainer's model of a saved Gemma 3 vision-language checkpoint (built on meta, sharded, loaded:
    its text model, Note [The text model of a vision-language checkpoint]) gives the whole model's loss
    on the run's packed rows (transformers masks across their documents from the position_ids). Gemma 3 holds buffers no checkpoint does (embed_scale, a RoPE table per layer
    type): left as to_empty's memory before, the loss was ln(vocab) and every gradient zero."""
    import torch.nn.functional as F
    from transformers import AutoConfig, AutoModelForImageTextToText

    from llama_cp import Trainer
    from llama_cp.data.tokenizer import byte_tokenizer
    from llama_cp.model.loss import causal_lm_loss_sum

    text = dict(model_type="gemma3_text", vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, layer_types=["sliding_attention",
                "full_attention"], sliding_window=32, max_position_embeddings=1024)
    vision = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    config = AutoConfig.for_model("gemma3", text_config=text, vision_config=vision, mm_tokens_per_image=1,
                                  image_token_index=261, boi_token_index=262, eoi_token_index=263)
    with tempfile.TemporaryDirectory() as root:
        torch.manual_seed(3)
        AutoModelForImageTextToText.from_config(config).save_pretrained(os.path.join(root, "gemma3"))
        byte_tokenizer().save_pretrained(os.path.join(root, "gemma3"))
        trainer = Trainer(_config(os.path.join(root, "run"), model_name=os.path.join(root, "gemma3")))
        trainer.setup()
        batch = next(iter(trainer.loader))
        valid = int((batch["labels"] != -100).sum())
        with torch.no_grad():
            loss = (causal_lm_loss_sum(trainer.model, trainer._to_device(batch)) / valid).item()
        whole = AutoModelForImageTextToText.from_pretrained(os.path.join(root, "gemma3"), dtype=torch.float32)
        with torch.no_grad():
            logits = whole(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        want = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100).item()
    assert abs(loss - want) <= 1e-5 * want, (loss, want)

@checks.add
def a_row_logs_the_mean_loss_since_the_last_row_tokens_seen_and_epoch():
    """--log_every 2 logs the mean of the two steps' losses (it logged the second step's alone), the
    tokens seen so far and the epoch; the same run logged every step gives the values to average."""
    from llama_cp import Trainer

    with tempfile.TemporaryDirectory() as every, tempfile.TemporaryDirectory() as pairs:
        Trainer(_config(every, max_steps=4, num_passkey_samples=8)).fit()
        Trainer(_config(pairs, max_steps=4, num_passkey_samples=8, log_every=2)).fit()
        each, paired = read_metrics(every), read_metrics(pairs)
    assert [r["step"] for r in paired] == [2, 4]
    for row, (a, b) in zip(paired, [each[0:2], each[2:4]], strict=True):
        assert row["loss"] == pytest.approx((a["loss"] + b["loss"]) / 2, rel=1e-6), (row, a, b)
        assert row["loss"] != pytest.approx(b["loss"], rel=1e-6)
    # 256 tokens a step; 8 rows of batch 1 are 8 steps an epoch
    assert [(r["tokens_seen"], r["epoch"]) for r in each] == [(256, 0.125), (512, 0.25), (768, 0.375), (1024, 0.5)]


def _write_rows(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return path


def _data_run(out, **flags):
    """Train 2 steps on ``flags``' data; (the last metrics row, what the run said, the trainer)."""
    from llama_cp import Trainer

    said = []
    trainer = Trainer(_config(out, max_steps=2, data_cache_dir=os.path.join(out, "cache"), **flags))
    trainer._say = said.append
    row = trainer.fit()
    assert [r["step"] for r in read_metrics(out)] == [1, 2] and all(math.isfinite(r["loss"]) for r in read_metrics(out))
    return row, said, trainer


@checks.add
def every_data_format_source_mixture_and_eval_option_trains_end_to_end():
    """A run on each kind of data the README lists: a weighted mixture of five formats (one with
    mapped columns), a hub-style repository read by config and split, an --eval_dataset, a
    held-out --eval_fraction, none, and a streamed mixture; each trains 2 steps."""
    with tempfile.TemporaryDirectory() as root:
        chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
        sources = {
            "notes.jsonl:text=body": [{"body": f"note {i} " * 20} for i in range(40)],
            "qa.jsonl": [{"prompt": f"q{i}?", "completion": f"a{i}"} for i in range(40)],
            "turns.jsonl": [{"prompt": chat[:1], "completion": chat[1:]} for _ in range(40)],
            "chat.jsonl": [{"messages": chat} for _ in range(40)],
            "alpaca.jsonl": [{"instruction": "Echo.", "input": f"{i}", "output": f"{i}"} for i in range(40)],
        }
        mixture = ",".join(f"{_write_rows(os.path.join(root, name.split(':')[0]), rows)}"
                           f"{name[len(name.split(':')[0]):]}:0.2" for name, rows in sources.items())
        repo = os.path.join(root, "repo")
        for config in ("en", "fr"):
            os.makedirs(os.path.join(repo, config))
            for split in ("train", "dev"):
                _write_rows(os.path.join(repo, config, f"{split}.jsonl"),
                            [{"text": f"{config} {split} {i} " * 10} for i in range(30)])
        with open(os.path.join(repo, "README.md"), "w") as f:
            f.write("---\nconfigs:\n" + "".join(
                f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/train.jsonl\n"
                f"  - split: dev\n    path: {c}/dev.jsonl\n" for c in ("en", "fr")) + "---\n")

        row, said, trainer = _data_run(os.path.join(root, "mix"), dataset=mixture,
                                       eval_dataset=f"{repo}:config=fr:split=dev", num_eval_samples=2)
        assert "eval_loss" in row and math.isfinite(row["eval_loss"])
        assert len(trainer.eval_batches) == 2  # --num_eval_samples rows of the eval set
        assert list(trainer.eval_batches.indices) != [0, 1]  # drawn with the seed, not the first rows
        assert any(line.startswith("train mixture: ") for line in said), said
        summary = next(line for line in said if line.startswith("train: "))
        for kind in ("text", "prompt_completion", "chat", "instruction"):
            assert kind in summary, summary
        assert any(line.startswith("each eval reads 2 of ") and "--eval_dataset" in line for line in said), said

        # a hub id with config, split and revision: the hub stands in for the repository above
        import datasets

        load_dataset, asked = datasets.load_dataset, []

        def hub(path, **options):
            asked.append((path, dict(options)))
            options.pop("revision", None)
            return load_dataset(repo if path == "org/corpus" else path, **options)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(datasets, "load_dataset", hub)
            row, said, trainer = _data_run(os.path.join(root, "repo_run"),
                                           dataset="org/corpus:config=en:split=train:revision=v1.0",
                                           eval_fraction=0.2, num_eval_samples=1)
        assert ("org/corpus", {"streaming": False, "name": "en", "split": "train", "revision": "v1.0"}) in asked, asked
        texts = "".join(trainer.tokenizer.decode(r["input_ids"]) for r in trainer.loader.rows)
        assert "en train" in texts and "fr" not in texts and "dev" not in texts
        assert texts.count("<|bos|>") == 24 and "eval_loss" in row  # 6 of 30 held out

        row, said, trainer = _data_run(os.path.join(root, "no_eval"), dataset=f"{repo}:data_files=fr/dev.jsonl",
                                       eval_fraction=0)
        texts = "".join(trainer.tokenizer.decode(r["input_ids"]) for r in trainer.loader.rows)
        assert texts.count("<|bos|>") == 30 and "fr dev" in texts and "en " not in texts
        assert "eval_loss" not in row and any(line.startswith("no eval set") for line in said), said

        row, said, _ = _data_run(os.path.join(root, "stream"), dataset=mixture, streaming=True,
                                 eval_dataset=f"{repo}:config=fr:split=dev", num_eval_samples=1)
        assert "eval_loss" in row


@checks.add
def a_local_model_with_only_model_name_and_dataset_gets_the_real_model_defaults():
    """Run with nothing but --model_name (a local HF directory) and --dataset: the learning rate of a
    full fine-tune, whole epochs, activation checkpointing, checkpoints during the run (Note
    [Defaults by run]), as run_info.json records them; the run says them in one line, and that its
    rows (1024 tokens) are longer than the model's positions (512: Note [Positions past the model's])."""
    from transformers import LlamaForCausalLM

    from llama_cp import Trainer, TrainConfig
    from llama_cp.data.tokenizer import byte_tokenizer
    from llama_cp.modules.causal_lm import embedded_llama_config

    with tempfile.TemporaryDirectory() as root:
        model_dir = os.path.join(root, "model")
        torch.manual_seed(0)
        LlamaForCausalLM(embedded_llama_config(num_hidden_layers=1, max_position_embeddings=512)).save_pretrained(
            model_dir)
        byte_tokenizer().save_pretrained(model_dir)
        data = _write_rows(os.path.join(root, "data.jsonl"), [{"text": f"document {i} " * 40} for i in range(40)])
        here = os.getcwd()
        os.chdir(root)  # the default --output_dir, outputs/run, is relative
        try:
            trainer = Trainer(TrainConfig.from_flags(model_name=model_dir, dataset=data))
            said = []
            trainer._say = said.append
            trainer.fit()
        finally:
            os.chdir(here)
        run = os.path.join(root, "outputs", "run")
        info = json.load(open(os.path.join(run, "run_info.json")))["config"]
        steps = trainer.total_steps
        assert steps == trainer.loader.steps_per_epoch > 1
        assert info["optim"]["lr"] == 2e-5 and info["max_steps"] == 0 and info["num_epochs"] == 1
        assert info["model"]["activation_checkpointing"] is True
        assert info["save_every"] == -(-steps // 10)
        assert len(read_metrics(run)) >= 1 and os.path.isdir(os.path.join(run, "final"))
        saves = "every step" if info["save_every"] == 1 else f"every {info['save_every']} steps"  # a run of <= 10
        assert f"{steps} steps (--num_epochs 1), --lr 2e-05, activation checkpointing on, checkpoints {saves} " \
               "(Note [Defaults by run] in llama_cp/flags/defaults.py)" in said, said
        past = [line for line in said if line.startswith("--context_length 1024 is past the model's "
                                                          "max_position_embeddings 512, with its RoPE unchanged")]
        assert len(past) == 1 and "--rope_scaling yarn:factor=2 or a larger --rope_theta" in past[0], said


@checks.add
def a_checkpoint_from_before_the_decay_groups_is_refused_in_one_line():
    """A checkpoint whose optimizer had one group without the ``decays`` key (saved before issue 35)
    cannot be resumed into the two groups: one line that says how to start from its weights."""
    from llama_cp import Trainer
    from llama_cp.train.checkpoint import load_checkpoint, save_checkpoint

    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(_config(out))
        trainer.setup()
        old = torch.optim.AdamW([p for p in trainer.model.parameters() if p.requires_grad], lr=1e-3)
        path = save_checkpoint(out, 1, trainer.model, old, config=trainer.cfg.to_dict())
        with pytest.raises(ValueError, match=r"saved before the optimizer kept norms, biases and embeddings out of "
                                             r"weight decay .* python -m recipes.export --checkpoint PATH"):
            load_checkpoint(path, trainer.model, trainer.optimizer)


class _ForceEos:
    """A logits processor that makes generated token ``at`` (from 0) the tokenizer's eos, and no
    token before it."""

    def __init__(self, prompt_length: int, at: int, eos: int):
        self.prompt_length, self.at, self.eos = prompt_length, at, eos

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        if input_ids.shape[1] - self.prompt_length == self.at:
            scores.fill_(-float("inf"))
            scores[:, self.eos] = 0
        else:
            scores[:, self.eos] = -float("inf")
        return scores


@checks.add
def merged_lora_and_recipes_export_load_in_plain_transformers_with_the_trained_logits():
    """--merge_lora's final_merged/ and python -m recipes.export (from the run's newest checkpoint,
    merged or as an adapter, and from final/) load in plain transformers / peft and give the trained
    model's logits; a changed --rope_theta travels in config.json (and in the adapter's README);
    the merge (DoRA, rsLoRA, modules_to_save) equals peft's merge_and_unload; generate() stops at
    the tokenizer's eos."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, LlamaForCausalLM, LogitsProcessorList

    from llama_cp import Trainer
    from llama_cp.data.tokenizer import byte_tokenizer
    from llama_cp.modules.causal_lm import embedded_llama_config
    from recipes.export import main as export

    with tempfile.TemporaryDirectory() as out:
        # DoRA, rsLoRA, every Linear layer and trained copies of the embeddings and norms: what a merge must handle
        trainer = Trainer(_config(out, use_peft=True, merge_lora=True, rope_theta=20000, max_steps=3, save_every=2,
                                  lr=1e-2, use_dora=True, use_rslora=True, lora_target_modules="all-linear",
                                  lora_modules_to_save="embed_tokens,norm"))
        said = []
        trainer._say = said.append
        trainer.fit()
        final = os.path.join(out, "final")
        assert f"{final} is an adapter trained with --rope_theta 20000.0: the base model's config must be given the " \
               f"same settings before loading it (README.md there); {final}_merged carries them" in said, said
        input_ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            want = trainer.model(input_ids=input_ids).logits

        def logits(model):
            with torch.no_grad():
                return model(input_ids=input_ids).logits

        merged = AutoModelForCausalLM.from_pretrained(os.path.join(out, "final_merged"))
        torch.testing.assert_close(logits(merged), want, atol=1e-5, rtol=1e-5)
        assert merged.config.rope_parameters["rope_theta"] == 20000 if hasattr(merged.config, "rope_parameters") \
            else merged.config.rope_theta == 20000
        # the merge is peft's own merge of the adapter, on the base the run started from
        torch.manual_seed(0)
        base = LlamaForCausalLM(embedded_llama_config(rope_theta=20000))
        reference = PeftModel.from_pretrained(base, os.path.join(out, "final")).merge_and_unload()
        assert set(reference.state_dict()) == set(merged.state_dict())
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(merged.state_dict()[name], value, atol=1e-6, rtol=1e-6, msg=name)
        readme = open(os.path.join(out, "final", "README.md")).read()
        assert "--rope_theta 20000" in readme, readme
        # recipes.export: the newest checkpoint, merged and as an adapter; final/ merged
        export(checkpoint=out, output_dir=os.path.join(out, "from_checkpoint"), merge_lora=True)
        export(checkpoint=os.path.join(out, "final"), output_dir=os.path.join(out, "from_final"), merge_lora=True)
        export(checkpoint=out, output_dir=os.path.join(out, "adapter"))
        for name in ("from_checkpoint", "from_final"):
            exported = AutoModelForCausalLM.from_pretrained(os.path.join(out, name))
            torch.testing.assert_close(logits(exported), want, atol=1e-5, rtol=1e-5, msg=name)
        torch.manual_seed(0)
        base = LlamaForCausalLM(embedded_llama_config(rope_theta=20000))
        adapter = PeftModel.from_pretrained(base, os.path.join(out, "adapter"))
        torch.testing.assert_close(logits(adapter), want, atol=1e-5, rtol=1e-5)
        with pytest.raises(FileExistsError, match="exists"):
            export(checkpoint=out, output_dir=os.path.join(out, "adapter"))
        with pytest.raises(ValueError, match="is a LoRA adapter already: add --merge_lora"):
            export(checkpoint=os.path.join(out, "final"), output_dir=os.path.join(out, "again"))
        # generate() stops at the tokenizer's eos: forced as the 3rd new token, it ends the output there
        eos = byte_tokenizer().eos_token_id
        prompt = input_ids[:, :8]
        generated = merged.generate(prompt, max_new_tokens=10, do_sample=False,
                                    logits_processor=LogitsProcessorList([_ForceEos(8, 2, eos)]))
        assert generated.shape[1] == 8 + 3 and generated[0, -1] == eos, generated


def _nan_at(bad_steps):
    """A Trainer whose loss and gradients are NaN at ``bad_steps`` (1-based), as a diverging run's are."""
    from llama_cp import Trainer

    class NaNTrainer(Trainer):
        calls = 0

        def setup(self):
            super().setup()
            forward_backward = self.objective.forward_backward

            def diverging(micro):
                total, metrics = forward_backward(micro)
                NaNTrainer.calls += 1
                if NaNTrainer.calls in bad_steps:
                    for param in self.model.parameters():
                        if param.grad is not None:
                            param.grad.fill_(float("nan"))
                    total = total * float("nan")
                return total, metrics

            self.objective.forward_backward = diverging

    return NaNTrainer


@checks.add
def nonfinite_steps_are_skipped_and_a_run_of_them_stops_training():
    from llama_cp.train.checkpoint import load_checkpoint
    from llama_cp.train.checkpoint_files import complete_checkpoints

    with tempfile.TemporaryDirectory() as straight, tempfile.TemporaryDirectory() as one_bad, \
            tempfile.TemporaryDirectory() as diverged:
        from llama_cp import Trainer

        Trainer(_config(straight, max_steps=2)).fit()
        # one NaN step: skipped (no update, logged), training goes on to the end
        trainer = _nan_at({3})(_config(one_bad, max_steps=5))
        trainer.fit()
        rows = read_metrics(one_bad)
        assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and rows[2]["skipped"] is True, rows
        assert not any(r.get("skipped") for r in rows[:2] + rows[3:]), rows
        assert all(torch.isfinite(p.full_tensor()).all() for p in trainer.model.parameters())
        assert os.path.isdir(os.path.join(one_bad, "final"))
        # three in a row: stop with the steps named, no export, the saved checkpoint intact and finite
        failing = _nan_at({3, 4, 5})(_config(diverged, max_steps=8, save_every=2, keep_last=1))
        with pytest.raises(RuntimeError, match=r"NaN/inf at steps 3-5 \(3 steps in a row, --max_nonfinite_steps 3\)"
                                               r".*step_00000002, holds the last finite weights\. Lower --lr \(now "
                                               r"0\.003\) or --max_grad_norm, or check the data, then continue from "
                                               r"it with --resume$"):
            failing.fit()
        assert [step for step, _ in complete_checkpoints(diverged)] == [2]
        assert not os.path.exists(os.path.join(diverged, "final"))
        assert [r.get("skipped", False) for r in read_metrics(diverged)] == [False, False, True, True, True]
        # loss.png of the stopped run marks the skipped steps, and the line leaves them out
        from llama_cp.train.run_dir import plot_losses

        assert os.path.getsize(os.path.join(diverged, "loss.png")) > 0
        drawn = plot_losses(os.path.join(diverged, "metrics.jsonl"), os.path.join(diverged, "again.png"))
        assert drawn["skipped"] == [3, 4, 5] and [step for step, _ in drawn["train"]] == [1, 2], drawn
        # diverged before any checkpoint: --resume has nothing to start from, so it is not suggested
        with tempfile.TemporaryDirectory() as unsaved, pytest.raises(RuntimeError) as stop:
            _nan_at({1, 2, 3})(_config(unsaved, max_steps=8, save_every=4)).fit()
        assert str(stop.value).endswith(
            "no checkpoint was saved, so there is nothing to resume. Lower --lr (now 0.003) or --max_grad_norm, or "
            "check the data, then start again (--overwrite, or another --output_dir)"), stop.value
        assert "--resume" not in str(stop.value)
        # the skipped steps changed no weight: the model still holds step 2's weights, which equal
        # a clean run's step 2
        reference = Trainer(_config(straight, max_steps=2))
        reference.setup()
        load_checkpoint(complete_checkpoints(straight)[-1][1], reference.model, reference.optimizer,
                        scheduler=reference.scheduler)
        for got, want in zip(failing.model.parameters(), reference.model.parameters(), strict=True):
            torch.testing.assert_close(got.full_tensor(), want.full_tensor(), rtol=0, atol=0)


@checks.add
def lora_adapter_eval_equals_the_trained_models_eval_perplexity():
    """--eval_perplexity writes perplexity.json of the trained LoRA model on the run's eval documents
    (by length and position); the eval CLI's main on the exported adapter (final/: the embedded base
    rebuilt from llama_cp_export.json's seed, the adapter (DoRA, rsLoRA, trained norm copies) loaded
    into the sharded peft model; it refused adapters, then DoRA) gives the same numbers on the same
    documents. Eval documents too short for --context_length are refused before training."""
    from safetensors.torch import load_file

    from recipes import eval_longctx, finetune_longctx

    words = "the cat sat on a mat while rain fell over old town roofs and quiet rivers ran to sea".split()
    text = lambda count, seed: " ".join(words[(seed * 7 + 3 * i) % len(words)] for i in range(count))  # noqa: E731
    with tempfile.TemporaryDirectory() as root:
        train = _write_rows(os.path.join(root, "train.jsonl"), [{"text": text(60, seed)} for seed in range(4)])
        held = _write_rows(os.path.join(root, "eval.jsonl"), [{"text": text(n, n)} for n in (10, 40, 12, 50)])
        out = os.path.join(root, "run")
        finetune_longctx.main(
            context_length=128, max_steps=2, log_every=1, warmup_steps=1, lr=1e-2, save_every=0, use_peft=True,
            use_dora=True, use_rslora=True, lora_modules_to_save="norm",  # layers the eval must rebuild
            dataset=train, eval_dataset=held, num_eval_samples=2, eval_perplexity=True, output_dir=out,
            data_cache_dir=os.path.join(root, "cache"), report_to="none",
        )
        with open(os.path.join(out, "perplexity.json")) as f:
            trained = json.load(f)
        assert trained["lengths"] == [32, 64, 128] and trained["documents"] == 2 and trained["buckets"] == 4
        final = os.path.join(out, "final")
        lora_b = [v for k, v in load_file(os.path.join(final, "adapter_model.safetensors")).items() if "lora_B" in k]
        assert lora_b and all(v.abs().max() > 0 for v in lora_b), "the adapter was not trained"
        if not os.path.exists(os.path.join(final, "llama_cp_export.json")):  # an export from before the file
            with open(os.path.join(final, "llama_cp_export.json"), "w") as f:
                json.dump({"model_name": "embedded", "seed": 0, "rope_theta": 0.0, "rope_scaling": "none"}, f)
        eval_longctx.main(model_name=final, task="perplexity", dataset=held, lengths="32,64,128", num_samples=2,
                          output_dir=os.path.join(root, "adapter"))
        with open(os.path.join(root, "adapter", "perplexity.json")) as f:
            reloaded = json.load(f)
        # eval documents too short for --context_length are refused before the first step, not after the last
        said = io.StringIO()
        with pytest.raises(ValueError, match=r"^--eval_perplexity on --eval_dataset .*: none of its 4 documents holds "
                                             r"at least 257 tokens .* \(nothing is trained yet\)"), \
                contextlib.redirect_stdout(said):
            finetune_longctx.main(
                context_length=256, max_steps=2, use_peft=True, dataset=train, eval_dataset=held, num_eval_samples=2,
                eval_perplexity=True, output_dir=os.path.join(root, "short"),
                data_cache_dir=os.path.join(root, "cache"), report_to="none")
        assert not os.path.exists(os.path.join(root, "short", "metrics.jsonl"))
        assert "2 steps (--max_steps 2), --lr 0.001 (not reached: --warmup_steps 10 is longer than the run), " \
               "activation checkpointing off, checkpoints every step (" \
            in said.getvalue(), said.getvalue()
    assert reloaded["model"] == final and reloaded["documents"] == 2
    for got, want in zip(reloaded["per_length"], trained["per_length"], strict=True):
        assert got["tokens"] == want["tokens"] == 2 * got["length"]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), (got, want)
        assert [b["loss"] for b in got["buckets"]] == pytest.approx([b["loss"] for b in want["buckets"]], rel=1e-5)


@checks.add
def a_step_with_no_scored_token_changes_no_weight_and_no_logged_loss():
    """A step whose rows hold no scored token (every label -100, as a long prompt's middle row) has
    zero gradients and no loss: it changes no weight (AdamW's step would still move them by its
    momentum), its row says "no_scored_tokens": true, a logged mean leaves it out (its 0 used to pull
    the mean down), and a logged row of such steps only has a null loss, drawn nowhere in loss.png."""
    from llama_cp import Trainer
    from llama_cp.train.run_dir import plot_losses

    class EveryOtherStepUnscored(Trainer):
        def _next_micro_batches(self):
            micro = super()._next_micro_batches()
            if len(getattr(self, "seen", [])) % 2:  # steps 2 and 4
                micro = [{**batch, "labels": torch.full_like(batch["labels"], -100)} for batch in micro]
            return micro

        def train_step(self):
            row = super().train_step()
            weights = {name: p.full_tensor().clone() for name, p in self.model.named_parameters() if p.requires_grad}
            self.seen = [*getattr(self, "seen", []), (row, weights)]
            return row

    with tempfile.TemporaryDirectory() as out:
        # rows logged at step 3 (steps 1-3: two scored) and at the last step, 4 (nothing scored)
        trainer = EveryOtherStepUnscored(_config(out, max_steps=4, log_every=3))
        trainer.fit()
        rows, weights = zip(*trainer.seen)
        assert [row.get("no_scored_tokens", False) for row in rows] == [False, True, False, True], rows
        for before, after in ((0, 1), (2, 3)):
            assert all(torch.equal(weights[after][name], weights[before][name]) for name in weights[0])
        assert any(not torch.equal(weights[2][name], weights[1][name]) for name in weights[0])  # step 3 trained
        logged = read_metrics(out)
        assert [row["step"] for row in logged] == [3, 4]
        assert logged[0]["loss"] == pytest.approx((rows[0]["loss"] + rows[2]["loss"]) / 2, rel=1e-6)
        assert logged[1]["loss"] is None and logged[1]["no_scored_tokens"] is True
        drawn = plot_losses(os.path.join(out, "metrics.jsonl"), os.path.join(out, "again.png"))
        assert [step for step, _ in drawn["train"]] == [3] and drawn["skipped"] == [], drawn


results = checks.module_fixture(__name__, 1)


@pytest.mark.parametrize("name", checks.names)
def test_in_process(results, name):
    checks.assert_passed(results, name)
