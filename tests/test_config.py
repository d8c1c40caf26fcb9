"""TrainConfig: defaults <- YAML preset <- flags, and clear errors."""

import re
import unittest.mock

import pytest

from llama_cp.config import TrainConfig


def test_flags_override_preset_override_defaults(tmp_path):
    preset = tmp_path / "preset.yaml"
    preset.write_text("model_name: embedded\ndata:\n  context_length: 2048\n  batch_size: 2\ncp: 2\nlr: 0.01\n")
    cfg = TrainConfig.from_flags(str(preset), batch_size=4, lora_target_modules="q_proj,v_proj", use_peft="true")
    assert cfg.data.context_length == 2048 and cfg.parallel.cp == 2 and cfg.optim.lr == 0.01
    assert cfg.data.batch_size == 4
    assert cfg.peft.use_peft is True and cfg.peft.lora_target_modules == ("q_proj", "v_proj")
    assert TrainConfig().data.dataset == "passkey"


def test_a_preset_that_names_no_model_is_refused_unless_the_command_line_names_one(tmp_path):
    """A preset of configs/ is written for a real model and names none: run alone it would have
    trained the embedded demo model on passkey without a word."""
    preset = tmp_path / "preset.yaml"
    preset.write_text("data:\n  context_length: 2048\nuse_peft: true\n")
    with pytest.raises(ValueError, match=r"names no model.*add --model_name /path/to/model"):
        TrainConfig.from_flags(str(preset))
    assert TrainConfig.from_flags(str(preset), model_name="org/model").model.model_name == "org/model"


def test_auto_defaults_resolve_by_model_and_mode_and_an_explicit_flag_wins(tmp_path):
    """Note [Defaults by run]: the embedded passkey demo keeps its tuned settings; a real model gets
    2e-5 (full) or 2e-4 (LoRA), whole epochs, activation checkpointing and a save cadence."""
    demo = TrainConfig.from_flags()
    assert (demo.optim.lr, demo.max_steps, demo.model.activation_checkpointing) == (1e-3, 200, False)
    assert demo.resolved_save_every(200) == 0
    full, lora = TrainConfig.from_flags(model_name="org/model"), TrainConfig.from_flags(model_name="org/model",
                                                                                         use_peft=True)
    assert (full.optim.lr, full.max_steps, full.model.activation_checkpointing) == (2e-5, 0, True)
    assert lora.optim.lr == 2e-4
    assert [full.resolved_save_every(steps) for steps in (1, 95, 100_000)] == [1, 10, 500]
    mine = TrainConfig.from_flags(model_name="org/model", lr=1e-5, max_steps=7, activation_checkpointing=False,
                                  save_every=0)
    assert (mine.optim.lr, mine.max_steps, mine.model.activation_checkpointing) == (1e-5, 7, False)
    assert mine.resolved_save_every(100) == 0
    assert TrainConfig.from_flags(activation_checkpointing="auto", model_name="org/model").model.activation_checkpointing
    # the embedded model on the user's data: its own learning rate, but epochs and saves as for any data
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "a"}\n')
    own = TrainConfig.from_flags(dataset=str(data))
    assert (own.optim.lr, own.max_steps, own.model.activation_checkpointing) == (1e-3, 0, False)
    assert own.resolved_save_every(40) == 4


def test_every_flag_is_unique_and_documented():
    names = TrainConfig.flag_names()
    assert "context_length" in names and names["context_length"] == "data" and names["max_steps"] is None
    assert len(names) == len(set(names))


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(contxt_length=4096), r"unknown flag --contxt_length; did you mean --context_length\?"),
        (dict(context_length=100, cp=4), r"--context_length 100 must be a multiple of 2 x cp = 8 .*use --context_length 104"),
        (dict(cp_strategy="zigzag"), r"--cp_strategy must be one of ring, ulysses"),
        (dict(optimizer="sgd"), r"--optimizer must be one of adamw, adamw8bit"),
        (dict(lr="fast"), r"--lr expects float"),
        (dict(batch_size=0), r"--batch_size must be >= 1"),
        (dict(cp=4, ulysses_degree=2), r"--ulysses_degree 2 is only read by --cp_strategy hybrid \(got 'ring'\)"),
        (dict(cp=4, cp_strategy="hybrid"), r"--cp_strategy hybrid needs --ulysses_degree, a divisor of --cp 4 .*got 0"),
        (dict(cp=4, cp_strategy="hybrid", ulysses_degree=3), r"a divisor of --cp 4 .*got 3"),
        (dict(passkey_warmup=1), r"--passkey_warmup is a share of the steps in \[0, 1\), got 1"),
        (dict(passkey_warmup=-0.5), r"--passkey_warmup must be >= 0.0, got -0.5"),
        (dict(passkey_digits=-1), r"--passkey_digits must be >= 0, got -1"),
        (dict(objective="ppo"), r"--objective must be one of sft, dpo; got 'ppo'"),
        (dict(offload_params=True, optimizer="adamw8bit"), r"--offload_params .* --optimizer adamw8bit: drop one"),
        (dict(objective="dpo", dpo_loss="ipo"), r"--dpo_loss must be one of sigmoid, simpo, orpo"),
        (dict(objective="dpo", dpo_beta=0), r"--dpo_beta must be > 0, got 0"),
        (dict(objective="dpo", dataset="org/pairs", streaming=True, max_steps=5), r"--objective dpo .* drop --streaming"),
        (dict(objective="dpo", document_mask=False), r"--objective dpo .* drop --document_mask false"),
        (dict(objective="dpo", dataset="org/pairs", eval_perplexity=True), r"drop --eval_perplexity"),
    ],
)
def test_bad_flags_are_clear_errors(flags, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig.from_flags(**flags)


def test_a_config_class_s_type_hints_are_evaluated_once_not_once_a_flag(tmp_path):
    """Reading flags evaluates a config class's annotations once (typing.get_type_hints compiles every
    field's annotation string: once a coerced or checked flag, it made from_flags 33 ms instead of 0.2);
    the types read are the same each time."""
    import typing

    from llama_cp.flags import reading

    files = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for file in files:
        file.write_text('{"text": "x"}\n')
    data = ",".join(map(str, files))
    reading._type_hints.cache_clear()
    with unittest.mock.patch.object(typing, "get_type_hints", wraps=typing.get_type_hints) as hints:
        first = TrainConfig.from_flags(context_length=256, use_peft=True, max_steps=3, lr=1e-3,
                                       dataset=tuple(map(str, files)))
        second = TrainConfig.from_flags(context_length=512, use_peft=False, max_steps=4, lr="2e-3")
    classes = [call.args[0] for call in hints.call_args_list]
    assert classes and len(classes) == len(set(classes)), classes  # each config class (and section) once
    assert (first.data.context_length, first.peft.use_peft, first.optim.lr, first.data.dataset) == (
        256, True, 1e-3, data)
    assert (second.data.context_length, second.peft.use_peft, second.optim.lr) == (512, False, 2e-3)


def test_dpo_learning_rates_resolve_by_mode_and_an_explicit_flag_wins(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    assert TrainConfig.from_flags(objective="dpo").optim.lr == 1e-3  # the embedded model, from scratch
    with unittest.mock.patch("llama_cp.modules.causal_lm.check_model_name"):
        assert TrainConfig.from_flags(objective="dpo", model_name=str(model)).optim.lr == 1e-6
        assert TrainConfig.from_flags(objective="dpo", model_name=str(model), use_peft=True).optim.lr == 5e-6
        assert TrainConfig.from_flags(objective="dpo", model_name=str(model), lr=3e-7).optim.lr == 3e-7


def test_passkey_digits_auto_is_one_for_the_embedded_model_only(tmp_path):
    """Note [Passkey length warm-up]: the embedded model learns a one-digit key in the default job;
    any other model gets the usual five digits unless told."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert TrainConfig.from_flags().passkey_key_digits() == 1
    assert TrainConfig.from_flags(model_name=str(tmp_path)).passkey_key_digits() == 5
    assert TrainConfig.from_flags(passkey_digits=3).passkey_key_digits() == 3
    assert TrainConfig.from_flags(model_name=str(tmp_path), passkey_digits=1).passkey_key_digits() == 1


@pytest.mark.parametrize("scheduler", ["cosine", "linear"])
@pytest.mark.parametrize("floor", [0.0, 0.1, 0.5])
def test_decay_ends_at_min_lr_ratio(scheduler, floor):
    from llama_cp import Trainer

    trainer = Trainer(TrainConfig.from_flags(lr_scheduler=scheduler, min_lr_ratio=floor, warmup_steps=10))
    trainer.total_steps = 110
    assert trainer._lr_factor(10) == pytest.approx(1.0)
    assert trainer._lr_factor(60) == pytest.approx(floor + (1 - floor) * 0.5)  # half way, for both shapes
    assert trainer._lr_factor(110) == pytest.approx(floor) and trainer._lr_factor(500) == pytest.approx(floor)
    with pytest.raises(ValueError, match=r"--min_lr_ratio is a fraction of --lr in \[0, 1\], got 1.5"):
        TrainConfig.from_flags(min_lr_ratio=1.5)


@pytest.mark.slow
def test_importing_the_library_leaves_the_warning_filters_alone():
    """The library's imports add no global warning filter (the dependencies' own are imported first)."""
    import subprocess
    import sys

    code = (
        "import warnings, torch, transformers, peft, datasets, matplotlib, fire, yaml, tqdm\n"
        "import torch.distributed.checkpoint, torch.distributed.fsdp, torch.utils.tensorboard\n"
        "import torch.distributed._tools.fsdp2_mem_tracker\n"
        "before = list(warnings.filters)\n"
        "import llama_cp, llama_cp.train.trainer, llama_cp.plan.memory, llama_cp.train.checkpoint, llama_cp.train.reporting\n"
        "import recipes.finetune_longctx, recipes.plan_memory\n"
        "added = [f for f in warnings.filters if f not in before]\n"
        "assert not added, added\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize(
    "torch_version, bitsandbytes_version, installed",
    [
        ("2.8.0+cu128", "0.45.0", "torch 2.8.0+cu128, bitsandbytes 0.45.0"),
        ("2.11.0", "0.50.2", "torch 2.11.0, bitsandbytes 0.50.2"),
        ("2.13.0+cpu", "0.45.5", "torch 2.13.0+cpu, bitsandbytes 0.45.5"),
        ("2.13.0+cpu", None, "torch 2.13.0+cpu, bitsandbytes not installed"),
        ("2.12.0a0+git1234", "0.46.0", None),  # a 2.12 pre-release carries the FSDP2 fix too
        ("2.12.0", "0.46.0", None),
        ("2.13.0+cpu", "0.50.2", None),
    ],
)
def test_qlora_refusal_names_installed_and_needed_versions(torch_version, bitsandbytes_version, installed):
    from llama_cp.modules.quantize import qlora_refusal

    expected = None if installed is None else (
        f"--quantization 4bit needs torch >= 2.12 and bitsandbytes >= 0.46 (installed: {installed}); "
        "upgrade them or train LoRA without --quantization"
    )
    assert qlora_refusal(torch_version, bitsandbytes_version) == expected


def test_qlora_is_refused_at_validation_where_the_installed_versions_lack_support():
    from importlib.metadata import version

    import torch

    from llama_cp.modules.quantize import installed_qlora_refusal

    if installed_qlora_refusal() is None:
        pytest.skip(f"torch {torch.__version__} and bitsandbytes {version('bitsandbytes')} run QLoRA")
    with pytest.raises(ValueError) as error:
        TrainConfig.from_flags(use_peft=True, quantization="4bit")
    assert str(error.value) == installed_qlora_refusal()
    assert str(error.value).startswith("--quantization 4bit needs torch >= 2.12 and bitsandbytes >= 0.46 (installed: ")


def test_a_config_for_several_ranks_builds_after_a_single_process_run(monkeypatch):
    """init_distributed leaves RANK=0 WORLD_SIZE=1 in a notebook's environment after an in-process
    run; a config for launch(cfg, nprocs=2) must still build there (the world is checked at launch)."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert TrainConfig.from_flags(cp=2, context_length=64).parallel.cp == 2
    monkeypatch.setenv("WORLD_SIZE", "2")  # one of two ranks: the world is known, and both rules are checked
    with pytest.raises(ValueError, match=r"multiple of 2 x cp = 6.*; and world_size\(2\)"):
        TrainConfig.from_flags(cp=3, context_length=64)


@pytest.mark.parametrize(
    "heads, cp, dataset, want",
    [
        (32, 1, "passkey", ("ring", 0)),
        (32, 8, "passkey", ("ulysses", 0)),  # one document per row, heads % cp == 0
        (32, 64, "passkey", ("hybrid", 32)),  # more ranks than heads: Ulysses over 32, ring of 2
        (24, 16, "passkey", ("hybrid", 8)),
        (7, 4, "passkey", ("ring", 0)),
        (32, 8, "data.jsonl", ("allgather", 0)),  # packed rows
    ],
)
def test_auto_strategy_follows_its_note(heads, cp, dataset, want, tmp_path):
    from types import SimpleNamespace

    from llama_cp.model.build import cp_strategy

    if dataset != "passkey":
        dataset = str(tmp_path / dataset)
        (tmp_path / "data.jsonl").write_text('{"text": "a b c"}\n')
    cfg = TrainConfig.from_flags(cp=cp, cp_strategy="auto", dataset=dataset, context_length=2 * cp * 8)
    assert cp_strategy(cfg, SimpleNamespace(num_attention_heads=heads)) == want
    cfg.data.document_mask = False  # rows attend across documents: one sequence, as a one-document row
    assert cp_strategy(cfg, SimpleNamespace(num_attention_heads=heads))[0] != "allgather"


def test_lora_target_parameters_is_refused_by_a_peft_without_them(monkeypatch):
    """peft < 0.17's LoraConfig has no target_parameters: one line naming the flag and the version,
    not a TypeError from peft (the floors' peft 0.15 is such a peft)."""
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    from llama_cp.model import build

    has = tuple(int(part) for part in peft.__version__.split(".")[:2]) >= (0, 17)
    assert build.peft_supports_target_parameters() == has
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    monkeypatch.setattr(build, "peft_supports_target_parameters", lambda: False)
    build.check_lora_targets(model, ("q_proj",))  # no parameters asked for: nothing to refuse
    with pytest.raises(ValueError, match=rf"--lora_target_parameters needs peft >= 0.17 \(installed: "
                                         rf"{re.escape(peft.__version__)}\)"):
        build.check_lora_targets(model, ("q_proj",), ["mlp.experts.gate_up_proj"])
