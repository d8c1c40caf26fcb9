"""The training configuration: nested dataclasses, YAML presets, flat CLI flags.

Every leaf field has a unique name, which is also its command-line flag
(``--context_length 8192``), the names llama-recipes uses where it has one.
A YAML preset may be flat (``context_length: 8192``) or nested by section
(``data: {context_length: 8192}``); flags override the preset, the preset
overrides the defaults. An unknown name is an error listing the close matches.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import os
import textwrap
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from llama_cp.data_flags import LOCAL_FILE_SUFFIXES, PASSKEY, check_sources, parse_sources  # noqa: F401
from llama_cp.parallel.sharding import check_context_length

#: peft's keyword for every Linear layer but the output layer (--lora_target_modules all-linear).
ALL_LINEAR = "all-linear"
#: ``--report_to``'s trackers (llama_cp.train.reporting writes to them).
REPORTERS = ("tensorboard", "wandb")


@dataclass
class ModelConfig:
    model_name: str = "embedded"
    """Local HF model directory or hub id; "embedded" is the built-in small Llama (no download)."""
    rope_theta: float = 0.0
    """RoPE base frequency, set in the model's config before it is built (context extension by a larger base); 0 = the model's own."""
    rope_scaling: str = "none"
    """RoPE scaling set in the model's config before it is built, in transformers' names: type:key=value,... (linear, dynamic, yarn, llama3, longrope; e.g. yarn:factor=8,original_max_position_embeddings=8192) or a JSON object; it must reach --context_length; none = the model's own, default = plain RoPE."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype of the gathered parameters: auto = bfloat16 on CUDA, float32 on CPU."""
    memory: Literal["default", "auto", "manual"] = "default"
    """How the memory levers are set. auto: before the model is built, the cheapest set of --activation_checkpointing, --attention_block_size 16384, --mlp_tile_size/--norm_tile_size 8192, --offload_checkpoints and --offload_params (added in that order, least costly in time first) whose planned peak per GPU fits --gpu_memory_gb less --headroom, said in one line with its planned peak and recorded in run_info.json; a run that does not fit with all of them is refused in one line with its planned peak and the longest context that fits (Note [Choosing the memory levers] in llama_cp/plan/auto.py). On CPU the choice is only planned and said (given --gpu_memory_gb): the levers stay as given. manual: the lever flags as given. default: auto when none of those flags, --frozen_dtype or --activation_offload is given, else manual (resolved at start). --memory auto with a lever flag is refused."""
    gpu_memory_gb: float = 0.0
    """GiB of memory of one GPU, what --memory auto plans for; 0 = the CUDA device's total memory (without a GPU, --memory auto plans only when this is given)."""
    headroom: float = 0.1
    """Fraction of --gpu_memory_gb that --memory auto keeps free for the CUDA context, NCCL's and cuBLAS's workspaces and the allocator's fragmentation, which no plan counts (as python -m recipes.plan_memory)."""
    activation_checkpointing: bool | None = None
    """Recompute each decoder layer's activations in backward (saves most activation memory); auto = on for every model but the embedded one (a 128K run of an 8B model needs it), resolved at start (run_info.json)."""
    activation_offload: bool = False
    """Keep saved activations in CPU memory during forward/backward (the longest runs)."""
    loss_chunk_size: int = 0
    """Tokens per chunk of the chunked cross-entropy (never builds the full logits); 0 = auto: at most 4096, fewer for large vocabularies so one chunk's fp32 logits stay <= 256 MiB (512 at vocab 128256)."""
    frozen_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Storage dtype of frozen (LoRA base) weights; auto = bfloat16 with --use_peft when the compute dtype is bf16 (--dtype auto on CUDA), else float32. Trainable weights and optimizer state stay float32."""
    offload_params: bool = False
    """Keep the sharded parameters, gradients and AdamW state in host memory (FSDP2's CPU offload policy, pinned on CUDA): each layer's parameters are copied to the GPU for its forward and backward, the gradients back after their reduce-scatter, and the optimizer steps on the CPU; for full fine-tuning whose state does not fit the GPUs. Slower: 0.61x the tokens/s on an H200 (docs/benchmarks.md). Not with --quantization 4bit or --optimizer adamw8bit. The planner says the host memory it needs."""
    offload_checkpoints: bool = False
    """With --activation_checkpointing: keep each decoder layer's checkpointed input in (pinned) host memory, copied on a side stream, prefetched for the recompute."""
    mlp_tile_size: int = 0
    """Compute each decoder MLP in tiles of this many tokens, the backward recomputing one tile at a time (exact); 0 = off."""
    norm_tile_size: int = 0
    """Compute the decoder's RMSNorm/LayerNorms (per layer and final) in tiles of this many tokens, recomputed per tile in backward (exact); 0 = off."""
    attention_block_size: int = 16384
    """Tokens per query block and per key block of every local attention kernel call (cp 1, each ring step, Ulysses, packed documents), so the kernels' float32 and GQA-expanded workspaces are per block, not per sequence (exact); 0 = one call per block; the default 16384 keeps flash-attn's backward workspace at ~0.5 GiB for Llama-3-8B."""
    router_aux_loss_coef: float = -1.0
    """MoE models (Mixtral, Qwen3-MoE, OLMoE): coefficient of the router's load-balancing loss, reduced over every rank as one process computes it; -1 = the model config's (added only if its output_router_logits is true, as in transformers); 0 = off."""
    attention_backend: Literal["auto", "flash_attn", "sdpa_flash", "sdpa_efficient", "sdpa_cpu", "math"] = "auto"
    """Local attention kernel; auto = the fastest that runs (flash_attn > sdpa_flash > sdpa_efficient on CUDA, sdpa_cpu on CPU). A choice that cannot run (device, dtype, head size, flash-attn missing) is refused at start."""


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    """HSDP replicas (usually nodes); 1 = plain FSDP."""
    dp_shard: int = -1
    """FSDP shards per replica; -1 = the rest of the world size."""
    cp: int = 1
    """Context-parallel degree: ranks that split one sequence."""
    cp_strategy: Literal["ring", "ulysses", "allgather", "hybrid", "auto"] = "ring"
    """ring (any head count), ulysses (num_attention_heads % cp == 0), allgather (K/V gathered, rows sharded by their documents: balanced packed rows), hybrid (Ulysses inside groups of --ulysses_degree ranks, ring across them: cp beyond the head count), or auto (picked from heads, cp and packing; logged)."""
    ulysses_degree: int = 0
    """--cp_strategy hybrid: consecutive cp ranks that split heads (Ulysses; usually the GPUs of a node); must divide --cp and num_attention_heads. 0 = unset."""

    def check(self, context_length: int, world_size: int | None = None) -> None:
        """ValueError naming every parallel rule broken, in one message: --context_length a
        multiple of 2 x cp, and (when ``world_size`` is known) the degrees multiplying to it;
        a single process asked for more is told how to launch them."""
        from llama_cp.attention.hybrid import check_ulysses_degree

        problems = []
        for check in (lambda: check_context_length(context_length, self.cp),
                      lambda: check_ulysses_degree(self.cp_strategy, self.ulysses_degree, self.cp)):
            try:
                check()
            except ValueError as error:
                problems.append(str(error))
        if world_size is not None:
            try:
                self.dims(world_size)
            except ValueError as error:
                if world_size > 1:
                    problems.append(f"{error}: choose --dp_replicate, --dp_shard and --cp for {world_size} processes")
                else:
                    needed = self.dp_replicate * max(self.dp_shard, 1) * self.cp
                    problems.append(
                        f"--cp {self.cp} --dp_shard {self.dp_shard} --dp_replicate {self.dp_replicate} need {needed} "
                        f"processes, and this is one: launch with torchrun --nproc_per_node {needed} -m "
                        f"recipes.finetune_longctx ... (or llama_cp.launch(cfg, nprocs={needed}) from a notebook)"
                    )
        if problems:
            raise ValueError("; and ".join(problems))

    def dims(self, world_size: int | None = None):
        """The validated :class:`~llama_cp.parallel.mesh.ParallelDims` of these degrees on ``world_size``
        ranks (default: the initialised process group's)."""
        from llama_cp.parallel.mesh import ParallelDims

        return ParallelDims(dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, cp=self.cp, world_size=world_size)


@dataclass
class PeftConfig:
    use_peft: bool = False
    """Train LoRA adapters instead of all weights."""
    lora_r: int = 8
    """LoRA rank."""
    lora_alpha: int = 16
    """LoRA scaling numerator (scale = lora_alpha / lora_r; lora_alpha / sqrt(lora_r) with --use_rslora)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input."""
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    """Module names that get adapters; all-linear = every Linear layer but the output layer (peft's all-linear)."""
    lora_modules_to_save: tuple[str, ...] = ()
    """Modules trained in full beside the adapters and saved with them (peft's modules_to_save), matched by the end of their names: embed_tokens,norm trains the input embedding and every norm, which LongLoRA (Chen et al. 2023) found context extension needs. Refused for the embedding of a model with tied embeddings."""
    use_rslora: bool = False
    """Rank-stabilised LoRA (peft's use_rslora): scale = lora_alpha / sqrt(lora_r), which keeps the adapters' updates from shrinking as --lora_r grows (Kalajdzievski 2023)."""
    use_dora: bool = False
    """DoRA (peft's use_dora): every adapted weight as a trained magnitude per row times a LoRA-adapted direction; not with --quantization 4bit or --lora_target_parameters; the memory planner refuses it."""
    lora_target_parameters: tuple[str, ...] = ()
    """Parameters (not Linear layers) that get adapters, peft's target_parameters: the fused experts of MoE models in transformers 5, e.g. mlp.experts.gate_up_proj,mlp.experts.down_proj."""
    quantization: Literal["none", "4bit"] = "none"
    """4bit = QLoRA: the frozen base Linear layers of the decoder in NF4 (bitsandbytes), sharded by FSDP; needs --use_peft."""

    def check(self) -> None:
        """ValueError, one line, for LoRA options that cannot be used together."""
        options = [f"--{name}" for name, on in (("lora_modules_to_save", self.lora_modules_to_save),
                                                 ("use_rslora", self.use_rslora), ("use_dora", self.use_dora)) if on]
        if options and not self.use_peft:
            many = len(options) > 1
            raise ValueError(f"{' and '.join(options)} {'are LoRA options' if many else 'is a LoRA option'}: add "
                             f"--use_peft, or drop {'them' if many else 'it'}")
        check_all_linear(self.lora_target_modules)
        if self.use_dora and self.quantization == "4bit":
            raise ValueError("--use_dora with --quantization 4bit: DoRA normalises each adapted base weight, and peft "
                             "reads it from the layer's weight, which under QLoRA holds the packed NF4 codes (Note [4-bit "
                             "weights under FSDP2]), not the weights; drop one of them")
        if self.use_dora and self.lora_target_parameters:
            raise ValueError("--use_dora with --lora_target_parameters: peft has no DoRA for adapters on parameters "
                             "(its ParamWrapper); drop one of them")


@dataclass
class DataConfig:
    dataset: str = PASSKEY
    """passkey (built-in synthetic), a local json/jsonl/parquet/txt file or directory, or a hub id; each with :options (config=, split=, revision=, data_files=, FORMAT_COLUMN=COLUMN) and comma-separated with :WEIGHT for a mixture, e.g. a.jsonl:0.7,org/b:config=en:0.3 (docs/data.md)."""
    dataset_columns: str = ""
    """Read a format's column from another column of every source, e.g. text=body or prompt=question,completion=answer ("" = the formats' own names: text, prompt, completion, messages, instruction, input, output, chosen, rejected)."""
    eval_dataset: str = ""
    """The eval set, any source(s) --dataset accepts, all of its rows (its split=, else its validation/test split); nothing is held out of training. "" = each source's validation/test split, else an --eval_fraction hold-out."""
    eval_fraction: float = 0.05
    """Share of each source's documents held out for eval, drawn at random with --seed, when it has no eval split and no --eval_dataset is given (--streaming holds out every 20th document); 0 = no hold-out (a source's own validation split is still evaluated)."""
    on_bad_row: Literal["skip", "error"] = "skip"
    """A row that cannot be rendered or masked (a chat template error, an assistant turn not found): skip it (counted and the first ones named in the log) or stop with its row number."""
    chat_template: str = ""
    """A Jinja chat template file for chat (messages) data, in place of the tokenizer's own (e.g. the instruct model's chat_template.jinja when fine-tuning its base model); chat data on a tokenizer without a template is refused unless this names one. "" = the tokenizer's."""
    context_length: int = 1024
    """Tokens per row; must be a multiple of 2 x cp."""
    batch_size: int = 1
    """Rows per micro-batch per data-parallel rank."""
    num_passkey_samples: int = 512
    """Training rows of the passkey task."""
    passkey_digits: int = 0
    """Digits of the passkey task's key; 0 = auto: 1 for the embedded model (a random-init model that small learns to find one digit in a CPU-sized run, not to copy five in order: docs/recipe.md), else 5."""
    passkey_warmup: float = 0.9
    """Share of the training steps whose passkey rows pack shorter documents (--context_length / 8, / 4, / 2, at least 128 tokens, shortest first) before full-length ones: a model learning the task from scratch gets its signal from short documents (Note [Passkey length warm-up]); 0, or --document_mask false = full-length rows only."""
    num_eval_samples: int = 16
    """Eval rows (of --context_length tokens) evaluated at each eval, the first of the eval set for every source: an eval's cost does not grow with the corpus."""
    document_mask: bool = True
    """Packed documents (position_ids restart) attend only within themselves, as in transformers; false: across the row."""
    truncate_documents: bool = False
    """A document longer than --context_length keeps only its first context_length tokens; false: it goes on in the next row, its positions continuing."""
    streaming: bool = False
    """Read --dataset with datasets' streaming=True (hub datasets too large to download): documents split over dp ranks, packed as they arrive, nothing prepared; needs --max_steps."""
    data_cache_dir: str = ""
    """Where tokenized, packed rows of a file or hub --dataset are kept and reused (python -m recipes.prepare_data); "" = HF_DATASETS_CACHE/llama_cp."""
    data_cache_shared: bool = False
    """--data_cache_dir is one filesystem every node sees: global rank 0 prepares, not local rank 0 of each node."""
    num_proc: int = 1
    """Processes that tokenize a dataset when preparing it (datasets' map num_proc)."""


@dataclass
class OptimConfig:
    optimizer: Literal["adamw", "adamw8bit"] = "adamw"
    """adamw (torch) or adamw8bit (bitsandbytes' AdamW8bit on each rank's local shards; its step() synchronises the GPU after every parameter, torch.cuda.synchronize() in bitsandbytes 0.50.2, so a step waits on the device once per trainable tensor)."""
    lr: float = 0.0
    """Peak learning rate; 0 = by model and mode, resolved at start (run_info.json): 1e-3 for the embedded model (random weights, trained from scratch), 2e-4 with --use_peft (peft's LoRA guides), 2e-5 for a full fine-tune (TRL's SFT default); with --objective dpo, 1e-6 for a full fine-tune (TRL's DPO default) and 5e-6 with --use_peft."""
    weight_decay: float = 0.0
    """AdamW weight decay of the matrices (Linear weights, an untied lm_head, LoRA's A and B); norms, biases, DoRA's magnitudes and the embeddings (a tied lm_head too) do not decay (Note [Which parameters decay] in llama_cp/optim/optimizers.py)."""
    warmup_steps: int = 10
    """Linear warm-up steps."""
    lr_scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warm-up."""
    min_lr_ratio: float = 0.1
    """Where cosine/linear decay ends, as a fraction of --lr (0 = decay to zero)."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    num_epochs: int = 1
    """Passes over the training rows (--max_steps > 0 wins)."""
    max_steps: int = -1
    """Optimizer steps; 0 = --num_epochs of the data; -1 = auto: 200 for the embedded passkey demo (--model_name and --dataset left at their defaults), else 0."""
    seed: int = 0
    """Seed of the model init, the data order and the synthetic data."""
    output_dir: str = "outputs/run"
    """metrics.jsonl, the loss plot, checkpoints/ and final/ go here."""
    save_every: int = -1
    """Save a checkpoint every N steps; 0 = only at the end; -1 = auto: only at the end for the embedded passkey demo, else every tenth of the run's steps, at most 500 apart (resolved once the steps are known, in run_info.json)."""
    keep_last: int = 2
    """Checkpoints to keep."""
    resume: Literal["false", "true", "auto"] = "false"
    """Continue from the newest intact checkpoint in output_dir (true: one must exist; auto: else start at step 0)."""
    overwrite: bool = False
    """Start over in an output_dir that holds an earlier run (deletes its checkpoints, final/, metrics.jsonl, loss.png and tensorboard/)."""
    allow_unverified_checkpoint: bool = False
    """Let --resume load a checkpoint that has no MANIFEST.json (its files cannot be checked for damage)."""
    eval_every: int = 0
    """Evaluate every N steps (0 = only at the end)."""
    export_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """dtype of the full model written to final/ (and final_merged/); auto = the dtype of the model's checkpoint (config.json), float32 for the embedded model. A LoRA adapter keeps its float32 weights."""
    merge_lora: bool = False
    """With --use_peft: also write final_merged/, the adapters merged into the base weights (a plain transformers model in --export_dtype, RoPE settings in its config.json)."""
    eval_needle: bool = False
    """After training, passkey accuracy over context lengths (--context_length / 4, / 2, / 1) x needle depths (0 to 1) on the trained model: output_dir/needle.json and needle.png (recipes/eval_longctx.py)."""
    eval_perplexity: bool = False
    """After training, loss and perplexity of the trained model by context length (--context_length / 4, / 2, / 1) and position (4 equal ranges of each) on the run's eval documents, one per row, unpacked (the first --num_eval_samples of at least --context_length + 1 tokens): output_dir/perplexity.json and perplexity.png (recipes/eval_longctx.py). Needs natural text: not with --dataset passkey."""
    objective: Literal["sft", "dpo"] = "sft"
    """sft: the next-token loss on the data's completions. dpo: preference fine-tuning on data of (prompt, chosen, rejected) with --dpo_loss, each pair's two sequences packed whole into one row (docs/training.md, Preference fine-tuning); with --dataset passkey, the built-in preference task (the true key chosen, a wrong key rejected)."""
    dpo_loss: Literal["sigmoid", "simpo", "orpo"] = "sigmoid"
    """The preference loss of --objective dpo: sigmoid (DPO, against a reference model: the base with the LoRA adapters switched off under --use_peft, else the initial weights' log-probabilities computed once before training), simpo (SimPO's length-normalised margin, no reference), orpo (ORPO's odds ratio on top of the chosen completion's NLL, no reference)."""
    dpo_beta: float = 0.1
    """beta of --dpo_loss sigmoid and simpo (the reward scale), lambda of orpo (the odds-ratio term's weight); TRL's default. SimPO's paper uses 2 to 2.5."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin (--dpo_loss simpo), TRL's default."""
    log_every: int = 5
    """Write a metrics row every N steps."""
    report_to: tuple[str, ...] = ("tensorboard",)
    """Also send the metrics rows to: tensorboard (output_dir/tensorboard), wandb (when installed), or none."""
    peak_tflops: float = 0.0
    """Peak dense bf16 TFLOP/s of one GPU, the denominator of the mfu metric; 0 = looked up by the GPU's exact name (llama_cp.model.flops.PEAK_BF16_FLOPS); on CPU or an unlisted GPU no mfu is reported unless set."""
    max_nonfinite_steps: int = 3
    """A step whose loss or gradient norm is NaN/inf is skipped (no update); stop after this many in a row."""
    collective_timeout: float = 600.0
    """Seconds a collective waits for the other ranks; then the run stops with an error naming the rank and step."""

    SECTIONS: typing.ClassVar[tuple[str, ...]] = ("model", "parallel", "peft", "data", "optim")

    @classmethod
    def flag_names(cls) -> dict[str, str | None]:
        """Flag name -> section holding it (None for top-level fields)."""
        names: dict[str, str | None] = {}
        for f in dataclasses.fields(cls):
            if f.name in cls.SECTIONS:
                for leaf in dataclasses.fields(f.default_factory()):
                    names[leaf.name] = f.name
            else:
                names[f.name] = None
        return names

    @classmethod
    def flatten(cls, values: dict[str, Any]) -> dict[str, Any]:
        """Flag name -> value of a config nested by section (``to_dict()``, a checkpoint's
        config.yaml, a preset); flat entries pass through (every flag name is unique)."""
        flat: dict[str, Any] = {}
        for key, value in values.items():
            if key in cls.SECTIONS and isinstance(value, dict):
                flat.update(value)
            else:
                flat[key] = value
        return flat

    @classmethod
    def from_flags(cls, config: str | None = None, **flags: Any) -> "TrainConfig":
        """Defaults <- YAML preset ``config`` <- ``flags``; validates names and types."""
        values: dict[str, Any] = {}
        if config is not None:
            with open(config) as f:
                preset = yaml.safe_load(f) or {}
            values.update(cls.flatten(preset))
        values.update(flags)
        cfg = cls()
        if config is not None and "model_name" not in values:
            raise ValueError(
                f"--config {config} names no model, and its settings are written for one (a preset run alone would "
                "train the embedded demo model): add --model_name /path/to/model (a local HF directory or hub id), or "
                "model_name: in the preset"
            )
        names = cls.flag_names()
        for name, value in values.items():
            if name not in names:
                close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
                hint = f"; did you mean {', '.join('--' + c for c in close)}?" if close else ""
                raise ValueError(f"unknown flag --{name}{hint} (run with --help for the list)")
            section = names[name]
            target = getattr(cfg, section) if section else cfg
            setattr(target, name, _coerce(type(target), name, value))
        cfg.validate()
        return cfg

    def validate(self) -> None:
        for section in (self.model, self.parallel, self.peft, self.data, self.optim, self):
            for f in dataclasses.fields(section):
                choices = typing.get_args(_field_type(type(section), f.name))
                if typing.get_origin(_field_type(type(section), f.name)) is Literal:
                    value = getattr(section, f.name)
                    if value not in choices:
                        raise ValueError(f"--{f.name} must be one of {', '.join(map(str, choices))}; got {value!r}")
        names = self.flag_names()
        for name, minimum in _MINIMUMS.items():
            section = getattr(self, names[name]) if names[name] else self
            value = getattr(section, name)
            if value < minimum and value != _AUTO.get(name):
                auto = f" (or {_AUTO[name]}: auto)" if name in _AUTO else ""
                raise ValueError(f"--{name} must be >= {minimum}{auto}, got {value}")
        check_report_to(self.report_to)
        given = memory_levers_given(self.model) if self.model.memory == "auto" else []
        if given:  # before resolve_defaults: a lever left to auto (--activation_checkpointing) is not given
            raise ValueError(
                f"--memory auto chooses the memory levers itself, and {' and '.join(given)} "
                f"{'set levers' if len(given) > 1 else 'sets one'}: drop {'them' if len(given) > 1 else 'it'}, or "
                "give --memory manual to set the levers yourself"
            )
        if self.model.headroom >= 1:
            raise ValueError(f"--headroom is a fraction of --gpu_memory_gb in [0, 1), got {self.model.headroom}")
        self.resolve_defaults()
        if self.optim.min_lr_ratio > 1:
            raise ValueError(f"--min_lr_ratio is a fraction of --lr in [0, 1], got {self.optim.min_lr_ratio}")
        if self.data.passkey_warmup >= 1:
            raise ValueError(f"--passkey_warmup is a share of the steps in [0, 1), got {self.data.passkey_warmup}")
        if self.peft.quantization != "none" and not self.peft.use_peft:
            raise ValueError(
                f"--quantization {self.peft.quantization} freezes the base weights, so only LoRA adapters can "
                "train: add --use_peft, or drop --quantization for a full fine-tune"
            )
        if self.peft.quantization == "4bit":
            from llama_cp.modules.quantize import check_qlora_support

            check_qlora_support()
        self.peft.check()
        if self.merge_lora and not self.peft.use_peft:
            raise ValueError("--merge_lora merges LoRA adapters into the base model: add --use_peft (a full fine-tune's "
                             "final/ is the whole model already)")
        if self.merge_lora and self.peft.quantization != "none":
            raise ValueError("--merge_lora with --quantization 4bit: the base weights in training are NF4 codes; after "
                             "the run merge onto the original weights with python -m recipes.export --checkpoint "
                             "OUTPUT_DIR/final --merge_lora --output_dir DIR")
        if self.model.offload_params and (self.peft.quantization != "none" or self.optim.optimizer != "adamw"):
            raise ValueError(
                "--offload_params keeps the sharded state in host memory for torch's AdamW; it is not built for "
                f"--quantization {self.peft.quantization} (NF4 codes) or --optimizer {self.optim.optimizer}: drop one"
            )
        if self.model.offload_checkpoints and not self.model.activation_checkpointing:
            raise ValueError(
                "--offload_checkpoints moves the inputs that activation checkpointing keeps to host memory: "
                "add --activation_checkpointing (or drop --offload_checkpoints)"
            )
        if self.model.frozen_dtype == "bfloat16" and not self.peft.use_peft:
            raise ValueError(
                "--frozen_dtype bfloat16 stores the frozen LoRA base weights in bf16, but without --use_peft "
                "every weight is trained: add --use_peft or use --frozen_dtype auto"
            )
        # The world size is known here when this process was launched as one of several ranks (torchrun,
        # the launcher). WORLD_SIZE=1 says nothing: init_distributed sets it for a single process, and a
        # notebook that trained in-process may go on to build a config for launch(cfg, nprocs=N).
        world = int(os.environ.get("WORLD_SIZE", "1"))
        self.parallel.check(self.data.context_length, world if world > 1 else None)
        from llama_cp.modules.causal_lm import check_model_name, parse_rope_scaling

        check_model_name(self.model.model_name)
        if self.data.streaming and (self.data.dataset == PASSKEY or self.max_steps == 0):
            raise ValueError(
                "--streaming reads a file or hub --dataset of unknown length: give such a --dataset and --max_steps > 0"
            )
        parse_rope_scaling(self.model.rope_scaling)  # the form; what it reaches is checked with the model's config
        check_sources(parse_sources(self.data.dataset, "--dataset", self.data.dataset_columns))
        if self.data.eval_dataset:
            if self.data.dataset == PASSKEY:
                raise ValueError("--eval_dataset needs a file or hub --dataset: the passkey task makes its own eval rows")
            if PASSKEY in (source.path for source in parse_sources(self.data.eval_dataset, "--eval_dataset")):
                raise ValueError("--eval_dataset passkey: the passkey task evaluates itself with --dataset passkey; "
                                 "give a file or hub dataset")
            check_sources(parse_sources(self.data.eval_dataset, "--eval_dataset", self.data.dataset_columns))
        if self.eval_perplexity and self.data.dataset == PASSKEY:
            raise ValueError("--eval_perplexity measures the loss on natural text, and the passkey task is not: give a "
                             "file or hub --dataset, or drop --eval_perplexity (--eval_needle measures retrieval)")
        if self.eval_perplexity and self.data.streaming and not self.data.eval_dataset:
            raise ValueError("--eval_perplexity with --streaming reads whole eval documents, and a stream's are spread "
                             "over all of it: give --eval_dataset")
        if self.objective == "dpo":
            self._check_preference()
        if not 0 <= self.data.eval_fraction < 1:
            raise ValueError(f"--eval_fraction {self.data.eval_fraction}: give a share of the documents in [0, 1)")
        if self.data.chat_template and not Path(self.data.chat_template).expanduser().is_file():
            raise FileNotFoundError(f"--chat_template {self.data.chat_template!r}: no such file (a Jinja chat template, "
                                    "e.g. an instruct model's chat_template.jinja)")

    def _check_preference(self) -> None:
        """What --objective dpo cannot run with, each refused in one line."""
        if self.dpo_beta <= 0:
            raise ValueError(f"--dpo_beta must be > 0, got {self.dpo_beta}")
        if self.data.streaming:
            raise ValueError("--objective dpo packs each pair's two sequences whole into one prepared row, and "
                             "--streaming packs documents as they arrive: drop --streaming (recipes.prepare_data "
                             "prepares the pairs once)")
        if not self.data.document_mask:
            raise ValueError("--objective dpo packs a pair's chosen and rejected sequences as two documents of a row, "
                             "which must not see each other: drop --document_mask false")
        if self.eval_perplexity:
            raise ValueError("--eval_perplexity reads natural-text documents, and --objective dpo data is pairs: "
                             "drop --eval_perplexity")

    @classmethod
    def flag_docs(cls) -> list[tuple[str, Any, str]]:
        """``(flag, default, doc)`` of every flag, in declaration order; the doc is the string
        under the field in this file (what ``--help`` and docs/flags.md's table show)."""
        docs = {}
        for klass in (cls, *(f.default_factory for f in dataclasses.fields(cls) if f.name in cls.SECTIONS)):
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
            for node, after in zip(body, body[1:]):
                if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr):
                    docs[node.target.id] = after.value.value
        flat = cls.flatten(dataclasses.asdict(cls()))
        return [(name, flat[name], docs[name]) for name in cls.flag_names()]

    @classmethod
    def help(cls, defaults: dict[str, Any] | None = None) -> str:
        """The ``--help`` text: every flag with its default and doc; ``defaults`` are a
        command's own defaults where they differ from the trainer's (the planner's)."""
        lines = ["flags (--config preset.yaml first, then --flag value; flags override the preset):"]
        for name, default, doc in cls.flag_docs():
            default = (defaults or {}).get(name, default)
            shown = _shown(default)
            lines.append(f"  --{name} (default {shown}): {doc}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # Note [Defaults by run]
    # ~~~~~~~~~~~~~~~~~~~~~~~
    # The embedded model is a small Llama with random weights that the passkey demo trains from
    # scratch on a CPU in minutes: it wants a large learning rate (1e-3), a fixed number of steps
    # (200; an epoch of its 512 generated rows is another schedule) and nothing saved on the way.
    # A real checkpoint wants the opposite: a learning rate that does not wreck pretrained weights
    # (2e-5 for every weight, TRL's SFT default; 2e-4 for LoRA adapters, as peft's guides use),
    # whole epochs of the user's data unless --max_steps says otherwise (transformers' Trainer and
    # TRL), activation checkpointing (without it an 8B model's activations at 128K tokens do not
    # fit any GPU; it is exact, and costs a recompute of each layer's forward), and checkpoints
    # during the run so a failure hours in loses little. The flags that differ keep an "auto"
    # value (lr 0, max_steps -1, save_every -1, activation_checkpointing None), resolved here, at
    # start, from the model and the dataset; the resolved values are what config.yaml and
    # run_info.json record, and a flag given explicitly always wins. --save_every is resolved by
    # the trainer once the run's steps are known (resolved_save_every). --memory default is resolved
    # first, to auto when no memory lever is given and manual otherwise, while an
    # --activation_checkpointing left to auto is still None; on CUDA --memory auto then replaces the
    # levers by its choice before the model is built (Note [Choosing the memory levers] in
    # llama_cp/plan/auto.py), and the resolved checkpointing above is what a run it cannot plan keeps.

    def is_demo(self) -> bool:
        """The embedded passkey demo: --model_name and --dataset left at their defaults."""
        return self.model.model_name == "embedded" and self.data.dataset == PASSKEY

    def resolve_defaults(self) -> None:
        """Replace the auto values of --memory, --lr, --activation_checkpointing and --max_steps by this
        run's (Note [Defaults by run]); idempotent."""
        embedded = self.model.model_name == "embedded"
        if self.model.memory == "default":  # first, while an --activation_checkpointing left to auto still shows
            self.model.memory = "manual" if memory_levers_given(self.model) else "auto"
        if self.optim.lr == 0 and self.objective == "dpo":  # a preference loss moves a tuned model: smaller steps
            self.optim.lr = 1e-3 if embedded else 5e-6 if self.peft.use_peft else 1e-6
        if self.optim.lr == 0:
            self.optim.lr = 1e-3 if embedded else 2e-4 if self.peft.use_peft else 2e-5
        if self.model.activation_checkpointing is None:
            self.model.activation_checkpointing = not embedded
        if self.max_steps == -1:
            self.max_steps = 200 if self.is_demo() else 0

    def resolved_save_every(self, total_steps: int) -> int:
        """--save_every, auto resolved for a run of ``total_steps`` steps (Note [Defaults by run]):
        only at the end for the demo, else every tenth of the run, at most 500 steps apart."""
        if self.save_every != -1:
            return self.save_every
        return 0 if self.is_demo() else max(1, min(500, -(-total_steps // 10)))

    def passkey_key_digits(self) -> int:
        """--passkey_digits, auto resolved: 1 for the embedded model, else 5 (Note [Passkey length warm-up])."""
        if self.data.passkey_digits:
            return self.data.passkey_digits
        return 1 if self.model.model_name == "embedded" else 5


#: Lower bounds of the numeric flags, checked before anything is built.
_MINIMUMS = {
    "context_length": 1, "batch_size": 1, "gradient_accumulation_steps": 1, "loss_chunk_size": 0, "cp": 1,
    "mlp_tile_size": 0, "norm_tile_size": 0, "attention_block_size": 0, "gpu_memory_gb": 0.0, "headroom": 0.0,
    "dp_replicate": 1, "lora_r": 1, "num_proc": 1, "num_passkey_samples": 1, "passkey_digits": 0, "passkey_warmup": 0.0, "num_eval_samples": 1, "num_epochs": 1,
    "max_steps": 0, "warmup_steps": 0, "save_every": 0, "eval_every": 0, "keep_last": 1, "log_every": 1,
    "max_nonfinite_steps": 1, "peak_tflops": 0.0,
    "collective_timeout": 1.0, "rope_theta": 0.0, "min_lr_ratio": 0.0, "lr": 0.0, "weight_decay": 0.0, "max_grad_norm": 0.0, "lora_dropout": 0.0,
}


#: Flags whose value below the minimum means "auto" (Note [Defaults by run]).
_AUTO = {"max_steps": -1, "save_every": -1}


def _field_type(cls: type, name: str):
    return typing.get_type_hints(cls)[name]


def _coerce(cls: type, name: str, value: Any) -> Any:
    """Convert a flag value (fire may hand over str, int, tuple) to the field's type."""
    kind = _field_type(cls, name)
    origin = typing.get_origin(kind)
    try:
        if kind == bool | None:  # a switch with an auto setting (None): --activation_checkpointing auto
            if value is None or (isinstance(value, str) and value.lower() == "auto"):
                return None
            kind = bool
        if kind is bool:
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(value)
                return value.lower() in ("true", "1", "yes")
            return bool(value)
        if kind is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if kind is float:
            return float(value)
        if origin is tuple:
            items = value.split(",") if isinstance(value, str) else list(value)
            return tuple(str(item).strip() for item in items if str(item).strip())
        if kind is str and isinstance(value, (tuple, list)):  # fire reads --dataset a.jsonl,b.jsonl as a tuple
            return ",".join(str(item) for item in value)
        if kind is str and isinstance(value, dict):  # a YAML mapping or fire's parse of a JSON object
            return json.dumps(value)
        if kind is str or origin is Literal:
            if isinstance(value, bool):  # --resume / --resume true / YAML `resume: true`
                return "true" if value else "false"
            value = str(value)
            choices = typing.get_args(kind)
            return value.lower() if value not in choices and value.lower() in choices else value
    except (TypeError, ValueError):
        raise ValueError(f"--{name} expects {getattr(kind, '__name__', kind)}, got {value!r}") from None
    return value


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


#: The memory levers (ModelConfig's flags that change a step's memory, not its math), whichever of
#: them a user gives making --memory default manual; --memory auto chooses them (llama_cp/plan/auto.py).
MEMORY_LEVERS = ("activation_checkpointing", "activation_offload", "offload_params", "offload_checkpoints",
                 "mlp_tile_size", "norm_tile_size", "attention_block_size", "frozen_dtype")


def memory_levers_given(model: ModelConfig) -> list[str]:
    """The memory levers of ``model`` set away from their defaults, as flags (``--mlp_tile_size 4096``);
    --activation_checkpointing counts while not yet resolved from auto (None), so call it before
    ``TrainConfig.resolve_defaults``."""
    defaults = ModelConfig()
    given = []
    for name in MEMORY_LEVERS:
        value = getattr(model, name)
        if value != getattr(defaults, name):
            given.append(f"--{name} {str(value).lower() if isinstance(value, bool) else value}")
    return given


def check_all_linear(targets) -> None:
    """One line unless ``all-linear`` in --lora_target_modules stands alone (peft takes it as a
    keyword only in place of the list)."""
    if ALL_LINEAR in targets and len(targets) > 1:
        raise ValueError(f"--lora_target_modules {','.join(targets)}: {ALL_LINEAR} already names every Linear layer "
                         f"but the output layer; give {ALL_LINEAR} alone, or a list of names")



def _shown(default: Any) -> str:
    """A default as --help and docs/flags.md show it: a tuple comma-separated, None (a switch left
    to the run) as auto."""
    if isinstance(default, tuple):
        return ",".join(default)
    return "auto" if default is None else str(default)


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def flag_table() -> str:
    """The markdown table of every flag, docs/flags.md's: ``python -c "from llama_cp.config import
    flag_table; print(flag_table())"``."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for name, default, doc in TrainConfig.flag_docs():
        shown = _shown(default)
        rows.append(f"| `--{name}` | `{shown}` | {doc} |")
    return "\n".join(rows)

