"""The checks of a configuration, run when it is made (``TrainConfig.from_flags`` /
``validate``), before anything is built: each broken rule is one line naming the flags and the fix.
The functions take the config, or the section, they check."""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from llama_cp.data.grammar import PASSKEY, check_sources, parse_sources
from llama_cp.flags.reading import field_type
from llama_cp.parallel.sharding import check_context_length

#: peft's keyword for every Linear layer but the output layer (--lora_target_modules all-linear).
ALL_LINEAR = "all-linear"
#: ``--report_to``'s trackers (llama_cp.train.reporting writes to them).
REPORTERS = ("tensorboard", "wandb")
#: The memory levers (ModelConfig's flags that change a step's memory, not its math), whichever of
#: them a user gives making --memory default manual; --memory auto chooses them (llama_cp/plan/auto.py).
MEMORY_LEVERS = ("activation_checkpointing", "activation_offload", "offload_params", "offload_checkpoints",
                 "mlp_tile_size", "norm_tile_size", "attention_block_size", "frozen_dtype")
#: Lower bounds of the numeric flags.
MINIMUMS = {
    "context_length": 1, "batch_size": 1, "gradient_accumulation_steps": 1, "loss_chunk_size": 0, "cp": 1,
    "mlp_tile_size": 0, "norm_tile_size": 0, "attention_block_size": 0, "gpu_memory_gb": 0.0, "headroom": 0.0,
    "dp_replicate": 1, "lora_r": 1, "num_proc": 1, "num_passkey_samples": 1, "passkey_digits": 0, "passkey_warmup": 0.0, "num_eval_samples": 1, "num_epochs": 1,
    "max_steps": 0, "warmup_steps": 0, "save_every": 0, "eval_every": 0, "keep_last": 1, "log_every": 1,
    "max_nonfinite_steps": 1, "peak_tflops": 0.0,
    "collective_timeout": 1.0, "rope_theta": 0.0, "min_lr_ratio": 0.0, "lr": 0.0, "weight_decay": 0.0, "max_grad_norm": 0.0, "lora_dropout": 0.0,
}
#: Flags whose value below the minimum means "auto" (Note [Defaults by run] in llama_cp/flags/defaults.py).
AUTO = {"max_steps": -1, "save_every": -1}


def validate(cfg) -> None:
    """Check every flag of a TrainConfig and how they combine, resolving its auto values on the way
    (``cfg.resolve_defaults()``, after the checks that must see them unresolved)."""
    for section in (cfg.model, cfg.parallel, cfg.peft, cfg.data, cfg.optim, cfg):
        for f in dataclasses.fields(section):
            choices = typing.get_args(field_type(type(section), f.name))
            if typing.get_origin(field_type(type(section), f.name)) is Literal:
                value = getattr(section, f.name)
                if value not in choices:
                    raise ValueError(f"--{f.name} must be one of {', '.join(map(str, choices))}; got {value!r}")
    names = cfg.flag_names()
    for name, minimum in MINIMUMS.items():
        section = getattr(cfg, names[name]) if names[name] else cfg
        value = getattr(section, name)
        if value < minimum and value != AUTO.get(name):
            auto = f" (or {AUTO[name]}: auto)" if name in AUTO else ""
            raise ValueError(f"--{name} must be >= {minimum}{auto}, got {value}")
    check_report_to(cfg.report_to)
    given = memory_levers_given(cfg.model) if cfg.model.memory == "auto" else []
    if given:  # before resolve_defaults: a lever left to auto (--activation_checkpointing) is not given
        raise ValueError(
            f"--memory auto chooses the memory levers itself, and {' and '.join(given)} "
            f"{'set levers' if len(given) > 1 else 'sets one'}: drop {'them' if len(given) > 1 else 'it'}, or "
            "give --memory manual to set the levers yourself"
        )
    if cfg.model.headroom >= 1:
        raise ValueError(f"--headroom is a fraction of --gpu_memory_gb in [0, 1), got {cfg.model.headroom}")
    cfg.resolve_defaults()
    if cfg.optim.min_lr_ratio > 1:
        raise ValueError(f"--min_lr_ratio is a fraction of --lr in [0, 1], got {cfg.optim.min_lr_ratio}")
    if cfg.data.passkey_warmup >= 1:
        raise ValueError(f"--passkey_warmup is a share of the steps in [0, 1), got {cfg.data.passkey_warmup}")
    if cfg.peft.quantization != "none" and not cfg.peft.use_peft:
        raise ValueError(
            f"--quantization {cfg.peft.quantization} freezes the base weights, so only LoRA adapters can "
            "train: add --use_peft, or drop --quantization for a full fine-tune"
        )
    if cfg.peft.quantization == "4bit":
        from llama_cp.modules.quantize import check_qlora_support

        check_qlora_support()
    check_peft(cfg.peft)
    if cfg.merge_lora and not cfg.peft.use_peft:
        raise ValueError("--merge_lora merges LoRA adapters into the base model: add --use_peft (a full fine-tune's "
                         "final/ is the whole model already)")
    if cfg.export_gguf != "none":
        if cfg.peft.use_peft and not cfg.merge_lora:
            raise ValueError(f"--export_gguf {cfg.export_gguf} with --use_peft: a GGUF file holds one model, written "
                             "from the merged one: add --merge_lora")
        if cfg.model.model_name == "embedded":
            raise ValueError("--export_gguf: the embedded model's byte tokenizer has no BPE merges, which a GGUF "
                             "vocabulary needs; export a real model (--model_name)")
        from llama_cp.modules.gguf import require_gguf

        require_gguf("--export_gguf")
    if cfg.merge_lora and cfg.peft.lora_target_parameters:
        raise ValueError("--merge_lora with --lora_target_parameters: adapters on fused expert tensors are not merged "
                         "here; drop --merge_lora and merge the run's adapter (final/) with peft's merge_and_unload")
    if cfg.merge_lora and cfg.peft.quantization != "none":
        raise ValueError("--merge_lora with --quantization 4bit: the base weights in training are NF4 codes; after "
                         "the run merge onto the original weights with python -m recipes.export --checkpoint "
                         "OUTPUT_DIR/final --merge_lora --output_dir DIR")
    if cfg.model.offload_params and (cfg.peft.quantization != "none" or cfg.optim.optimizer != "adamw"):
        raise ValueError(
            "--offload_params keeps the sharded state in host memory for torch's AdamW; it is not built for "
            f"--quantization {cfg.peft.quantization} (NF4 codes) or --optimizer {cfg.optim.optimizer}: drop one"
        )
    if cfg.model.offload_checkpoints and not cfg.model.activation_checkpointing:
        raise ValueError(
            "--offload_checkpoints moves the inputs that activation checkpointing keeps to host memory: "
            "add --activation_checkpointing (or drop --offload_checkpoints)"
        )
    if cfg.model.frozen_dtype == "bfloat16" and not cfg.peft.use_peft:
        raise ValueError(
            "--frozen_dtype bfloat16 stores the frozen LoRA base weights in bf16, but without --use_peft "
            "every weight is trained: add --use_peft or use --frozen_dtype auto"
        )
    # The world size is known here when this process was launched as one of several ranks (torchrun,
    # the launcher). WORLD_SIZE=1 says nothing: init_distributed sets it for a single process, and a
    # notebook that trained in-process may go on to build a config for launch(cfg, nprocs=N).
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_parallel(cfg.parallel, cfg.data.context_length, world if world > 1 else None)
    from llama_cp.modules.causal_lm import check_model_name, parse_rope_scaling

    check_model_name(cfg.model.model_name)
    if cfg.data.streaming and (cfg.data.dataset == PASSKEY or cfg.max_steps == 0):
        raise ValueError(
            "--streaming reads a file or hub --dataset of unknown length: give such a --dataset and --max_steps > 0"
        )
    parse_rope_scaling(cfg.model.rope_scaling)  # the form; what it reaches is checked with the model's config
    check_data(cfg)


def check_data(cfg) -> None:
    """The data flags of a TrainConfig: its sources, its eval set, and what the objective and the
    evals need of them."""
    check_sources(parse_sources(cfg.data.dataset, "--dataset", cfg.data.dataset_columns))
    if cfg.data.eval_dataset:
        if cfg.data.dataset == PASSKEY:
            raise ValueError("--eval_dataset needs a file or hub --dataset: the passkey task makes its own eval rows")
        if PASSKEY in (source.path for source in parse_sources(cfg.data.eval_dataset, "--eval_dataset")):
            raise ValueError("--eval_dataset passkey: the passkey task evaluates itself with --dataset passkey; "
                             "give a file or hub dataset")
        check_sources(parse_sources(cfg.data.eval_dataset, "--eval_dataset", cfg.data.dataset_columns))
    if cfg.eval_perplexity and cfg.data.dataset == PASSKEY:
        raise ValueError("--eval_perplexity measures the loss on natural text, and the passkey task is not: give a "
                         "file or hub --dataset, or drop --eval_perplexity (--eval_needle measures retrieval)")
    if cfg.eval_perplexity and cfg.data.streaming and not cfg.data.eval_dataset:
        raise ValueError("--eval_perplexity with --streaming reads whole eval documents, and a stream's are spread "
                         "over all of it: give --eval_dataset")
    if cfg.objective == "dpo":
        check_preference(cfg)
    if not 0 <= cfg.data.eval_fraction < 1:
        raise ValueError(f"--eval_fraction {cfg.data.eval_fraction}: give a share of the documents in [0, 1)")
    if cfg.data.chat_template and not Path(cfg.data.chat_template).expanduser().is_file():
        raise FileNotFoundError(f"--chat_template {cfg.data.chat_template!r}: no such file (a Jinja chat template, "
                                "e.g. an instruct model's chat_template.jinja)")


def check_preference(cfg) -> None:
    """What --objective dpo cannot run with, each refused in one line."""
    if cfg.dpo_beta <= 0:
        raise ValueError(f"--dpo_beta must be > 0, got {cfg.dpo_beta}")
    if cfg.data.streaming:
        raise ValueError("--objective dpo packs each pair's two sequences whole into one prepared row, and "
                         "--streaming packs documents as they arrive: drop --streaming (recipes.prepare_data "
                         "prepares the pairs once)")
    if not cfg.data.document_mask:
        raise ValueError("--objective dpo packs a pair's chosen and rejected sequences as two documents of a row, "
                         "which must not see each other: drop --document_mask false")
    if cfg.eval_perplexity:
        raise ValueError("--eval_perplexity reads natural-text documents, and --objective dpo data is pairs: "
                         "drop --eval_perplexity")


def check_parallel(parallel, context_length: int, world_size: int | None = None) -> None:
    """ValueError naming every rule a ParallelConfig breaks, in one message: --context_length a
    multiple of 2 x cp, and (when ``world_size`` is known) the degrees multiplying to it; a single
    process asked for more is told how to launch them."""
    from llama_cp.attention.hybrid import check_ulysses_degree

    problems = []
    for check in (lambda: check_context_length(context_length, parallel.cp),
                  lambda: check_ulysses_degree(parallel.cp_strategy, parallel.ulysses_degree, parallel.cp)):
        try:
            check()
        except ValueError as error:
            problems.append(str(error))
    if world_size is not None:
        try:
            parallel.dims(world_size)
        except ValueError as error:
            if world_size > 1:
                problems.append(f"{error}: choose --dp_replicate, --dp_shard and --cp for {world_size} processes")
            else:
                needed = parallel.dp_replicate * max(parallel.dp_shard, 1) * parallel.cp
                problems.append(
                    f"--cp {parallel.cp} --dp_shard {parallel.dp_shard} --dp_replicate {parallel.dp_replicate} need "
                    f"{needed} processes, and this is one: launch with torchrun --nproc_per_node {needed} -m "
                    f"recipes.finetune_longctx ... (or llama_cp.launch(cfg, nprocs={needed}) from a notebook)"
                )
    if problems:
        raise ValueError("; and ".join(problems))


def check_peft(peft) -> None:
    """ValueError, one line, for LoRA options of a PeftConfig that cannot be used together."""
    options = [f"--{name}" for name, on in (("lora_modules_to_save", peft.lora_modules_to_save),
                                             ("use_rslora", peft.use_rslora), ("use_dora", peft.use_dora)) if on]
    if options and not peft.use_peft:
        many = len(options) > 1
        raise ValueError(f"{' and '.join(options)} {'are LoRA options' if many else 'is a LoRA option'}: add "
                         f"--use_peft, or drop {'them' if many else 'it'}")
    check_all_linear(peft.lora_target_modules)
    if peft.use_dora and peft.quantization == "4bit":
        raise ValueError("--use_dora with --quantization 4bit: DoRA normalises each adapted base weight, and peft "
                         "reads it from the layer's weight, which under QLoRA holds the packed NF4 codes (Note [4-bit "
                         "weights under FSDP2]), not the weights; drop one of them")
    if peft.use_dora and peft.lora_target_parameters:
        raise ValueError("--use_dora with --lora_target_parameters: peft has no DoRA for adapters on parameters "
                         "(its ParamWrapper); drop one of them")


def check_all_linear(targets) -> None:
    """One line unless ``all-linear`` in --lora_target_modules stands alone (peft takes it as a
    keyword only in place of the list)."""
    if ALL_LINEAR in targets and len(targets) > 1:
        raise ValueError(f"--lora_target_modules {','.join(targets)}: {ALL_LINEAR} already names every Linear layer "
                         f"but the output layer; give {ALL_LINEAR} alone, or a list of names")


def check_report_to(report_to: Sequence[str]) -> None:
    """ValueError naming the flag and the fix for an unknown or unusable reporter."""
    for name in report_to:
        if name not in (*REPORTERS, "none"):
            raise ValueError(f"--report_to {name!r}: choose from {', '.join(REPORTERS)} or none (comma-separated)")
    if "none" in report_to and len(report_to) > 1:
        raise ValueError("--report_to none cannot be combined with other reporters")
    if "tensorboard" in report_to and not _importable("tensorboard"):
        raise ValueError("--report_to tensorboard needs the tensorboard package: pip install tensorboard")
    if "wandb" in report_to and not _importable("wandb"):
        raise ValueError("--report_to wandb needs the wandb package: pip install wandb (or drop wandb)")


def memory_levers_given(model) -> list[str]:
    """The memory levers of a ModelConfig set away from their defaults, as flags
    (``--mlp_tile_size 4096``); --activation_checkpointing counts while not yet resolved from auto
    (None), so call it before ``TrainConfig.resolve_defaults``."""
    defaults = type(model)()
    given = []
    for name in MEMORY_LEVERS:
        value = getattr(model, name)
        if value != getattr(defaults, name):
            given.append(f"--{name} {str(value).lower() if isinstance(value, bool) else value}")
    return given


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
