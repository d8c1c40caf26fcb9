"""FSDP2 over the ``dp_shard x cp`` mesh: parameters, gradients and optimizer state
sharded over ``dp_shard_cp`` while the sequence is sharded over ``cp``.

Gradient semantics: FSDP here **sums** gradients over ``dp_shard_cp`` (and over
``dp_replicate`` with HSDP) instead of averaging them. A rank that backpropagates
``sum(CE of its local tokens) / (valid tokens of the whole step)`` (see
``llama_cp.model.loss``) therefore ends with exactly the single-process gradient of
the mean loss, for any split of the tokens over dp and cp ranks.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from llama_cp.modules.altup import clamp_sharded_altup
from llama_cp.modules.causal_lm import base_causal_lm, compute_dtype, decoder_layers
from llama_cp.modules.checkpoints import safetensors_files, text_model_tensors
from llama_cp.modules.quantize import quantize_checkpoint, quantized_linears
from llama_cp.parallel.mesh import submesh


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP shards over: ``dp_shard_cp``, or (``dp_replicate``, ``dp_shard_cp``) for HSDP."""
    if mesh.ndim == 1:
        return mesh
    if mesh["dp_replicate"].size() > 1:
        return submesh(mesh, "dp_replicate", "dp_shard_cp")
    return submesh(mesh, "dp_shard_cp")


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer's activations in backward (non-reentrant checkpointing).

    Uses HF's per-layer checkpointing (``GradientCheckpointingLayer``) so parameter
    names, and with them checkpoints and exports, stay unchanged.
    """
    base = base_causal_lm(model)
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.x name
        base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # transformers also makes the embedding output require grad, which only reentrant
    # checkpointing needs; with frozen embeddings (LoRA) that output becomes a leaf that
    # autograd keeps on the device through the whole backward, and fills a gradient for
    if hasattr(base, "disable_input_require_grads"):
        try:
            base.disable_input_require_grads()
        except AttributeError:  # transformers 4.x adds the hook only with its own peft integration
            pass


def apply_checkpoint_offload(model: nn.Module):
    """Keep the input each checkpointed decoder layer saves in host memory until its recompute
    (Note [Offloading checkpoint inputs] in ``llama_cp.modules.offload``). Call after
    :func:`apply_activation_checkpointing`. Returns the :class:`CheckpointOffloader`, also
    kept as ``model.checkpoint_offloader`` (its ``peak_host_bytes`` is the host memory used)."""
    from llama_cp.modules.offload import CheckpointOffloader

    offloader = CheckpointOffloader()
    layers = [layer for layer in decoder_layers(model) if getattr(layer, "gradient_checkpointing", False)]
    if not layers:
        raise ValueError("--offload_checkpoints needs --activation_checkpointing: no decoder layer is checkpointed")
    for layer in layers:
        # transformers' checkpointing layers call this attribute with (forward, *positional tensors)
        checkpoint = layer._gradient_checkpointing_func

        def offloaded(function, *args, _checkpoint=checkpoint, **kwargs):
            with torch.autograd.graph.saved_tensors_hooks(offloader.pack, offloader.unpack):
                return _checkpoint(function, *args, **kwargs)

        layer._gradient_checkpointing_func = offloaded
    model.checkpoint_offloader = offloader
    return offloader


def cast_frozen_parameters(model: nn.Module, dtype: torch.dtype) -> int:
    """Store every frozen (requires_grad=False) floating-point parameter in ``dtype``, before
    ``fully_shard``; trainable parameters keep their dtype. Returns how many were cast.

    FSDP2 requires one dtype only among a group's *trainable* parameters; frozen ones of
    another dtype are gathered like the rest (cast to the compute dtype first when it is
    set, else as bytes)."""
    cast = 0
    for param in model.parameters():  # tied parameters are visited once
        if not param.requires_grad and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
            cast += 1
    return cast


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
) -> None:
    """``fully_shard`` each decoder layer, then [final norm, lm_head], then the root (and Gemma 3n's AltUp
    clamp on the shards: Note [AltUp's clamp under FSDP2] in llama_cp/modules/altup.py)."""
    shard_mesh = fsdp_mesh(mesh)
    # On a CPU mesh the policy's copies are to the same device (the tests' case); pinning needs an accelerator.
    pinned = shard_mesh.device_type != "cpu"
    options = dict(
        mesh=shard_mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        offload_policy=CPUOffloadPolicy(pin_memory=pinned) if cpu_offload else OffloadPolicy(),
    )
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **options)
    base = base_causal_lm(model)
    head = [base.get_output_embeddings()]
    norm = getattr(base.get_decoder(), "norm", None)
    if norm is not None:
        head.insert(0, norm)
    if base.get_output_embeddings().weight is base.get_input_embeddings().weight:
        head = head[:-1]  # tied lm_head: it stays with the embedding, in the root group
    if head:
        # backward starts with this group right after forward: keep it gathered in between
        fully_shard(head, reshard_after_forward=False, **options)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **options)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # sum, not average, over dp_shard_cp (see the module docstring); sum-only
            # collectives also keep gloo working (it has no pre-multiplied sum)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    clamp_sharded_altup(model)  # Note [AltUp's clamp under FSDP2]


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None | Literal["auto"] = "auto",
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
    activation_checkpointing: bool = False,
    offload_checkpoints: bool = False,
    cpu_offload: bool = False,
) -> nn.Module:
    """Shard ``model`` with FSDP2 over ``mesh`` (from ``ParallelDims.build_mesh``).

    ``param_dtype``: compute dtype of the gathered parameters; ``"auto"`` is
    bf16 on CUDA and the stored dtype (fp32) on CPU; None keeps the stored
    dtype. ``reduce_dtype``: dtype of the
    gradient reduce-scatter. ``cpu_offload``: keep the sharded parameters,
    gradients and optimizer state in CPU memory. ``offload_checkpoints``: keep the
    checkpointed layer inputs in host memory (:func:`apply_checkpoint_offload`). Returns
    the same module.
    """
    param_dtype = compute_dtype(param_dtype, fsdp_mesh(mesh).device_type)
    # 1. LoRA: inject adapters with peft *before* this call; the frozen base weights
    #    are sharded like everything else and simply get no gradient.
    # 2. Activation checkpointing per decoder layer.
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if offload_checkpoints:
        apply_checkpoint_offload(model)
    # 3. fully_shard: decoder layers -> [norm, lm_head] -> root.
    apply_fsdp(
        model, mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
        reshard_after_forward=reshard_after_forward, cpu_offload=cpu_offload,
    )
    return model


def activation_offload(enabled: bool) -> contextlib.AbstractContextManager:
    """Context for forward+backward that keeps saved activations in (pinned) CPU memory."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())


# ---------------------------------------------------------------- weights in and out
def restore_buffers(model: nn.Module, device: torch.device) -> None:
    """Put the buffers no checkpoint holds back on ``device`` after ``to_empty`` (or, for a model
    whose parameters live in host memory, move them there): the values ``build_causal_lm`` kept
    (Note [Buffers no checkpoint holds] in llama_cp/modules/causal_lm.py). A module made after the
    build (peft's copy of a ``modules_to_save`` layer) takes the values of a built module of its class;
    a RoPE module of a model built elsewhere is rebuilt from its config; any other such buffer is refused."""
    built = getattr(base_causal_lm(model), "_built_buffers", [])
    restored = set()
    for module, name, value in built:
        module.register_buffer(name, value.to(device), persistent=False)
        restored.add(id(module))
    for module in model.modules():
        names = sorted(module._non_persistent_buffers_set & dict(module.named_buffers(recurse=False)).keys())
        if not names or id(module) in restored:
            continue
        twin = next((m for m, _, _ in built if type(m) is type(module)), None)
        if twin is not None:
            for name in names:
                module.register_buffer(name, getattr(twin, name).to(device), persistent=False)
        elif any(name.endswith("inv_freq") for name in names):
            with torch.device(device):
                fresh = type(module)(module.config)
            for name, buffer in fresh.named_buffers(recurse=False):
                module.register_buffer(name, buffer, persistent=name not in fresh._non_persistent_buffers_set)
            if hasattr(fresh, "attention_scaling"):
                module.attention_scaling = fresh.attention_scaling
        else:
            raise ValueError(f"{type(module).__name__} has buffers no checkpoint holds ({', '.join(names)}) and the "
                             "model was not built by llama_cp.modules.causal_lm.build_causal_lm, which keeps them: "
                             "build it there")


def _read_safetensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = safetensors_files(path)
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path!r}; save the model with save_pretrained")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(os.path.join(path, name)))
    return state


def _read_checkpoint(path: str, config, load_kwargs: dict | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by the names of the model transformers builds. Most families store
    them under those names (the files are read as they are); the MoE families of transformers 5
    store per-expert Linear weights that it fuses into one tensor per layer when it loads them
    (``conversion_mapping.get_checkpoint_conversion_mapping``), so for those transformers itself
    loads the model on this rank (one full copy, as reading the files takes) and hands its state; so it
    does, with them, for ``load_kwargs`` (an MXFP4 checkpoint's dequantization: Note [MXFP4 checkpoints]
    in llama_cp/model/build.py). A vision-language checkpoint gives its text model's tensors
    (``text_model_tensors``)."""
    if not load_kwargs:
        try:
            from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        except ImportError:  # transformers 4.x: checkpoints hold the model's own names
            return text_model_tensors(_read_safetensors(path))
        mapping = get_checkpoint_conversion_mapping(config.model_type)
        if not mapping or all(_language_model_prefix(change) for change in mapping):
            return text_model_tensors(_read_safetensors(path))
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(path, dtype="auto", device_map="cpu", **(load_kwargs or {}))
    return text_model_tensors(dict(loaded.state_dict()))


def _language_model_prefix(change) -> bool:
    """Whether the conversion ``change`` only renames model.language_model.X to model.X (Apertus 1.5's
    text model, transformers 5.24), which text_model_tensors does to the files' names."""
    return (getattr(change, "source_patterns", None) == [r"^model\.language_model\.(.+)"]
            and getattr(change, "target_patterns", None) == [r"model.\1"])


def _checkpoint_key(key: str) -> str:
    """The HF checkpoint name of a (possibly peft-wrapped) parameter name."""
    key = key.removeprefix("base_model.model.")
    for wrapper in (".base_layer", ".original_module", ".modules_to_save.default"):
        key = key.replace(wrapper, "")
    return key


def _full_state_for(model_state: dict[str, torch.Tensor], checkpoint: dict[str, torch.Tensor], path: str):
    """Rank 0: the full state dict the (possibly peft) model expects, from the checkpoint tensors;
    fresh LoRA adapters initialised as peft does (A Kaiming-uniform, B zero; a DoRA magnitude the
    row norms of its base weight, peft's ||W + scale * B @ A|| at B = 0)."""
    full = {}
    for key, value in model_state.items():
        if ".lora_magnitude_vector." in key:
            base = _checkpoint_key(key.split(".lora_magnitude_vector.")[0] + ".weight")
            if base not in checkpoint:
                raise KeyError(f"checkpoint {path!r} has no tensor {base!r} (needed for {key!r})")
            full[key] = torch.linalg.norm(checkpoint[base].to(value.dtype), dim=1)
        elif ".lora_A." in key:
            full[key] = torch.nn.init.kaiming_uniform_(torch.empty(value.shape, dtype=value.dtype), a=math.sqrt(5))
        elif ".lora_B." in key:
            full[key] = torch.zeros(value.shape, dtype=value.dtype)
        else:
            name = _checkpoint_key(key)
            if name not in checkpoint and name == "lm_head.weight" and "model.embed_tokens.weight" in checkpoint:
                name = "model.embed_tokens.weight"  # tied embeddings stored once
            if name not in checkpoint:
                raise KeyError(f"checkpoint {path!r} has no tensor {name!r} (needed for {key!r})")
            full[key] = checkpoint[name].to(value.dtype)
    return full


def load_full_weights(model: nn.Module, path: str, device: torch.device | str, params_on_cpu: bool = False,
                      load_kwargs: dict | None = None) -> None:
    """Load an HF checkpoint directory (safetensors) into a model that was built on the meta
    device (optionally wrapped by peft) and sharded: rank 0 reads the files, every rank
    receives only its shards. LoRA adapters start as peft initialises them; NF4 layers
    (``--quantization 4bit``) get the checkpoint's weights quantized on rank 0.

    Peak host memory is one full copy on rank 0 and one shard per rank elsewhere.
    ``params_on_cpu``: the shards live in host memory (``shard_model(cpu_offload=True)``); the
    RoPE buffers still go to ``device``. ``load_kwargs``: transformers loads the files, with them.
    """
    model.to_empty(device="cpu" if params_on_cpu else device)
    restore_buffers(model, torch.device(device))
    full: dict[str, torch.Tensor] = {}
    if dist.get_rank() == 0:
        checkpoint = _read_checkpoint(path, base_causal_lm(model).config, load_kwargs)
        if quantized_linears(model):  # --quantization 4bit: the NF4 codes of the checkpoint's weights
            checkpoint = quantize_checkpoint(model, checkpoint, _checkpoint_key, device=device)
        full = _full_state_for(get_model_state_dict(model), checkpoint, path)
    set_model_state_dict(
        model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict on rank 0, on CPU; an empty dict on other ranks."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
