"""One place builds the model a run trains: the trainer, the memory planner, the tests and
the benchmarks all come here.

    path = model_path(cfg.model.model_name)          # None for the embedded model
    model = build_model(cfg, mesh, device, path)     # built, parallelized, weights loaded

:func:`build_model` builds an HF causal LM in float32 (on the meta device for a real
checkpoint, so no rank ever holds all of it), applies :func:`parallelize_model` (the
order of every wrapper: 4-bit base, LoRA, frozen dtype, CP attention, chunked loss,
tiling, FSDP2 with checkpointing) and loads the checkpoint's shards. The planner runs
:func:`parallelize_model` on a meta model too, with ``device_type="cuda"``.
"""

from __future__ import annotations

import math
import os
import warnings

import torch
import torch.distributed as dist
from torch import nn

from llama_cp.attention.choose import choose_strategy
from llama_cp.attention.kernels import check_backend
from llama_cp.config import ALL_LINEAR, PASSKEY, TrainConfig, check_all_linear
from llama_cp.cp_attention import apply_context_parallel
from llama_cp.fsdp_wrap import cast_frozen_parameters, load_full_weights, restore_buffers, shard_model
from llama_cp.model.loss import enable_chunked_loss
from llama_cp.modules.experts import apply_expert_gradients
from llama_cp.modules.checkpoints import checkpoint_config, vision_language_line
from llama_cp.modules.families import check_family, set_router_loss_coef
from llama_cp.modules.layers import attention_head_dims, attention_heads
from llama_cp.modules.gguf import gguf_model_dir, gguf_path
from llama_cp.modules.causal_lm import (
    apply_rope_settings, base_causal_lm, build_causal_lm, compute_dtype, decoder_layers, embedded_llama_config,
)
from llama_cp.modules.compiled import compile_per_token_modules, compiled_summary
from llama_cp.modules.quantize import quiet_bitsandbytes
from llama_cp.modules.tiling import apply_tiled_mlp, apply_tiled_norms, copied_norms

quiet_bitsandbytes()  # before peft imports bitsandbytes (Note [bitsandbytes' CPU kernel warning])


def build_model(cfg: TrainConfig, mesh, device: torch.device, path: str | None) -> nn.Module:
    """The model of ``cfg`` on ``mesh``: the embedded Llama (``path`` None; small, built on every
    rank, identical there thanks to the seed) or the HF checkpoint directory ``path`` (built on
    the meta device, sharded, then loaded: rank 0 reads the files, every rank gets its shards),
    its config first given ``--rope_theta`` / ``--rope_scaling`` (``apply_rope_settings``)."""
    from transformers import AutoConfig

    torch.manual_seed(cfg.seed)
    config = embedded_llama_config() if path is None else AutoConfig.from_pretrained(path)
    if path is not None:
        line = vision_language_line(config, path)
        config = checkpoint_config(path, config)  # Note [The text model of a vision-language checkpoint]
        check_family(config)  # refused before anything is built
        if line and (not dist.is_initialized() or dist.get_rank() == 0):
            print(line, flush=True)
    load_kwargs = mxfp4_load_kwargs(config)
    if load_kwargs:  # Note [MXFP4 checkpoints]
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(MXFP4_LINE, flush=True)
        del config.quantization_config  # the model built, trained and saved is an ordinary one
    apply_rope_settings(config, cfg.model.rope_theta, cfg.model.rope_scaling, cfg.data.context_length)
    set_router_loss_coef(config, cfg.model.router_aux_loss_coef)
    check_attention_backend(cfg, config, device.type)
    offload = cfg.model.offload_params  # the shards stay in host memory: built there (fully_shard requires it)
    if path is None:
        model = build_causal_lm(config).to("cpu" if offload else device)
    else:
        model = build_causal_lm(config, device="meta")
    model = parallelize_model(model, cfg, mesh, device_type=device.type)
    if cfg.model.compile and (not dist.is_initialized() or dist.get_rank() == 0):
        print(compiled_summary(model, decoder_layers(model)), flush=True)
    if path is not None:
        load_full_weights(model, path, device=device, params_on_cpu=offload, load_kwargs=load_kwargs)
    elif offload:
        restore_buffers(model, device)  # buffers are not offloaded: the RoPE tables compute on the device
    return model


def parallelize_model(
    model: nn.Module, cfg: TrainConfig, mesh, *, device_type: str | None = None, attention_backend: str | None = None
) -> nn.Module:
    """Turn an HF causal LM (real or on the meta device) into the model the trainer runs, in
    this order: the base Linear layers in 4-bit NF4 (``--quantization 4bit``) -> LoRA adapters
    (peft, with ``--use_peft``) -> frozen weights in their storage dtype (``--frozen_dtype``)
    -> context-parallel attention over ``mesh["cp"]`` (kernel calls of ``--attention_block_size``
    tokens) -> the chunked loss path -> compiled norms, MLPs and attention layers (``--compile``) ->
    tiled MLPs and norms (``--mlp_tile_size``, ``--norm_tile_size``) -> a gradient for every MoE expert
    on every rank (``llama_cp.modules.experts``) -> FSDP2 over ``dp_shard x cp`` (with
    activation checkpointing, and its inputs offloaded with ``--offload_checkpoints``).
    The compute dtype is ``--dtype`` on ``device_type`` (default: the mesh's; the planner
    passes "cuda"): :func:`llama_cp.modules.causal_lm.compute_dtype`. ``attention_backend``: the attention
    kernels' backend instead of ``--attention_backend`` (the planner passes a modelled CUDA
    backend, ``llama_cp.attention.workspace.ModelledBackend``). Returns the (possibly
    peft-wrapped) model."""
    if cfg.peft.quantization == "4bit":
        from llama_cp.modules.quantize import quantize_model

        quantize_model(model)  # a meta model gets the shapes; load_full_weights quantizes the checkpoint
    param_dtype = compute_dtype(cfg.model.dtype, device_type or mesh.device_type)
    if cfg.peft.use_peft:
        from peft import get_peft_model

        check_lora_targets(model, cfg.peft.lora_target_modules, cfg.peft.lora_target_parameters)
        check_modules_to_save(model, cfg.peft.lora_modules_to_save)
        with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            model = get_peft_model(model, lora_config(cfg))
        copied = copied_norms(model)
        if cfg.model.norm_tile_size and copied:  # llama_cp.modules.tiling.norm_modules finds norms by class
            raise ValueError(f"--norm_tile_size with --lora_modules_to_save {','.join(cfg.peft.lora_modules_to_save)}: "
                             f"the {type(copied[0].original_module).__name__}s are then peft's wrappers around "
                             "trainable copies, which the tiling does not reach; drop --norm_tile_size or leave the "
                             "norms out")
    frozen_dtype = resolve_frozen_dtype(cfg, param_dtype)
    if frozen_dtype is not None and cast_frozen_parameters(model, frozen_dtype) and param_dtype is None:
        param_dtype = torch.float32  # compute in the trainable dtype: frozen weights are cast when gathered
    backend = attention_backend or cfg.model.attention_backend
    strategy, ulysses_degree = cp_strategy(cfg, model.config)
    apply_context_parallel(
        model, mesh["cp"], strategy=strategy, max_seq_len=cfg.data.context_length,
        document_mask=cfg.data.document_mask, backend=None if backend == "auto" else backend,
        block_size=cfg.model.attention_block_size, ulysses_degree=ulysses_degree,
    )
    enable_chunked_loss(model, chunk_size=cfg.model.loss_chunk_size)
    if cfg.model.compile:  # before tiling: the tiles run the compiled forward
        compile_per_token_modules(model, decoder_layers(model))
    if cfg.model.mlp_tile_size:
        apply_tiled_mlp(decoder_layers(model), cfg.model.mlp_tile_size)
    if cfg.model.norm_tile_size:
        apply_tiled_norms(model, decoder_layers(model), cfg.model.norm_tile_size)
    apply_expert_gradients(model)  # experts as separate modules (transformers 4.x): Note [An expert no token picked]
    shard_model(
        model, mesh, param_dtype=param_dtype, activation_checkpointing=cfg.model.activation_checkpointing,
        offload_checkpoints=cfg.model.offload_checkpoints, cpu_offload=cfg.model.offload_params,
    )
    return model


# Note [MXFP4 checkpoints]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# gpt-oss checkpoints hold their experts' weights in MXFP4: ``*_blocks`` (two FP4 values a byte) and
# ``*_scales`` (a power-of-two exponent per 32 values), config.quantization_config.quant_method
# "mxfp4". Training needs ordinary parameters. transformers (5.24; 4.56.2 in bfloat16) dequantizes
# them as it loads with ``Mxfp4Config(dequantize=True)`` (quantizers/quantizer_mxfp4.py: no triton
# kernels then; integrations/mxfp4.py ``Mxfp4Dequantize``: FP4 value x 2^(scale - 127), exact in
# bfloat16 and float32), and without triton >= 3.5 or the kernels package it does so by itself with
# a warning. llama-cp asks for it (``mxfp4_load_kwargs``: rank 0 reads the checkpoint through
# transformers, ``fsdp_wrap.load_full_weights(load_kwargs=)``), says so in one line, drops
# quantization_config from the config it builds from, and trains (and saves) the dequantized weights.
#: What a run prints when its checkpoint is MXFP4.
MXFP4_LINE = ("model: the checkpoint's experts are MXFP4 (quantization_config quant_method mxfp4): loaded "
              "dequantized (transformers' Mxfp4Config(dequantize=True)) and trained, and saved, unquantized")


def mxfp4_load_kwargs(config) -> dict:
    """transformers' ``from_pretrained`` kwargs that load ``config``'s checkpoint dequantized when it is
    MXFP4 (Note [MXFP4 checkpoints]); {} for any other."""
    quantization = getattr(config, "quantization_config", None)
    method = (quantization.get("quant_method") if isinstance(quantization, dict)
              else getattr(quantization, "quant_method", None))
    if str(getattr(method, "value", method)) != "mxfp4":
        return {}
    from transformers import Mxfp4Config

    return {"quantization_config": Mxfp4Config(dequantize=True)}


def peft_supports_target_parameters() -> bool:
    """Whether the installed peft adapts parameters outside Linear layers (LoraConfig's
    target_parameters, peft >= 0.17)."""
    from peft import LoraConfig

    return "target_parameters" in LoraConfig.__dataclass_fields__


def check_lora_targets(model: nn.Module, targets, parameters=()) -> None:
    """One line naming --lora_target_modules unless every name is a Linear layer of ``model`` (peft
    adapts the names it finds and ignores the others: Phi-3's fused qkv_proj would get no adapter
    from the default q_proj, k_proj, v_proj) or it is ``all-linear`` alone, and
    --lora_target_parameters unless each names a parameter outside the Linear layers (the fused
    experts of an MoE: mlp.experts.gate_up_proj)."""
    if parameters and not peft_supports_target_parameters():
        import peft

        raise ValueError(f"--lora_target_parameters needs peft >= 0.17 (installed: {peft.__version__}), whose LoraConfig "
                         "has target_parameters: upgrade peft, or drop --lora_target_parameters")
    check_all_linear(targets)
    linears = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                      if isinstance(module, nn.Linear) and name})
    missing = [name for name in targets if name not in linears and name != ALL_LINEAR]
    if missing:
        raise ValueError(f"--lora_target_modules: {', '.join(missing)} not in {type(model).__name__}; its linear "
                         f"layers are {', '.join(linears)}")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    heads = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if module is head and name}
    adapted = [name for name in targets if name in heads]
    if adapted:  # peft's lora.Linear would add its update to the loss the chunked head returns
        raise ValueError(f"--lora_target_modules: {adapted[0]} is the output layer, which computes the chunked loss "
                         f"without building the logits and takes no LoRA adapter; train it whole with "
                         f"--lora_modules_to_save {adapted[0]}, or leave it out")
    in_linears = {f"{name}.{p}" for name, module in model.named_modules() if isinstance(module, nn.Linear)
                  for p, _ in module.named_parameters(recurse=False)}
    others = [name for name, _ in model.named_parameters() if name not in in_linears]
    missing = [target for target in parameters if not any(name == target or name.endswith("." + target)
                                                          for name in others)]
    if missing:
        layer_0 = sorted({name.split(".layers.0.", 1)[1] for name in others if ".layers.0." in name})
        raise ValueError(f"--lora_target_parameters: {', '.join(missing)} not in {type(model).__name__}; the "
                         f"parameters of its first layer outside Linear layers are {', '.join(layer_0) or 'none'}")


def check_modules_to_save(model: nn.Module, names) -> None:
    """One line naming --lora_modules_to_save unless every name ends the name of a module of
    ``model`` (how peft matches them: ``norm`` is every norm layer, input_layernorm and the final
    norm alike), none of them holds 4-bit codes (``--quantization 4bit``), and none holds the
    input embedding of a model whose lm_head shares it (Note [Trainable copies of tied embeddings])."""
    modules = dict(model.named_modules())
    missing = [name for name in names if not any(key.endswith(name) for key in modules if key)]
    if missing:
        children = sorted({key.rsplit(".", 1)[-1] for key in modules if key and not key.rsplit(".", 1)[-1].isdigit()})
        raise ValueError(f"--lora_modules_to_save: no module of {type(model).__name__} is named {', '.join(missing)} "
                         f"(or ends so); its modules are {', '.join(children)}")
    codes = sorted({name for name in names for key, module in modules.items()
                    if key.endswith(name) and any(not p.is_floating_point() for p in module.parameters())})
    if codes:  # --quantization 4bit: NF4Linear's packed codes cannot require a gradient
        raise ValueError(f"--lora_modules_to_save {','.join(codes)}: its Linear layers hold 4-bit codes under "
                         "--quantization 4bit, which cannot train; leave the decoder's Linear layers out (embed_tokens, "
                         "the norms and lm_head stay in full precision)")
    base = base_causal_lm(model)
    output, embedding = base.get_output_embeddings(), base.get_input_embeddings()
    if output is None or output.weight is not embedding.weight:
        return
    tied = [name for name in names for key, module in modules.items()
            if key.endswith(name) and any(p is embedding.weight for p in module.parameters())]
    if tied:
        raise ValueError(f"--lora_modules_to_save {','.join(sorted(set(tied)))}: {type(base).__name__} ties lm_head to "
                         "embed_tokens (tie_word_embeddings); a trainable copy of one unties them, and FSDP2 would find "
                         "their shared tensor in two groups (Note [Trainable copies of tied embeddings]); leave "
                         "embed_tokens and lm_head out of --lora_modules_to_save (the norms may stay)")


# Note [Trainable copies of tied embeddings]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# peft's modules_to_save wraps a module and trains a copy of it; the original stays, frozen, beside
# it. In a model with tie_word_embeddings, embed_tokens.weight *is* lm_head.weight. A copy of
# embed_tokens (or of lm_head) leaves the other one on the original tensor: the input embedding
# trains while the output one stays frozen (peft warns that the adapters are then untied). Under
# FSDP2 it is worse than a change of model: llama_cp.fsdp_wrap.apply_fsdp keeps a tied lm_head in
# the root group *because* it is the embedding's tensor, and it tells so by comparing the weights
# of get_input_embeddings() and get_output_embeddings(); the wrapper answers with its copy's weight,
# so lm_head goes into the [norm, lm_head] group while the original embedding tensor (the same
# Parameter) is in the root group, and the first forward stops in FSDP2's lazy init ("Parameter
# 'base_model.model.lm_head.weight' is shared with a parameter already managed by another FSDP
# group", torch 2.13). So such a copy is refused before peft wraps the model.



def lora_targets(model: nn.Module, targets) -> tuple[str, ...]:
    """The names of the layers ``targets`` (--lora_target_modules) adapts in ``model``: themselves,
    or for ``all-linear`` the last part of the name of every Linear layer but the output layer, as
    peft picks them (``_maybe_include_all_linear_layers``)."""
    if ALL_LINEAR not in targets:
        return tuple(targets)
    output = base_causal_lm(model).get_output_embeddings()
    return tuple(sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                         if isinstance(module, nn.Linear) and name and module is not output}))


# Note [peft's MoE target conversion]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Under transformers 5, peft 0.21 rewrites the LoRA targets of the MoE families whose experts
# transformers 5 fused (read in peft 0.21.2, utils/transformers_weight_conversion.py,
# _convert_peft_config_moe, run by get_peft_model; the families are transformers' conversion patterns
# qwen2_moe and mixtral: DeepSeek-V2/V3, GLM-4.5 and 4.7-Flash, Qwen2/3-MoE, OLMoE, dots.llm1, ERNIE 4.5,
# EXAONE-MoE, AFMoE, Hunyuan-MoE, Mixtral, MiniMax-M2), so that adapters trained under transformers 4,
# where each expert was Linear layers, still load: a target named gate_proj, up_proj or down_proj (w1,
# w3, w2) becomes the experts' fused parameter gate_up_proj or down_proj, and gate the router's
# gate.weight, after "all-linear" is expanded. The Linear layers of those names outside the experts, the
# MLPs of the dense layers and the shared experts, are then no target: no name reaches them. llama-cp
# says so at start (:func:`lora_target_changes`) and refuses --merge_lora there (adapters on fused
# expert tensors are not merged here) before training, not at the export after it. The MFU counts the
# adapters of the Linear layers that have one (:func:`adapted_linears`); the experts' adapters, as
# with --lora_target_parameters, it does not count (Note [Model FLOPs]).
def lora_target_changes(model: nn.Module, targets, parameters=()) -> str | None:
    """One line saying what peft adapted besides --lora_target_modules / --lora_target_parameters, and
    which Linear layers they name got no adapter (Note [peft's MoE target conversion]); None when
    peft adapted what the flags name."""
    import peft

    config = next(iter(model.peft_config.values()))
    added = sorted(set(getattr(config, "target_parameters", None) or ()) - set(parameters))
    if not added:
        return None
    causal_lm = base_causal_lm(model)
    output = causal_lm.get_output_embeddings()
    # the Linear layers peft left as they were: not an adapted layer's base_layer, nor its lora_A/lora_B
    bare = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)
            and module is not output and ".lora_" not in name and not name.endswith(".base_layer")
            and ".modules_to_save." not in name and not name.endswith(".original_module")}
    bare = sorted(bare if ALL_LINEAR in targets else bare & set(targets))

    family = causal_lm.config.model_type
    missed = (f"; the Linear layers {', '.join(bare)} (the dense layers' MLPs, shared experts) get none, as no "
              "target reaches them there" if bare else "")
    parts = [part for part, names in (("fused experts", ("gate_up_proj", "down_proj")), ("router", ("gate.weight",)))
             if any(name in added for name in names)]
    return (f"--lora_target_modules {','.join(targets)}: peft {peft.__version__} adapts {family}'s "
            f"{' and '.join(parts) or 'parameters'} by the names of transformers 4 (target parameters "
            f"{', '.join(added)}){missed} (Note [peft's MoE target conversion] in llama_cp/model/build.py)")


def adapted_linears(model: nn.Module) -> tuple[str, ...]:
    """The last name part of every Linear layer of a peft ``model`` that has a LoRA adapter: the layers
    whose adapters the MFU counts (Note [peft's MoE target conversion]: not always the flag's names)."""
    from peft.tuners.lora import LoraLayer

    return tuple(sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                         if isinstance(module, LoraLayer) and isinstance(module.get_base_layer(), nn.Linear)}))


def cp_strategy(cfg: TrainConfig, config) -> tuple[str, int]:
    """(strategy, ulysses_degree) of a run: --cp_strategy and --ulysses_degree, or what ``auto``
    picks for ``config``'s heads (Note [Choosing a strategy] in ``llama_cp/attention/choose.py``)."""
    p = cfg.parallel
    if p.cp_strategy != "auto":
        return p.cp_strategy, p.ulysses_degree
    packed = cfg.data.document_mask and cfg.data.dataset != PASSKEY  # files and hub datasets are packed
    return choose_strategy(attention_heads(config)[0], p.cp, packed)


def check_strategy_heads(cfg: TrainConfig, config) -> None:
    """Refuse Ulysses where the model's query heads do not split over --cp, before anything is
    built: one line with the head count and the strategies that work."""
    strategy, _ = cp_strategy(cfg, config)
    (heads, heads_name), cp = attention_heads(config), cfg.parallel.cp
    if strategy == "ulysses" and heads % cp:
        common = math.gcd(heads, cp)  # hybrid's largest degree; 1 would be the ring alone
        hybrid = f", or --cp_strategy hybrid --ulysses_degree {common} (Ulysses over {common} ranks, the ring across " \
                 "them)" if common > 1 else ""
        raise ValueError(
            f"--cp_strategy ulysses at --cp {cp}: this model's attention heads, {heads_name}, do not split over "
            f"{cp} ranks; use --cp_strategy ring or allgather (any head count){hybrid}"
        )


def check_attention_backend(cfg: TrainConfig, config, device_type: str) -> None:
    """Refuse an explicit ``--attention_backend`` that cannot run on this machine, before anything
    is built: one line naming the cause and the backends that would run."""
    if cfg.model.attention_backend == "auto":
        return
    dtype = compute_dtype(cfg.model.dtype, device_type) or torch.float32
    backend = cfg.model.attention_backend
    for head_dim in attention_head_dims(config):  # DeepSeek's latent attention: not its config's head_dim
        check_backend(backend, device_type, dtype, head_dim, name=f"--attention_backend {backend}")


def resolve_frozen_dtype(cfg: TrainConfig, compute: torch.dtype | None) -> torch.dtype | None:
    """The storage dtype of frozen weights (``--frozen_dtype``), None to keep float32: "auto" is
    bfloat16 for LoRA when the compute dtype is bf16."""
    choice = cfg.model.frozen_dtype
    if choice == "auto":
        return torch.bfloat16 if cfg.peft.use_peft and compute == torch.bfloat16 else None
    return {"float32": None, "bfloat16": torch.bfloat16}[choice]


#: What a hub snapshot of a model fetches: weights, configs, and every tokenizer file (a chat
#: template saved apart, as transformers writes it, is chat_template.jinja; tiktoken vocabularies).
HUB_MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
#: Not fetched: Mistral's repositories ship their weights a second time in their own layout and names.
HUB_SKIPPED_FILES = ["consolidated*"]


def model_path(name: str) -> str | None:
    """The local directory of ``--model_name`` (None for "embedded"): the directory itself, the
    converted directory of a GGUF file (``llama_cp.modules.gguf``), or the hub snapshot of a hub
    id (downloaded when online, else from the local cache)."""
    if name == "embedded":
        return None
    gguf_file = gguf_path(name)
    if gguf_file is not None:
        return gguf_model_dir(gguf_file)  # converted once, then read from the cache (Note [GGUF in])
    if os.path.isdir(os.path.expanduser(name)):
        return os.path.expanduser(name)
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name, allow_patterns=HUB_MODEL_FILES, ignore_patterns=HUB_SKIPPED_FILES)
    except Exception as error:  # noqa: BLE001 - offline, unknown id, gated repo: one message for all
        raise FileNotFoundError(
            f"--model_name {name!r} is not a local directory, and as a hub id it could not be fetched "
            f"({type(error).__name__}: {' '.join(str(error).split())[:300]}); pass the path of a local HF "
            "model directory"
        ) from error


def lora_config(cfg: TrainConfig):
    """peft's LoraConfig of the run's LoRA flags (--lora_r, --lora_alpha, --lora_dropout,
    --lora_target_modules, --lora_target_parameters, --lora_modules_to_save, --use_rslora,
    --use_dora)."""
    from peft import LoraConfig

    p = cfg.peft
    parameters = {"target_parameters": list(p.lora_target_parameters)} if p.lora_target_parameters else {}
    targets = ALL_LINEAR if ALL_LINEAR in p.lora_target_modules else list(p.lora_target_modules)
    return LoraConfig(r=p.lora_r, lora_alpha=p.lora_alpha, lora_dropout=p.lora_dropout, target_modules=targets,
                      modules_to_save=list(p.lora_modules_to_save) or None, use_rslora=p.use_rslora,
                      use_dora=p.use_dora, task_type="CAUSAL_LM", **parameters)
