"""Turn a run's checkpoint, or its final/, into a directory plain transformers or peft loads,
on one CPU machine (no GPU, no process group).

    python -m recipes.export --checkpoint outputs/run --output_dir exported            # newest checkpoint
    python -m recipes.export --checkpoint outputs/run/checkpoints/step_00000400 --output_dir step400
    python -m recipes.export --checkpoint outputs/run/final --merge_lora --output_dir merged
    python -m recipes.export --checkpoint outputs/run/final --export_dtype bfloat16 --output_dir bf16
    python -m recipes.export --checkpoint outputs/run/final --merge_lora --format gguf --gguf_type q8_0 --output_dir gguf

--checkpoint: a run's output_dir (its newest complete checkpoint), one checkpoint directory
(checkpoints/step_N), or an export (final/: a full model, or a LoRA adapter). A LoRA
checkpoint or adapter is written as an adapter, or with --merge_lora as the base model with
the adapters merged in (Note [Exporting shard by shard] in llama_cp/train/export.py); the base
is the run's --model_name (--model_name here when it has moved), with the run's RoPE settings.
--export_dtype: float32, bfloat16, float16, or auto (the base checkpoint's dtype). The host
memory needed is the model once in float32.
--format gguf: --output_dir holds one GGUF file, model-<TYPE>.gguf, that llama.cpp and Ollama load
(tokenizer and chat template included; llama_cp/train/gguf_export.py), with the matrices in
--gguf_type f16, bf16 or q8_0. A LoRA run needs --merge_lora (one file holds one model). The
model is exported as with --format safetensors into a temporary directory beside --output_dir
(--export_dtype applies there), which is converted and removed: the disk needed is that export
plus the file. Llama-architecture models (llama, mistral), qwen2 and qwen3 with byte-level BPE
tokenizers; others are refused in one line (convert a safetensors export with llama.cpp's
convert_hf_to_gguf.py). Needs the gguf package (pip install gguf).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings

import torch

from llama_cp.train.cli import run_cli

#: Files that tell what a directory holds.
_DCP_METADATA = ".metadata"


def main(checkpoint: str, output_dir: str, merge_lora: bool = False, export_dtype: str = "auto",
         model_name: str | None = None, format: str = "safetensors", gguf_type: str | None = None) -> None:  # noqa: A002
    """--checkpoint: a run's output_dir, a checkpoint directory or an export (final/);
    --output_dir: the HF directory to write (must not exist); --merge_lora: write the base model
    with the LoRA adapters merged in; --export_dtype: auto, float32, bfloat16 or float16;
    --model_name: the base model (a local HF directory or hub id) when it is no longer where
    the run found it; --format: safetensors (an HF directory) or gguf (one GGUF file in
    --output_dir); --gguf_type: f16, bf16 or q8_0 (--format gguf)."""
    from llama_cp.data.tokenizer import build_tokenizer
    from llama_cp.model.build import model_path
    from llama_cp.train.export import EXPORT_DTYPES, align_special_tokens, export_dtype as resolve_dtype, export_pretrained

    if export_dtype not in ("auto", *EXPORT_DTYPES):
        raise ValueError(f"--export_dtype must be one of auto, {', '.join(EXPORT_DTYPES)}; got {export_dtype!r}")
    check_format(format, gguf_type)
    if os.path.exists(output_dir):
        raise FileExistsError(f"--output_dir {output_dir!r} exists; choose another directory")
    source, kind = find_source(os.path.expanduser(checkpoint))
    base_dir = None
    if kind == "model":
        if merge_lora:
            raise ValueError(f"--merge_lora: {checkpoint!r} is a full model, it has no adapters to merge")
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        tokenizer = build_tokenizer(source, "")
        dtype, info = resolve_dtype(export_dtype, source), None
    else:
        run = run_settings(source, kind, model_name)
        if format == "gguf" and not merge_lora and (kind == "adapter" or run["use_peft"]):
            raise ValueError(f"--format gguf: {checkpoint!r} is a LoRA run and a GGUF file holds one model: add "
                             "--merge_lora to write the base model with the adapters merged in")
        if kind == "adapter" and not merge_lora:
            raise ValueError(f"--checkpoint {checkpoint!r} is a LoRA adapter already: add --merge_lora to write the "
                             "base model with it merged in")
        base_dir = model_path(run["model_name"])
        model = build_base(run, base_dir, with_weights=kind == "adapter" or run["use_peft"])
        if kind == "adapter":
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, source)
        else:
            model = load_checkpoint_weights(model, run, source)
        tokenizer = build_tokenizer(base_dir, "")
        dtype = resolve_dtype(export_dtype, base_dir)
        info = {k: run[k] for k in ("model_name", "seed", "rope_theta", "rope_scaling", "context_length")}
    changed = align_special_tokens(model, tokenizer)
    if changed:
        print(f"exported with the tokenizer's special-token ids: {', '.join(changed)}")
    if format == "gguf":
        path = export_gguf(model, output_dir, tokenizer, dtype, merge_lora, gguf_type or "f16", base_dir or source)
        print(f"wrote {path}: the {'merged model' if merge_lora else 'model'} of {source} as GGUF "
              f"{(gguf_type or 'f16').upper()} ({os.path.getsize(path) / 2**20:.1f} MiB)")
        return
    export_pretrained(model, output_dir, tokenizer, dtype=dtype, merge_lora=merge_lora, info=info)
    what = "merged model" if merge_lora else "adapter" if hasattr(model, "peft_config") else "model"
    print(f"wrote {output_dir}: the {what} of {source}" + ("" if what == "adapter" else f" in {str(dtype)[6:]}"))


def check_format(format: str, gguf_type: str | None) -> None:  # noqa: A002
    """ValueError naming the flag for a --format / --gguf_type that cannot be written (before anything is read)."""
    from llama_cp.train.gguf_export import GGUF_TYPES, require_gguf

    if format not in ("safetensors", "gguf"):
        raise ValueError(f"--format must be safetensors or gguf; got {format!r}")
    if gguf_type is not None and format != "gguf":
        raise ValueError("--gguf_type applies to --format gguf; add --format gguf or leave --gguf_type out")
    if gguf_type is not None and gguf_type not in GGUF_TYPES:
        raise ValueError(f"--gguf_type must be one of {', '.join(GGUF_TYPES)}; got {gguf_type!r}")
    if format == "gguf":
        require_gguf()


def export_gguf(model, output_dir: str, tokenizer, dtype: torch.dtype, merge_lora: bool, gguf_type: str,
                base_dir: str | None) -> str:
    """``output_dir``/model-<TYPE>.gguf: the model exported as an HF directory in a temporary
    directory beside ``output_dir``, converted, the HF files removed, the directory renamed into
    place. The base's record of its own GGUF (Note [Which pre-tokenizer a GGUF names]) goes along."""
    from llama_cp.train.export import export_pretrained
    from llama_cp.train.gguf_export import write_gguf
    from llama_cp.train.gguf_vocab import source_tokenizer_pre

    parent = os.path.dirname(os.path.abspath(output_dir))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".tmp-gguf-", dir=parent)
    try:
        hf_dir = os.path.join(staging, "hf")
        export_pretrained(model, hf_dir, tokenizer, dtype=dtype, merge_lora=merge_lora)
        name = f"model-{gguf_type.upper()}.gguf"
        write_gguf(hf_dir, os.path.join(staging, name), gguf_type, name=os.path.basename(os.path.abspath(output_dir)),
                   tokenizer_pre=source_tokenizer_pre(base_dir))
        shutil.rmtree(hf_dir)
        os.rename(staging, output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return os.path.join(output_dir, name)


def find_source(path: str) -> tuple[str, str]:
    """(directory, kind) of --checkpoint: kind "checkpoint" (a DCP checkpoint of a run, the
    newest complete one of a run's output_dir), "adapter" or "model" (an HF export)."""
    from llama_cp.train.checkpoint_files import is_complete, latest_checkpoint, step_directories

    if not os.path.isdir(path):
        raise FileNotFoundError(f"--checkpoint {path!r}: no such directory")
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        return path, "adapter"
    if os.path.isfile(os.path.join(path, "config.json")):
        return path, "model"
    if os.path.isfile(os.path.join(path, _DCP_METADATA)):
        if not is_complete(path):
            raise ValueError(f"--checkpoint {path!r} is incomplete (its save was interrupted): choose another")
        return path, "checkpoint"
    if step_directories(path):
        newest = latest_checkpoint(path)
        if newest is None:
            raise ValueError(f"--checkpoint {path!r}: none of its checkpoints is complete")
        return newest, "checkpoint"
    raise ValueError(f"--checkpoint {path!r} is neither a run's output_dir, a checkpoint directory (checkpoints/"
                     "step_N) nor an export (a config.json or adapter_config.json)")


def run_settings(source: str, kind: str, model_name: str) -> dict:
    """What rebuilding the run's model needs: the base (--model_name wins), its seed and RoPE
    settings, and the LoRA settings of a checkpoint; from the checkpoint's config.yaml, or an
    adapter's llama_cp_export.json (else its adapter_config.json's base)."""
    from llama_cp.modules.causal_lm import EXPORT_INFO
    from llama_cp.train.checkpoint_files import checkpoint_config

    if kind == "checkpoint":
        config = checkpoint_config(source)
        if config is None:
            raise ValueError(f"--checkpoint {source!r} does not record its run's config (config.yaml): it cannot be "
                             "rebuilt")
        from llama_cp.config import TrainConfig

        flat = TrainConfig.flatten(config)
        run = {k: flat[k] for k in ("model_name", "seed", "rope_theta", "rope_scaling", "context_length", "use_peft")}
        run["flat"] = flat
    else:
        info_file = os.path.join(source, EXPORT_INFO)
        if os.path.isfile(info_file):
            with open(info_file) as f:
                run = json.load(f)
        else:
            with open(os.path.join(source, "adapter_config.json")) as f:
                base = json.load(f).get("base_model_name_or_path")
            run = {"model_name": base, "seed": 0, "rope_theta": 0.0, "rope_scaling": "none", "context_length": None}
        run["use_peft"] = True
    if model_name:
        run["model_name"] = model_name
    if not run.get("model_name"):
        raise ValueError(f"--checkpoint {source!r} does not say its base model: give --model_name")
    return run


def build_base(run: dict, base_dir: str | None, with_weights: bool):
    """The run's base model in float32 on the CPU, its config given the run's RoPE settings:
    the embedded model as the run initialised it (its seed), or the base checkpoint's weights
    (``with_weights``; else left uninitialised, for a checkpoint that holds every weight)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llama_cp.modules.causal_lm import apply_rope_settings, build_causal_lm, embedded_llama_config
    from llama_cp.modules.checkpoints import text_config, vision_language

    raw = embedded_llama_config() if base_dir is None else AutoConfig.from_pretrained(base_dir)
    config = text_config(raw, base_dir)
    apply_rope_settings(config, run["rope_theta"], run["rope_scaling"], run.get("context_length"))
    if base_dir is None:
        torch.manual_seed(run["seed"])  # as llama_cp.model.build.build_model initialises it
        return build_causal_lm(config)
    if with_weights and not vision_language(raw):
        return AutoModelForCausalLM.from_pretrained(base_dir, config=config, dtype=torch.float32)
    model = build_causal_lm(config, device="meta").to_empty(device="cpu")
    model.tie_weights()  # to_empty makes a new parameter of each: a tied head gets its own
    _init_rotary(model)
    if with_weights:  # the text model of a vision-language checkpoint, as the run loaded it
        from llama_cp.fsdp_wrap import _full_state_for, _read_checkpoint

        model.load_state_dict(_full_state_for(model.state_dict(), _read_checkpoint(base_dir, config), base_dir))
    return model


def _init_rotary(model) -> None:
    from llama_cp.fsdp_wrap import restore_buffers

    restore_buffers(model, torch.device("cpu"))


def load_checkpoint_weights(model, run: dict, path: str):
    """The checkpoint's model tensors loaded into ``model`` (wrapped in the run's LoRA adapters
    first when it trained them: its checkpoint holds only those). One process reads every
    shard the run's ranks wrote (torch.distributed.checkpoint reshards on load)."""
    import torch.distributed.checkpoint as dcp

    if run["use_peft"]:
        from peft import get_peft_model

        from llama_cp.config import TrainConfig
        from llama_cp.model.build import lora_config

        names = TrainConfig.flag_names()
        cfg = TrainConfig()
        for key, value in run["flat"].items():
            if names.get(key) == "peft":
                setattr(cfg.peft, key, tuple(value) if isinstance(value, list) else value)
        with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            model = get_peft_model(model, lora_config(cfg))
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    state = {name: value for name, value in model.state_dict().items() if not run["use_peft"] or name in trained}
    with warnings.catch_warnings():  # one process reading on purpose: DCP says it assumes so
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp.load({"model": state}, checkpoint_id=path, no_dist=True)  # in place: the tensors are the model's
    return model


#: --help's line for each flag of :func:`main`.
FLAGS = {
    "checkpoint": "a run's output_dir (its newest complete checkpoint), a checkpoint directory (checkpoints/step_N) "
                  "or an export (final/: a full model or a LoRA adapter)",
    "output_dir": "the HF directory to write; it must not exist",
    "merge_lora": "write the base model with the LoRA adapters merged in (else a LoRA run is written as an adapter)",
    "export_dtype": "auto (the base checkpoint's dtype, float32 for the embedded model), float32, bfloat16 or float16",
    "model_name": "the base model (a local HF directory or hub id) when it is no longer where the run found it",
    "format": "safetensors (an HF directory for transformers / peft) or gguf (one model-<TYPE>.gguf in --output_dir "
              "for llama.cpp and Ollama, tokenizer and chat template included; a LoRA run needs --merge_lora; "
              "llama, mistral, qwen2 and qwen3; needs pip install gguf)",
    "gguf_type": "the GGUF's weight matrices: f16 (the default), bf16 or q8_0 (8-bit blocks, about half of f16's "
                 "size); norms and biases stay F32",
}


def cli(argv: list[str] | None = None) -> None:
    """``python -m recipes.export``: :func:`main` with its own flags (``--help`` lists them)."""
    run_cli(main, usage="python -m recipes.export --checkpoint DIR --output_dir DIR [--merge_lora] "
                        "[--export_dtype auto|float32|bfloat16|float16] [--model_name BASE] "
                        "[--format safetensors|gguf] [--gguf_type f16|bf16|q8_0]", argv=argv, flags=FLAGS)


if __name__ == "__main__":
    cli()
