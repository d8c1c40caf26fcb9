"""Writing an exported HF model directory as one GGUF file that llama.cpp and Ollama load.

    write_gguf("outputs/run/final_merged", "model-Q8_0.gguf", "q8_0")    # -> the file's path

The directory is what llama_cp.train.export.export_pretrained writes (config.json, safetensors,
tokenizer files) for a Llama-architecture model (model_type llama or mistral), a Qwen2 or Qwen3, or
the expert models Qwen3-MoE and Qwen2-MoE (Note [Experts in a GGUF file]). The file
carries the weights in the chosen type (Note [GGUF tensor types]), the hyperparameters llama.cpp
reads, and the tokenizer with its chat template (Note [Which pre-tokenizer a GGUF names]). Tensors
are read one at a time, so the host memory needed is about one tensor (Note [Writing a GGUF one
tensor at a time]). The file is written under a temporary name beside its destination and renamed
when complete. Everything GGUF comes from the `gguf` package (llama.cpp's own Python writer).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator

import numpy as np
import torch

from llama_cp.modules.causal_lm import rope_parameters
from llama_cp.train.gguf_vocab import add_tokenizer, source_tokenizer_pre

#: --gguf_type's choices: the tensor type of the weight matrices.
GGUF_TYPES = ("f16", "bf16", "q8_0")
#: model_type -> the llama.cpp architecture it is written as (llama.cpp runs Mistral as "llama").
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
                 "qwen2_moe": "qwen2moe"}
#: The expert families -> whether llama.cpp's graph renormalizes the chosen experts' weights (Note [Experts in a
#: GGUF file]).
RENORMALIZES_TOP_K = {"qwen3_moe": True, "qwen2_moe": False}
# One expert's projection as transformers writes it, and the fused form (all experts in one tensor a layer).
_EXPERT_KEY = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_FUSED_KEY = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj(?:\.weight)?")
# Note [GGUF tensor types]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# --gguf_type picks the type of the 2-D weight matrices (embeddings, attention and MLP projections,
# the output layer): F16, BF16, or Q8_0 (blocks of 32 values along a row: one float16 scale
# d = max|x| / 127 and 32 int8 codes q = round(x / d); gguf.quants.quantize, bit for bit ggml's).
# Every 1-D tensor stays F32, as llama.cpp's converter keeps them: the RMSNorm weights
# (attn_norm, ffn_norm, output_norm), Qwen2's q/k/v biases and Llama 3's rope_freqs; they are a
# few thousand values and llama.cpp adds or multiplies them in F32. So do the routers of the expert
# families (ffn_gate_inp, and Qwen2-MoE's shared expert's gate ffn_gate_inp_shexp), which the
# converter and llama.cpp's quantizer never quantize. A matrix whose rows are not
# a whole number of 32-value blocks is written F16 under q8_0 (llama.cpp's fallback too).
#
# What Q8_0 changes in a weight w of a block with largest magnitude a: d = a / 127 is computed in
# float32, q = round(w / d) (|q| <= 127), and the file keeps d16 = float16(d), so
#     |w - q * d16| <= |w - q * d| + |q| * |d - d16| <= d / 2 + 127 * d * 2^-11 = a * (1/254 + 2^-11)
# (float16 rounds to 11 significant bits while d is a normal float16, d >= 2^-14: a >= 2^-7.
# Below that the bound is d / 2 + 127 * 2^-25, float16's subnormal step 2^-24 halved.)
# tests/train/test_gguf_export.py checks every weight read back against this bound.

# Note [Writing a GGUF one tensor at a time]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A GGUF file is header, metadata, the table of tensors (name, shape, type, offset), then the
# data in the table's order. The table needs only shapes and types, which the safetensors
# headers give, so the file is written in two passes over the tensors:
#
#     pass 1: safetensors headers -> GGUFWriter.add_tensor_info (no data read)
#             write_header_to_file, write_kv_data_to_file, write_ti_data_to_file
#     pass 2: for each tensor: read it (safe_open), permute, convert -> write_tensor_data
#
# so the host holds one tensor (plus its converted copy), never the model; for the expert families,
# one layer's gate, up or down projections of all its experts (Note [Experts in a GGUF file]).
#
# The Llama architecture's q and k rows are permuted (Note [Rotary halves and pairs]); Qwen2's
# and Qwen3's are written as they are.

# Note [Rotary halves and pairs]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# HF Llama rotates the two halves of each head (dim i with dim i + D/2); llama.cpp's "llama" arch
# rotates adjacent pairs (2i with 2i + 1). So the rows of q_proj / k_proj (and their biases) are
# reordered per head, for q over the query heads and for k over the key/value heads:
#
#     rows of one head, (2, D/2):  [h0 h1 ... | g0 g1 ...]   ->   (D/2, 2):  [h0 g0 h1 g1 ...]
#
# i.e. reshape (heads, 2, D/2, ...) -> swap axes 1 and 2 -> reshape back. transformers' GGUF
# loader (LlamaTensorProcessor) applies the inverse, reshape (heads, D/2, 2) and swap back, with
# num_attention_heads for attn_q and num_key_value_heads for attn_k, so the round trip is exact.
# Qwen2 and Qwen3 in llama.cpp rotate halves (NEOX style, llama_model_rope_type in llama.cpp's
# src/llama-model.cpp): no permutation. Qwen3's q/k norms are per-head RMSNorm weights, written F32
# as attn_q_norm / attn_k_norm.

# Note [Experts in a GGUF file]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Read in ggml-org/llama.cpp (src/models/qwen3moe.cpp at 069be0ae, qwen2moe.cpp at 623ac8d3, and the
# converter's Qwen2MoeModel, conversion code of the same tree). llama.cpp holds a layer's experts as
# three 3-D tensors, ffn_gate_exps and ffn_up_exps (ne {hidden, expert width, experts}) and
# ffn_down_exps ({expert width, hidden, experts}): torch's (experts, rows, columns) of the experts'
# weights stacked in expert order. transformers writes each expert's gate_proj / up_proj / down_proj
# apart (5.24's save_pretrained undoes its fused layout), so the writer stacks the experts of one layer
# and projection, from the headers in pass 1 and the tensors in pass 2; a fused checkpoint's
# gate_up_proj (experts, 2 x width, hidden) is split in halves, the gate first, as transformers' forward
# splits it. The router (mlp.gate) is ffn_gate_inp; Qwen2-MoE's shared expert is
# ffn_{gate,up,down}_shexp and its (1, hidden) gate the 1-D ffn_gate_inp_shexp.
# What the graphs compute that the file cannot say: every layer is an expert layer (no
# mlp_only_layers, decoder_sparse_step 1); the softmax over all experts, then the top k, renormalized
# to sum 1 for qwen3moe (build_moe_ffn's norm_w, true in its graph) and not for qwen2moe (false);
# Qwen2-MoE's shared expert scaled by the sigmoid of its gate, and its output layer always its own.
# A model that differs (norm_topk_prob, dense layers, a tied Qwen2-MoE or one without a shared expert)
# is refused rather than written as a file llama.cpp would run differently, and so is a checkpoint whose
# experts it would not find (one missing, a layer's projection missing or held twice, fused tensors of
# other shapes than the config's). The hyperparameters: expert_count, expert_used_count,
# expert_feed_forward_length (moe_intermediate_size) and, for qwen2moe,
# expert_shared_feed_forward_length. GGUF in reads the same file back with these semantics (Note [MoE
# fields of a GGUF file] in llama_cp/modules/gguf.py).


def require_gguf():
    """The `gguf` module; one line naming the fix when it is missing or transformers is too old."""
    from llama_cp.modules.gguf import require_gguf as required

    return required("--format gguf")


def write_gguf(model_dir: str, out_path: str, outtype: str, name: str | None = None,
               tokenizer_pre: str | None = None) -> str:
    """Write the HF model directory ``model_dir`` as one GGUF file ``out_path`` (must not
    exist) with matrices in ``outtype`` (f16, bf16 or q8_0; Note [GGUF tensor types]).
    ``name``: general.name (default: the directory's name); ``tokenizer_pre``: the
    pre-tokenizer name (default: Note [Which pre-tokenizer a GGUF names]). Returns ``out_path``."""
    gguf = require_gguf()
    if outtype not in GGUF_TYPES:
        raise ValueError(f"--gguf_type must be one of {', '.join(GGUF_TYPES)}; got {outtype!r}")
    if os.path.exists(out_path):
        raise FileExistsError(f"{out_path!r} exists; choose another output")
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model_dir)
    arch_name = _check_family(hf_config)
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    names = gguf.get_tensor_name_map(arch, hf_config.num_hidden_layers)
    tensors = list(_tensor_plan(model_dir, hf_config, names, gguf.MODEL_TENSORS[arch], gguf))
    _check_experts([gguf_name for gguf_name, _, _ in tensors], hf_config, model_dir)

    parent = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(parent, exist_ok=True)
    staging = os.path.join(parent, f".tmp-{os.path.basename(out_path)}.{os.getpid()}")
    writer = gguf.GGUFWriter(staging, arch_name)
    try:
        _add_hyperparameters(writer, hf_config, outtype, name or os.path.basename(os.path.abspath(model_dir)), gguf)
        add_tokenizer(writer, model_dir, hf_config, tokenizer_pre, gguf)
        extra = _rope_freqs(hf_config)
        plan = [(gguf_name, shape, _gguf_type(gguf_name, shape, outtype, gguf)) for gguf_name, shape, _ in tensors]
        if extra is not None:
            plan.append(("rope_freqs.weight", tuple(extra.shape), gguf.GGMLQuantizationType.F32))
        for gguf_name, shape, qtype in plan:  # pass 1 (Note [Writing a GGUF one tensor at a time])
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            nbytes = int(np.prod(shape[:-1])) * shape[-1] // block * size
            writer.add_tensor_info(gguf_name, shape, np.float32, nbytes, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        readers = [read for _, _, read in tensors] + ([lambda: extra] if extra is not None else [])
        for (gguf_name, _, qtype), read in zip(plan, readers):  # pass 2
            writer.write_tensor_data(_encode(read().to(torch.float32).numpy(), qtype, gguf))
        writer.close()
        os.replace(staging, out_path)
    except BaseException:
        writer.close()
        if os.path.exists(staging):
            os.remove(staging)
        raise
    return out_path


def write_final_gguf(model_dir: str, out_dir: str, outtype: str, base_dir: str | None) -> str:
    """--export_gguf: ``out_dir``/model-<TYPE>.gguf from a run's exported ``model_dir`` (final_merged/
    or final/), replacing an earlier one; a base converted from a GGUF file (``base_dir`` holds
    GGUF_SOURCE) gives its pre-tokenizer name. Returns the file's path."""
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)  # the previous export of this output_dir
    os.makedirs(out_dir)
    return write_gguf(model_dir, os.path.join(out_dir, f"model-{outtype.upper()}.gguf"), outtype,
                      tokenizer_pre=source_tokenizer_pre(base_dir))


def check_gguf_family(config, flag: str = "--format gguf") -> str:
    """The llama.cpp architecture of ``config``; ValueError naming ``flag`` for a family or setting
    not written here (the trainer asks before training, for --export_gguf)."""
    return _check_family(config, flag)


def _check_family(config, flag: str = "--format gguf") -> str:
    """The llama.cpp architecture of ``config``; ValueError for a family or setting not written here."""
    model_type = config.model_type
    if model_type not in ARCHITECTURES:
        raise ValueError(f"{flag} writes the Llama architecture (llama, mistral), qwen2, qwen3, qwen3_moe and "
                         f"qwen2_moe; {model_type} is "
                         "not one: export safetensors (--format safetensors) and convert them with llama.cpp's "
                         "convert_hf_to_gguf.py")
    if getattr(config, "mlp_bias", False):
        raise ValueError(f"{flag}: this {model_type} has MLP biases (mlp_bias), which llama.cpp's llama "
                         "architecture does not load; export safetensors instead")
    arch = ARCHITECTURES[model_type]
    if model_type in RENORMALIZES_TOP_K:  # Note [Experts in a GGUF file]
        if bool(config.norm_topk_prob) != RENORMALIZES_TOP_K[model_type]:
            raise ValueError(f"{flag}: llama.cpp's {arch} {'always' if RENORMALIZES_TOP_K[model_type] else 'never'} "
                             f"renormalizes the chosen experts' weights and this {model_type} has norm_topk_prob="
                             f"{config.norm_topk_prob}; export safetensors instead")
        if getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1:
            raise ValueError(f"{flag}: this {model_type} has dense layers (mlp_only_layers, decoder_sparse_step), "
                             f"and llama.cpp's {arch} runs experts in every layer; export safetensors instead")
        if model_type == "qwen2_moe" and config.tie_word_embeddings:
            raise ValueError(f"{flag}: this qwen2_moe ties its output layer to the embeddings, and llama.cpp's "
                             "qwen2moe needs its own; export safetensors instead")
        if model_type == "qwen2_moe" and not config.shared_expert_intermediate_size:
            raise ValueError(f"{flag}: this qwen2_moe has no shared expert (shared_expert_intermediate_size 0), and "
                             "llama.cpp's qwen2moe needs one; export safetensors instead")
    if model_type in ("qwen3", "qwen3_moe") and getattr(config, "attention_bias", False):
        raise ValueError(f"{flag}: this {model_type} has attention biases (attention_bias), and llama.cpp's {arch} "
                         "loads none on its output projection; export safetensors instead")
    if getattr(config, "use_sliding_window", False) or (model_type == "mistral" and config.sliding_window
                                                        and config.sliding_window < config.max_position_embeddings):
        raise ValueError(f"{flag}: this {model_type} uses sliding-window attention, which llama.cpp's "
                         f"{arch} architecture does not; export safetensors instead")
    return arch


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    if os.path.isfile(os.path.join(model_dir, "model.safetensors")):
        return ["model.safetensors"]
    raise FileNotFoundError(f"{model_dir!r} has no model.safetensors (or index): not an HF model export")


def _tensor_plan(model_dir, config, names, arch_tensors, gguf) -> Iterator[tuple]:
    """(GGUF name, GGUF shape, read) of each tensor to write, from the safetensors headers only; read()
    gives the tensor as the file holds it (Note [Rotary halves and pairs], Note [Experts in a GGUF
    file]). The tied output layer is left out (llama.cpp falls back to token_embd)."""
    from safetensors import safe_open

    arch = ARCHITECTURES[config.model_type]
    allowed = {gguf.TENSOR_NAMES[t].format(bid=i) for t in arch_tensors for i in range(config.num_hidden_layers)}

    def place(hf_name: str, key: str) -> str:
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None or gguf_name.rsplit(".", 1)[0] not in allowed:
            raise ValueError(f"--format gguf: tensor {key} of {model_dir!r} has no place in llama.cpp's {arch} "
                             "architecture; export safetensors instead")
        return gguf_name

    headers = {}  # key -> (file, shape), over every shard
    for file in _safetensors_files(model_dir):
        path = os.path.join(model_dir, file)
        with safe_open(path, framework="pt") as f:
            headers.update({key: (path, tuple(f.get_slice(key).get_shape())) for key in f.keys()})
    experts = {}  # (layer, projection) -> {expert: key}
    for key, (path, shape) in headers.items():
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if match := _EXPERT_KEY.fullmatch(key):
            experts.setdefault((int(match[1]), match[3]), {})[int(match[2])] = key
        elif match := _FUSED_KEY.fullmatch(key):
            stem = f"model.layers.{match[1]}.mlp.experts"
            experts_shape = (config.num_experts, config.hidden_size, config.moe_intermediate_size)
            if match[2] == "gate_up":
                experts_shape = (config.num_experts, 2 * config.moe_intermediate_size, config.hidden_size)
            if shape != experts_shape:
                raise ValueError(f"--format gguf: {key} of {model_dir!r} is {shape}, not {experts_shape} (num_experts, "
                                 "rows, columns of its config); export safetensors instead")
            if match[2] == "down":
                yield place(f"{stem}.down_proj.weight", key), shape, _reader(path, key)
                continue
            width = shape[1] // 2
            for i, half in enumerate(("gate", "up")):
                yield (place(f"{stem}.{half}_proj.weight", key), (shape[0], width, shape[2]),
                       _reader(path, key, lambda t, i=i: t[:, i * width:(i + 1) * width]))
        else:
            gguf_name = place(key, key)
            heads = {".attn_q.": config.num_attention_heads, ".attn_k.": config.num_key_value_heads}
            heads = next((n for part, n in heads.items() if part in gguf_name), None) if arch == "llama" else None
            if heads is not None:
                yield gguf_name, shape, _reader(path, key, lambda t, heads=heads: _pair_rotary_rows(t, heads))
            elif ".ffn_gate_inp_shexp." in gguf_name:  # (1, hidden) -> (hidden,)
                yield gguf_name, shape[1:], _reader(path, key, lambda t: t.reshape(-1))
            else:
                yield gguf_name, shape, _reader(path, key)
    for (layer, projection), by_expert in sorted(experts.items()):
        count = config.num_experts
        if sorted(by_expert) != list(range(count)):
            raise ValueError(f"--format gguf: {model_dir!r} holds {projection}_proj of {len(by_expert)} experts in "
                             f"layer {layer}, and its config has num_experts={count}")
        keys = [by_expert[i] for i in range(count)]
        yield (place(f"model.layers.{layer}.mlp.experts.{projection}_proj.weight", keys[0]),
               (count, *headers[keys[0]][1]), _stacked([headers[key][0] for key in keys], keys))


def _check_experts(gguf_names: list[str], config, model_dir: str) -> None:
    """ValueError unless each layer of an expert model gets its gate, up and down experts' tensors once (a
    checkpoint holding a layer's experts both fused and one by one, or missing a projection, is refused)."""
    if config.model_type not in RENORMALIZES_TOP_K:
        return
    for layer in range(config.num_hidden_layers):
        for projection in ("gate", "up", "down"):
            count = gguf_names.count(f"blk.{layer}.ffn_{projection}_exps.weight")
            if count != 1:
                raise ValueError(f"--format gguf: {model_dir!r} holds layer {layer}'s experts' {projection}_proj "
                                 f"{'both fused and one by one' if count else 'nowhere'}; export safetensors instead")


def _reader(path: str, key: str, change=None):
    """A function reading tensor ``key`` of the safetensors file ``path``, ``change`` applied."""
    def read() -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            value = f.get_tensor(key)
        return value if change is None else change(value)
    return read


def _stacked(paths: list[str], keys: list[str]):
    """A function reading the experts' tensors ``keys`` (in ``paths``) as one (experts, ...) tensor, each
    file opened once (a large model's shard headers list thousands of tensors)."""
    def read() -> torch.Tensor:
        from safetensors import safe_open

        parts = {}
        for path in dict.fromkeys(paths):
            with safe_open(path, framework="pt") as f:
                parts.update({key: f.get_tensor(key) for p, key in zip(paths, keys) if p == path})
        return torch.stack([parts[key] for key in keys])
    return read


def _pair_rotary_rows(value: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows from rotating halves to rotating pairs (Note [Rotary halves and pairs]); (rows, ...) kept."""
    rows = value.shape[0]
    return value.reshape(heads, 2, rows // heads // 2, *value.shape[1:]).transpose(1, 2).reshape(value.shape)


def _gguf_type(gguf_name: str, shape: tuple, outtype: str, gguf):
    """The GGML type of one tensor (Note [GGUF tensor types])."""
    types = gguf.GGMLQuantizationType
    if len(shape) == 1 or gguf_name.rsplit(".", 1)[0].endswith((".ffn_gate_inp", ".ffn_gate_inp_shexp")):
        return types.F32
    if outtype == "q8_0":
        return types.Q8_0 if shape[-1] % gguf.GGML_QUANT_SIZES[types.Q8_0][0] == 0 else types.F16
    return types.BF16 if outtype == "bf16" else types.F16


def _encode(value: np.ndarray, qtype, gguf) -> np.ndarray:
    """``value`` (float32) as the bytes or array GGUFWriter.write_tensor_data writes for ``qtype``."""
    types = gguf.GGMLQuantizationType
    if qtype == types.F32:
        return np.ascontiguousarray(value, dtype=np.float32)
    if qtype == types.F16:
        return value.astype(np.float16)
    return gguf.quants.quantize(np.ascontiguousarray(value), qtype)  # BF16 (round to nearest even), Q8_0


def _add_hyperparameters(writer, config, outtype: str, name: str, gguf) -> None:
    """What llama.cpp reads of the model: shapes, norms, RoPE, file type."""
    head_dim = _head_dim(config)
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config.hidden_size // config.num_attention_heads or config.model_type in ("qwen3", "qwen3_moe"):
        writer.add_key_length(head_dim)  # as llama.cpp's converter writes it (Note [A GGUF file's head size])
        writer.add_value_length(head_dim)
    if config.model_type in RENORMALIZES_TOP_K:  # Note [Experts in a GGUF file]
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if config.model_type == "qwen2_moe":
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    rope = rope_parameters(config)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    rope_type = rope.get("rope_type", "default")
    if rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif rope_type == "yarn":
        tuned = sorted(k for k in ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
                       if rope.get(k) is not None)
        if tuned:
            raise ValueError(f"--format gguf: YaRN with {', '.join(tuned)} set is not written (llama.cpp reads the "
                             "factor and the original context here); export safetensors instead")
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope.get("original_max_position_embeddings")
                                                 or config.max_position_embeddings))
    elif rope_type not in ("default", "llama3"):  # llama3: the rope_freqs tensor (_rope_freqs)
        raise ValueError(f"--format gguf: rope_type {rope_type} is not written (linear, yarn and llama3 are); "
                         "export safetensors instead")
    file_types = {"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                  "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
    writer.add_file_type(file_types[outtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _rope_freqs(config) -> torch.Tensor | None:
    """Llama 3's RoPE scaling as llama.cpp takes it: per rotary frequency, the factor it is divided
    by (rope_freqs.weight, (head_dim / 2,)): transformers' default frequencies over its llama3 ones."""
    rope = rope_parameters(config)
    if rope.get("rope_type") != "llama3":
        return None
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    dim = _head_dim(config)
    plain = 1.0 / (float(rope["rope_theta"]) ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return (plain / scaled.float()).to(torch.float32)
