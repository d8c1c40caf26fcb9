"""Writing the trained model out as a directory that plain transformers and peft load.

    export_pretrained(model, "outputs/run/final", tokenizer, dtype=torch.bfloat16)              # full model
    export_pretrained(peft_model, "outputs/run/final", tokenizer)                               # LoRA adapter
    export_pretrained(peft_model, "outputs/run/final_merged", tokenizer, merge_lora=True)       # adapter merged in

Every export is written into a temporary directory beside its destination and renamed into
place when complete (a half-written export never looks complete). Note [Exporting shard by
shard] says how a full model is written without gathering it on one process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from llama_cp.modules.causal_lm import EXPORT_INFO, base_causal_lm
from llama_cp.train.write_failures import WriteFailed, describe_write_failure

#: --export_dtype's choices.
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Largest safetensors file of a full export (the Hub's usual 5 GB shards).
MAX_SHARD_BYTES = 5 * 10**9

# Note [Exporting shard by shard]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A full state dict gathered on rank 0 is the whole model in host memory: ~32 GB for an 8B model
# in float32, ~280 GB for 70B. The export instead walks the sharded state dict in its order and
# gathers one tensor at a time (DTensor.full_tensor, a collective every rank joins in the same
# order); rank 0 keeps the tensors of one decoder layer, finishes them there (LoRA merged in,
# peft's names taken off, cast to the export dtype, transformers' weight conversions reverted:
# a fused MoE expert tensor is saved in the layout its checkpoint had), and adds them to the
# current safetensors file, written when the next layer would take it past MAX_SHARD_BYTES.
# Rank 0's peak is one file plus one layer; the others hold one gathered tensor. The files are
# named model-0000i-of-0000N.safetensors once N is known, with the index transformers reads
# (model.safetensors alone when one file holds everything). Tied weights are written once,
# under their first name, as save_pretrained does.
#
# Merging (--merge_lora) uses the adapter's own scale (peft's `scaling`, which already holds
# rsLoRA's alpha / sqrt(r)): W + scale * B @ A in float32, then cast; with DoRA the merged
# weight is m * (W + scale * B @ A) / ||W + scale * B @ A|| per output row, as peft merges it.
# A peft module_to_save (a trained full copy of, e.g., the embeddings) replaces its original.
# The test compares with peft's merge_and_unload on a plain model and with the trained logits.


def export_dtype(choice: str, model_dir: str | None) -> torch.dtype:
    """--export_dtype: ``auto`` is the dtype the model's checkpoint was stored in (its
    config.json's ``dtype`` / ``torch_dtype``), float32 for the embedded model."""
    if choice != "auto":
        return EXPORT_DTYPES[choice]
    stored = None
    if model_dir is not None and os.path.isfile(os.path.join(model_dir, "config.json")):
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
        stored = config.get("dtype") or config.get("torch_dtype")
    return EXPORT_DTYPES.get(str(stored).removeprefix("torch."), torch.float32)


def align_special_tokens(model: nn.Module, tokenizer) -> list[str]:
    """Set the bos / eos / pad ids of the model's config and generation config to the tokenizer's,
    so that ``generate()`` on the export stops at the eos it was trained to write; an id list
    that holds the tokenizer's (Llama 3 instruct's eos list) is kept. Returns the ids replaced
    (not those filled in where the config had none)."""
    base, changed = base_causal_lm(model), []
    for config in filter(None, (base.config, getattr(base, "generation_config", None))):
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            wanted, held = getattr(tokenizer, name, None), getattr(config, name, None)
            if wanted is None or held == wanted or (isinstance(held, (list, tuple)) and wanted in held):
                continue
            setattr(config, name, wanted)
            if held is not None:  # a missing id filled in is not worth a line
                changed.append(f"{type(config).__name__}.{name} {held} -> {wanted}")
    return changed


def export_pretrained(
    model: nn.Module, output_dir: str, tokenizer=None, *, dtype: torch.dtype = torch.float32, merge_lora: bool = False,
    info: dict | None = None, max_shard_bytes: int = MAX_SHARD_BYTES,
) -> None:
    """Write ``model`` (sharded by FSDP2, or plain) to ``output_dir``: a peft model's adapter
    (its trainable tensors only are gathered) unless ``merge_lora``, else the full HF model in
    ``dtype`` shard by shard (Note [Exporting shard by shard]); with the tokenizer and, for an
    adapter, ``info`` as llama_cp_export.json (and a README when the base's config must change).
    Every rank calls it; rank 0 writes."""
    if os.path.exists(output_dir):  # every rank sees it: all raise before the collectives
        raise FileExistsError(f"{output_dir!r} exists; choose another output directory")
    adapter = hasattr(model, "peft_config") and not merge_lora
    if merge_lora and not hasattr(model, "peft_config"):
        raise ValueError("--merge_lora merges LoRA adapters into the base model: the run has none (add --use_peft)")
    if merge_lora:
        check_mergeable(model)
    parent = os.path.dirname(os.path.abspath(output_dir))
    rank0 = dist.get_rank() == 0 if dist.is_initialized() else True
    tmp, failure = None, [None]
    try:
        if rank0:
            os.makedirs(parent, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=".tmp-export-", dir=parent)
        if adapter:  # small: the adapters (and modules_to_save), never the frozen base
            state = get_model_state_dict(model, options=StateDictOptions(
                full_state_dict=True, cpu_offload=True, ignore_frozen_params=True))
            if rank0:
                # the vocabulary is never resized here: peft need not look for (sharded) embedding weights
                model.save_pretrained(tmp, state_dict=state, save_embedding_layers=False)
        else:
            _write_full_model(model, tmp, dtype, merge_lora, max_shard_bytes)
        if rank0:
            base = base_causal_lm(model)
            if not adapter:
                config = base.config
                import transformers

                # config.json's "dtype" (transformers 5; 4 names it torch_dtype, which 5 warns of)
                newer = int(transformers.__version__.split(".")[0]) >= 5
                setattr(config, "dtype" if newer else "torch_dtype", dtype)
                config.save_pretrained(tmp)
                if getattr(base, "generation_config", None) is not None:
                    base.generation_config.save_pretrained(tmp)
            elif info is not None:
                _write_info(tmp, info)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            os.rename(tmp, output_dir)
    except Exception as error:  # noqa: BLE001 - e.g. a full disk: the other ranks must hear of it
        failure = [describe_write_failure(error, f"exporting {output_dir}", tmp or parent, parent)]
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if not dist.is_initialized():
            raise WriteFailed(failure[0]) from error
    if dist.is_initialized():
        dist.broadcast_object_list(failure, src=0)  # also the barrier: the export is in place
    if failure[0] is not None:
        raise WriteFailed(failure[0])


def export_run(model: nn.Module, tokenizer, cfg, path: str, model_path: str | None, say) -> None:
    """What a run writes at its end (``Trainer.export``): ``path`` (``final/``), an HF model directory in
    --export_dtype (full fine-tune) or a peft adapter (LoRA), with the tokenizer; with --merge_lora also
    ``path``_merged, the adapter merged into the base; with --export_gguf also ``final_gguf/`` beside
    them. Every rank calls it; ``say`` prints on rank 0."""
    rank0 = dist.get_rank() == 0
    targets = [(path, False)] + ([(path.rstrip(os.sep) + "_merged", True)] if cfg.merge_lora else [])
    if rank0:
        for target, _ in targets:
            if os.path.exists(target):
                shutil.rmtree(target)  # the previous export of this output_dir
    dist.barrier()
    changed = align_special_tokens(model, tokenizer)
    if changed:
        say(f"exported with the tokenizer's special-token ids: {', '.join(changed)}")
    dtype = export_dtype(cfg.export_dtype, model_path)
    name = cfg.model.model_name
    local = name != "embedded" and (os.path.isdir(os.path.expanduser(name)) or name.lower().endswith(".gguf"))
    base = os.path.abspath(os.path.expanduser(name)) if local else name
    if hasattr(model, "peft_config") and name != "embedded":
        for adapter in model.peft_config.values():  # where PeftModel.from_pretrained users find the base
            adapter.base_model_name_or_path = base
    info = {"model_name": base, "seed": cfg.seed, "rope_theta": cfg.model.rope_theta,
            "rope_scaling": cfg.model.rope_scaling, "context_length": cfg.data.context_length}
    for target, merge in targets:
        export_pretrained(model, target, tokenizer, dtype=dtype, merge_lora=merge, info=info)
    if cfg.export_gguf != "none":
        from llama_cp.train.gguf_export import write_final_gguf

        out = os.path.join(os.path.dirname(path.rstrip(os.sep)), "final_gguf")
        if rank0:
            say(f"wrote {write_final_gguf(targets[-1][0], out, cfg.export_gguf, model_path)} (docs/gguf.md)")
        dist.barrier()  # the other ranks go on once the file is written
    rope = " ".join(f"--{k} {v}" for k, v in (("rope_theta", cfg.model.rope_theta),
                                               ("rope_scaling", cfg.model.rope_scaling)) if v not in (0, "none"))
    if rope and hasattr(model, "peft_config"):  # peft loads an adapter onto the base's own config
        merged = f"; {targets[-1][0]} carries them" if cfg.merge_lora else "; --merge_lora writes a model that carries them"
        say(f"{path} is an adapter trained with {rope}: the base model's config must be given the same "
            f"settings before loading it (README.md there){merged}")


def check_mergeable(model: nn.Module) -> None:
    """ValueError naming the flag for an adapter :func:`export_pretrained` cannot merge exactly here."""
    from llama_cp.modules.quantize import quantized_linears

    if quantized_linears(model):
        raise ValueError("--merge_lora with --quantization 4bit: the base weights on the GPUs are NF4 codes; merge "
                         "onto the original weights with python -m recipes.export --checkpoint DIR --merge_lora "
                         "(it reads the base model directory)")
    targets = getattr(next(iter(model.peft_config.values())), "target_parameters", None)
    if targets:  # given, or peft's (Note [peft's MoE target conversion] in llama_cp/model/build.py)
        raise ValueError(f"--merge_lora: the adapter has adapters on fused expert tensors (target parameters "
                         f"{', '.join(sorted(targets))}), which are not merged here; drop --merge_lora and merge the "
                         "adapter with peft's merge_and_unload")


def _write_info(directory: str, info: dict) -> None:
    """llama_cp_export.json, and a README when the run changed the base model's RoPE: peft loads an
    adapter onto the stock base config, which would silently run with the old RoPE."""
    with open(os.path.join(directory, EXPORT_INFO), "w") as f:
        json.dump(info, f, indent=1)
    changes = {k: info[k] for k in ("rope_theta", "rope_scaling") if info.get(k) not in (None, 0, 0.0, "none")}
    if not changes:
        return
    flags = " ".join(f"--{k} {v}" for k, v in changes.items())
    with open(os.path.join(directory, "README.md"), "w") as f:
        f.write(
            "# LoRA adapter trained with changed RoPE settings\n\n"
            f"This adapter was trained on `{info.get('model_name')}` with `{flags}`. Loaded onto the base model's "
            "own config it runs with the old RoPE and gives wrong outputs at long context. Change the base "
            "config first (`rope_parameters` / `rope_scaling` and `rope_theta` in its config.json, or on the "
            "config object before `from_pretrained`), or export a merged model, which carries them:\n\n"
            f"    python -m recipes.export --checkpoint {os.path.basename(directory)} --merge_lora --output_dir merged\n\n"
            f"The settings, machine-readable: `{EXPORT_INFO}`.\n"
        )


_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")
_PEFT_PART = re.compile(r"\.(base_layer|lora_\w+|modules_to_save|original_module)\.")
_PEFT_PREFIX = "base_model.model."


def _layer_groups(model: nn.Module) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The sharded state dict's (name, tensor) pairs in order, one list per decoder layer (or per
    tensor outside the layers); a tensor tied to an earlier one (the output layer to the
    embeddings) is left out."""
    seen, group, items = set(), None, []
    for name, value in model.state_dict(keep_vars=True).items():
        if id(value) in seen:
            continue
        seen.add(id(value))
        match = _LAYER.match(name)  # a decoder layer, else the module (with its peft parts)
        key = match.group(1) if match else _PEFT_PART.split(name)[0].rsplit(".", 1)[0]
        if items and key != group:
            yield items
            items = []
        group = key
        items.append((name, value))
    if items:
        yield items


def _gathered(value: torch.Tensor, rank0: bool) -> torch.Tensor | None:
    """``value`` in full on CPU on rank 0 (None elsewhere); a collective for a DTensor."""
    full = value.full_tensor() if isinstance(value, DTensor) else value
    return full.detach().to("cpu") if rank0 else None


def _merged_layer(model: nn.Module, tensors: dict[str, torch.Tensor], merge: bool) -> dict[str, torch.Tensor]:
    """One layer's tensors under the HF checkpoint's names: peft's wrappers taken off, adapters
    merged into their base weights (Note [Exporting shard by shard])."""
    out = {}
    for name, value in tensors.items():
        if ".lora_" in name or ".original_module." in name:
            continue  # merged below / replaced by the trained copy
        hf = name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
        out[hf] = value
        if not merge or not name.endswith(".base_layer.weight"):
            continue
        prefix = name.removesuffix(".base_layer.weight")
        module = model.get_submodule(prefix)
        for adapter in module.active_adapters:
            a, b = tensors[f"{prefix}.lora_A.{adapter}.weight"].float(), tensors[f"{prefix}.lora_B.{adapter}.weight"].float()
            weight = value.float() + module.scaling[adapter] * (b @ a)
            if module.use_dora.get(adapter, False):
                magnitude = tensors[f"{prefix}.lora_magnitude_vector.{adapter}.weight"].float()
                weight = (magnitude / torch.linalg.norm(weight, dim=1)).view(-1, 1) * weight
            out[hf] = weight
    return out


def _revert_conversions(base: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5 renames and fuses some checkpoint tensors when it loads them (an MoE's
    experts); save_pretrained undoes that, and so does this, one layer at a time."""
    try:
        from transformers.modeling_utils import revert_weight_conversion
    except ImportError:  # transformers 4: tensors are kept as the checkpoint names them
        return tensors
    return revert_weight_conversion(base, tensors)


def _write_full_model(model: nn.Module, directory: str | None, dtype: torch.dtype, merge: bool,
                      max_shard_bytes: int) -> None:
    """The full model's safetensors files in ``directory`` (rank 0), one layer gathered at a
    time (Note [Exporting shard by shard])."""
    from safetensors.torch import save_file

    rank0 = directory is not None
    base = base_causal_lm(model)
    files: list[list[str]] = []  # the tensor names of each file written
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, total_bytes = 0, 0

    failed: list[BaseException] = []  # rank 0 goes on gathering after a failed write: the others are in collectives

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard and not failed:
            try:
                save_file(shard, os.path.join(directory, f".part-{len(files)}.safetensors"), metadata={"format": "pt"})
            except Exception as error:  # noqa: BLE001 - raised once every rank is past the collectives
                failed.append(error)
            files.append(list(shard))
        shard, shard_bytes = {}, 0

    for group in _layer_groups(model):
        tensors = {name: _gathered(value, rank0) for name, value in group}
        if not rank0 or failed:
            continue
        try:
            layer = _revert_conversions(base, _merged_layer(model, tensors, merge))
            layer = {name: value.to(dtype).contiguous() for name, value in layer.items()}
        except Exception as error:  # noqa: BLE001 - as a failed write
            failed.append(error)
            continue
        size = sum(value.numel() * value.element_size() for value in layer.values())
        if shard_bytes + size > max_shard_bytes:
            flush()
        shard.update(layer)
        shard_bytes += size
        total_bytes += size
    if not rank0:
        return
    flush()
    if failed:
        raise failed[0]
    if len(files) == 1:
        os.rename(os.path.join(directory, ".part-0.safetensors"), os.path.join(directory, "model.safetensors"))
        return
    weight_map = {}
    for index, names in enumerate(files):
        final = f"model-{index + 1:05d}-of-{len(files):05d}.safetensors"
        os.rename(os.path.join(directory, f".part-{index}.safetensors"), os.path.join(directory, final))
        weight_map.update(dict.fromkeys(names, final))
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, f, indent=2)
