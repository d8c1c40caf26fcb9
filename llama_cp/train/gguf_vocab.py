"""The vocabulary of a GGUF file: an HF byte-level BPE tokenizer (tokenizer.json) written as
llama.cpp's "gpt2" tokenizer model, with its merges, special ids, the tokens the HF tokenizer adds
around a text, its chat template, and the name of its pre-tokenizer split.

    add_tokenizer(writer, "outputs/run/final_merged", config, None, gguf)

Used by llama_cp.train.gguf_export.write_gguf.
"""

from __future__ import annotations

import json
import os

# GGUF_SOURCE: written by GGUF in into a directory converted from a GGUF file; its "tokenizer_pre" is the
# pre-tokenizer name that file carried
from llama_cp.modules.gguf import GGUF_SOURCE

#: The byte-level pre-tokenizers recognised from tokenizer.json (Note [Which pre-tokenizer a GGUF names]).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# Mistral's Tekken (Mistral Nemo, Mistral Small 3, Ministral): as llama.cpp's src/llama-vocab.cpp quotes it from
# tokenizer.json beside its own rewriting of it (LLAMA_VOCAB_PRE_TYPE_TEKKEN)
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
                 r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+"
                 r"|\s+(?!\S)|\s+")

# Note [Which pre-tokenizer a GGUF names]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A byte-level BPE vocabulary is written as tokenizer.ggml.model "gpt2" with its merges, and
# llama.cpp splits text before merging by the regexes of the name in tokenizer.ggml.pre (an
# unknown name fails the load). The name is, in this order:
#   1. the one the model's own GGUF carried, when the directory was converted from one (its
#      llama_cp_gguf_source.json, "tokenizer_pre"; recipes.export and --export_gguf pass the base
#      model's: source_tokenizer_pre).
#      transformers rebuilds such a tokenizer.json without the original split (SmolLM2's digit
#      split, "smollm"), so the file is the only faithful record;
#   2. else the name whose split tokenizer.json's pre_tokenizer spells out:
#        ByteLevel(use_regex=True)                          -> "gpt-2"
#        Digits(individual) + ByteLevel(use_regex=True)     -> "smollm"
#        Split(Llama 3's regex) + ByteLevel(use_regex=False) -> "llama-bpe"
#        Split(Qwen2's regex)   + ByteLevel(use_regex=False) -> "qwen2"
#        Split(Tekken's regex)  + ByteLevel(use_regex=False) -> "tekken"
#   3. else the export is refused. llama.cpp's converter names the split by hashing how the
#      tokenizer encodes a test text against its own table; a wrong name loads and then
#      tokenizes differently from training, silently, so guessing is worse than refusing.
# SentencePiece-style vocabularies (Llama 2, Mistral 7B v0.1) are refused as well: export
# safetensors and convert them with llama.cpp's convert_hf_to_gguf.py.


def source_tokenizer_pre(directory: str | None) -> str | None:
    """The pre-tokenizer name of the GGUF file ``directory`` was converted from (its GGUF_SOURCE,
    written by GGUF in), None for any other directory (Note [Which pre-tokenizer a GGUF names])."""
    source = os.path.join(directory or "", GGUF_SOURCE)
    if not directory or not os.path.isfile(source):
        return None
    with open(source) as f:
        return json.load(f).get("tokenizer_pre")


def add_tokenizer(writer, model_dir: str, config, tokenizer_pre: str | None, gguf) -> None:
    """The vocabulary (one entry per embedding row), merges, special ids, add-bos/eos and chat template."""
    from transformers import AutoTokenizer

    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--format gguf: {model_dir!r} has no tokenizer.json; the GGUF must carry the tokenizer")
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    model = spec.get("model", {})
    if model.get("type") != "BPE" or model.get("byte_fallback") or (spec.get("decoder") or {}).get("type") != "ByteLevel":
        raise ValueError("--format gguf writes byte-level BPE tokenizers (Llama 3, Qwen2, SmolLM); this one is "
                         "SentencePiece-style: export safetensors and convert them with llama.cpp's convert_hf_to_gguf.py")
    if not model.get("merges"):
        raise ValueError("--format gguf: the tokenizer has no BPE merges (the embedded byte tokenizer?), which "
                         "llama.cpp's BPE needs; export safetensors instead")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"--format gguf: the tokenizer has {len(tokenizer)} tokens, more than the model's "
                         f"{config.vocab_size} embedding rows")
    by_id = {i: token for token, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder  # id -> AddedToken
    tokens, types = [], []
    for i in range(config.vocab_size):  # llama.cpp wants one token per embedding row
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(added[i].content)
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tokenizer_pre or pre_tokenizer_name(model_dir, spec))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=config.vocab_size)
    probe = tokenizer("a").input_ids  # what the HF tokenizer adds around a text, told to llama.cpp exactly
    special.add_special_token["bos"] = tokenizer.bos_token_id is not None and probe[:1] == [tokenizer.bos_token_id]
    special.add_special_token["eos"] = tokenizer.eos_token_id is not None and probe[-1:] == [tokenizer.eos_token_id]
    if special.chat_template is None and tokenizer.chat_template:
        special.chat_template = tokenizer.chat_template
    special.add_to_gguf(writer, quiet=True)


def pre_tokenizer_name(model_dir: str, spec: dict) -> str:
    """llama.cpp's name for the tokenizer's split (Note [Which pre-tokenizer a GGUF names]):
    the source GGUF's, else the one tokenizer.json's pre_tokenizer spells out; ValueError else."""
    pre = source_tokenizer_pre(model_dir)
    if pre:
        return pre
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    shape = tuple(_describe_step(step) for step in steps)
    known = {
        ("bytelevel-regex",): "gpt-2",
        ("digits-individual", "bytelevel-regex"): "smollm",
        ("split-llama3", "bytelevel"): "llama-bpe",
        ("split-qwen2", "bytelevel"): "qwen2",
        ("split-tekken", "bytelevel"): "tekken",
    }
    if shape in known:
        return known[shape]
    raise ValueError(f"--format gguf: the tokenizer's pre-tokenizer ({' + '.join(shape) or 'none'}) is not one "
                     "llama.cpp names here (gpt-2, smollm, llama-bpe, qwen2, tekken); export safetensors and convert them "
                     "with llama.cpp's convert_hf_to_gguf.py, which recognises more")


def _describe_step(step: dict) -> str:
    kind = step.get("type", "?")
    if kind == "ByteLevel":
        return "bytelevel-regex" if step.get("use_regex", True) else "bytelevel"
    if kind == "Digits":
        return "digits-individual" if step.get("individual_digits") else "digits"
    if kind == "Split":
        regex = (step.get("pattern") or {}).get("Regex")
        return {_LLAMA3_SPLIT: "split-llama3", _QWEN2_SPLIT: "split-qwen2", _TEKKEN_SPLIT: "split-tekken"}.get(
            regex, "split-other")
    return kind.lower()
