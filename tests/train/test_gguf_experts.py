"""The expert models in GGUF files, out and in (Note [Experts in a GGUF file] in
llama_cp/train/gguf_export.py, Note [MoE fields of a GGUF file] in llama_cp/modules/gguf.py): tiny
Qwen3-MoE and Qwen2-MoE models written as GGUF files have the tensors, shapes and keys llama.cpp's
loader asks for, read back by transformers as the source rounded to the type, and GGUF in builds
the model llama.cpp runs from them (the experts' widths, its routing); what llama.cpp's graphs
would run differently is refused."""

from __future__ import annotations

import os

import pytest
import torch

gguf = pytest.importorskip("gguf", reason="--format gguf needs the gguf package (pip install gguf)")
pytestmark = pytest.mark.skipif(
    int(__import__("transformers").__version__.split(".")[0]) < 5,
    reason="GGUF needs transformers>=5; below, its refusal is tests/modules/test_gguf_floor.py's",
)

from gguf_files import CAST, cast_copy, fields, logits, model_dir, read_back, small_tokenizer, tiny_config  # noqa: E402

from llama_cp.train.gguf_export import write_gguf  # noqa: E402

HIDDEN, EXPERTS, WIDTH, SHARED, VOCAB, HEAD = 64, 4, 32, 48, 320, 32


def expert_config(model_type: str, **overrides):
    """2 expert layers of 4 experts (2 chosen) 32 wide: not the config classes' defaults (768, 1408), so
    a reader that keeps a default fails on shapes; Qwen2-MoE's shared expert 48 wide (default 5632)."""
    settings = dict(num_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=WIDTH)
    if model_type == "qwen3_moe":
        # Qwen3-30B-A3B's routing, and like it heads x head_dim (128) other than hidden (64)
        settings.update(norm_topk_prob=True, head_dim=HEAD)
    else:
        settings.update(shared_expert_intermediate_size=SHARED)
    return tiny_config(model_type, **{**settings, **overrides})


def llama_cpp_tensors(model_type: str, layers: int = 2) -> dict[str, list[int]]:
    """The tensors llama.cpp's loader creates for the model, with their ne (innermost first): read in
    ggml-org/llama.cpp's src/models/qwen3moe.cpp (069be0ae) and qwen2moe.cpp (623ac8d3), load_arch_tensors;
    every one required there, and no other tensor may be in the file."""
    heads, kv_heads = 4, 2
    head = HEAD if model_type == "qwen3_moe" else HIDDEN // heads
    want = {"token_embd.weight": [HIDDEN, VOCAB], "output_norm.weight": [HIDDEN], "output.weight": [HIDDEN, VOCAB]}
    for i in range(layers):
        block = {"attn_norm.weight": [HIDDEN], "attn_q.weight": [HIDDEN, head * heads],
                 "attn_k.weight": [HIDDEN, head * kv_heads], "attn_v.weight": [HIDDEN, head * kv_heads],
                 "attn_output.weight": [head * heads, HIDDEN], "ffn_norm.weight": [HIDDEN],
                 "ffn_gate_inp.weight": [HIDDEN, EXPERTS], "ffn_gate_exps.weight": [HIDDEN, WIDTH, EXPERTS],
                 "ffn_down_exps.weight": [WIDTH, HIDDEN, EXPERTS], "ffn_up_exps.weight": [HIDDEN, WIDTH, EXPERTS]}
        if model_type == "qwen3_moe":
            block.update({"attn_q_norm.weight": [head], "attn_k_norm.weight": [head]})
        else:  # the q/k/v biases (create_tensor_qkv's, optional there) and the shared expert
            block.update({"attn_q.bias": [head * heads], "attn_k.bias": [head * kv_heads],
                          "attn_v.bias": [head * kv_heads], "ffn_gate_inp_shexp.weight": [HIDDEN],
                          "ffn_gate_shexp.weight": [HIDDEN, SHARED], "ffn_down_shexp.weight": [SHARED, HIDDEN],
                          "ffn_up_shexp.weight": [HIDDEN, SHARED]})
        want.update({f"blk.{i}.{name}": ne for name, ne in block.items()})
    return want


def fused_experts(state: dict, stem: str) -> dict[str, torch.Tensor]:
    """The per-expert tensors of ``state`` under ``stem`` (model.layers.N.mlp.experts) as transformers fuses
    them: gate_up_proj (experts, 2 x width, hidden), the gate first, and down_proj (experts, hidden, width)."""
    stacked = {p: torch.stack([state[f"{stem}.{e}.{p}_proj.weight"] for e in range(EXPERTS)])
               for p in ("gate", "up", "down")}
    return {f"{stem}.gate_up_proj": torch.cat([stacked["gate"], stacked["up"]], dim=1),
            f"{stem}.down_proj": stacked["down"]}


def assert_same_tensors(path: str, reference: str) -> None:
    """The GGUF file ``path`` holds the tensors of ``reference``, name for name and bit for bit."""
    by_name = {t.name: t.data for t in gguf.GGUFReader(reference).tensors}
    tensors = gguf.GGUFReader(path).tensors
    assert sorted(t.name for t in tensors) == sorted(by_name)
    for tensor in tensors:
        assert (tensor.data == by_name[tensor.name]).all(), tensor.name


@pytest.mark.parametrize("outtype", ["f16", "bf16"])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe"])
def test_expert_models_read_back_as_the_source_rounded_to_the_type(tmp_path, model_type, outtype):
    """Every weight transformers reads back (GGUF in's reading: the experts' widths and routing from
    the file) is the source's rounded to the type, the routers exactly; so the logits are the rounded
    source's; the config read back has the source's widths and routing."""
    source, directory = model_dir(tmp_path / "hf", expert_config(model_type))
    back, tokenizer = read_back(write_gguf(directory, str(tmp_path / "m.gguf"), outtype))
    for name in ("moe_intermediate_size", "norm_topk_prob", "num_experts", "num_experts_per_tok",
                 *(("shared_expert_intermediate_size",) if model_type == "qwen2_moe" else ())):
        assert getattr(back.config, name) == getattr(source.config, name), name
    want = cast_copy(source, CAST[outtype])
    got_state, want_state = back.state_dict(), want.state_dict()
    assert set(got_state) == set(want_state)
    for name, value in want_state.items():
        torch.testing.assert_close(got_state[name], value, atol=0, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
    torch.testing.assert_close(logits(back, tokenizer), logits(want, small_tokenizer()), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe"])
def test_the_tensors_and_keys_llama_cpp_loads(tmp_path, model_type):
    """Exactly the tensors llama.cpp's loader creates, each with its ne; the routers F32 under q8_0 and the
    experts Q8_0; each expert's weights at its place in the stacked tensor; the expert keys."""
    source, directory = model_dir(tmp_path / "hf", expert_config(model_type))
    out = write_gguf(directory, str(tmp_path / "m.gguf"), "q8_0")
    reader = gguf.GGUFReader(out)
    assert {t.name: [int(n) for n in t.shape] for t in reader.tensors} == llama_cpp_tensors(model_type)
    meta, arch = fields(out), model_type.replace("_", "")
    assert meta["general.architecture"] == arch
    assert (meta[f"{arch}.expert_count"], meta[f"{arch}.expert_used_count"]) == (EXPERTS, 2)
    assert meta[f"{arch}.expert_feed_forward_length"] == WIDTH
    if model_type == "qwen2_moe":
        assert meta["qwen2moe.expert_shared_feed_forward_length"] == SHARED
        assert meta["tensors"]["blk.1.ffn_gate_inp_shexp.weight"] == "F32"
    else:
        assert meta["qwen3moe.attention.key_length"] == HEAD
        assert "qwen3moe.expert_shared_feed_forward_length" not in meta
    assert meta["tensors"]["blk.1.ffn_gate_inp.weight"] == "F32"
    assert {meta["tensors"][f"blk.1.ffn_{p}_exps.weight"] for p in ("gate", "up", "down")} == {"Q8_0"}
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    stacked = next(t for t in reader.tensors if t.name == "blk.1.ffn_down_exps.weight")
    down = gguf.quants.dequantize(stacked.data, q8_0)  # (experts, hidden, width)
    state = source.state_dict()
    experts = state["model.layers.1.mlp.experts.down_proj"]  # transformers' fused (experts, hidden, width)
    for e in range(EXPERTS):
        want = gguf.quants.dequantize(gguf.quants.quantize(experts[e].numpy(), q8_0), q8_0)
        assert (down[e] == want).all(), e


def test_gguf_in_builds_the_model_llama_cpp_runs(tmp_path, monkeypatch):
    """A Qwen3-MoE file, as a run reads it (--model_name m.gguf: the converted directory): the experts'
    width from expert_feed_forward_length (transformers' own reading keeps its config's 768, so a file
    of other widths failed to load) and the chosen experts' weights renormalized, as llama.cpp's
    qwen3moe graph runs it. The logits are the source's rounded to f16; the planner's config (the
    file's metadata) agrees."""
    from transformers import AutoModelForCausalLM

    from llama_cp.modules.gguf import gguf_config, gguf_model_dir

    monkeypatch.setenv("LLAMA_CP_CACHE", str(tmp_path / "cache"))
    source, directory = model_dir(tmp_path / "hf", expert_config("qwen3_moe"))
    out = write_gguf(directory, str(tmp_path / "m.gguf"), "f16")
    planned = gguf_config(out)
    assert (planned.moe_intermediate_size, planned.norm_topk_prob) == (WIDTH, True)
    converted = AutoModelForCausalLM.from_pretrained(gguf_model_dir(out), dtype=torch.float32).eval()
    assert (converted.config.moe_intermediate_size, converted.config.norm_topk_prob) == (WIDTH, True)
    torch.testing.assert_close(logits(converted, small_tokenizer()), logits(cast_copy(source, torch.float16),
                                                                           small_tokenizer()), atol=1e-5, rtol=1e-5)


def test_what_llama_cpp_would_run_differently_is_refused(tmp_path):
    """Nothing written, and one line naming the setting, for routing llama.cpp's graph does not run
    (Qwen3-MoE without renormalizing, Qwen2-MoE with it), dense layers, a tied Qwen2-MoE or one without a
    shared expert, attention biases on Qwen3-MoE's output projection (llama.cpp's qwen3moe loads none),
    and checkpoints whose experts llama.cpp would not find: one missing, a layer's both fused and one by
    one, a projection missing, a fused tensor of other shapes than its config's."""
    from safetensors.torch import load_file, save_file

    cases = {"norm_topk_prob=False": ("qwen3_moe", {"norm_topk_prob": False}),
             "norm_topk_prob=True": ("qwen2_moe", {"norm_topk_prob": True}),
             "has dense layers": ("qwen3_moe", {"mlp_only_layers": [1]}),
             "ties its output layer": ("qwen2_moe", {"tie_word_embeddings": True}),
             "has no shared expert": ("qwen2_moe", {"shared_expert_intermediate_size": 0}),
             "has attention biases": ("qwen3_moe", {"attention_bias": True})}
    for message, (model_type, overrides) in cases.items():
        _, directory = model_dir(tmp_path / message, expert_config(model_type, **overrides))
        with pytest.raises(ValueError, match=f"^--format gguf: .*{message}.*export safetensors instead$"):
            write_gguf(directory, str(tmp_path / "x.gguf"), "f16")
    _, directory = model_dir(tmp_path / "qwen3", tiny_config("qwen3", attention_bias=True))  # the dense Qwen3 alike
    with pytest.raises(ValueError, match="^--format gguf: this qwen3 has attention biases"):
        write_gguf(directory, str(tmp_path / "x.gguf"), "f16")
    _, directory = model_dir(tmp_path / "missing", expert_config("qwen3_moe"))
    weights = os.path.join(directory, "model.safetensors")
    state = load_file(weights)
    save_file({k: v for k, v in state.items() if ".experts.3.up_proj" not in k}, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"holds up_proj of 3 experts in layer 0, and its config has num_experts=4"):
        write_gguf(directory, str(tmp_path / "x.gguf"), "f16")
    stem = "model.layers.1.mlp.experts"
    fused_up = fused_experts(state, stem)[f"{stem}.gate_up_proj"]
    broken = {"both fused and one by one": {**state, f"{stem}.gate_up_proj": fused_up},
              "gate_proj nowhere": {k: v for k, v in state.items() if not k.startswith(f"{stem}.") or "gate" not in k},
              r"is \(4, 32, 64\), not \(4, 64, 64\)": {
                  **{k: v for k, v in state.items() if not k.startswith(f"{stem}.") or "down" in k},
                  f"{stem}.gate_up_proj": fused_up[:, ::2].contiguous()}}
    for message, tensors in broken.items():
        save_file(tensors, weights, metadata={"format": "pt"})
        with pytest.raises(ValueError, match=f"^--format gguf: .*{message}"):
            write_gguf(directory, str(tmp_path / "x.gguf"), "f16")
    assert not os.path.exists(tmp_path / "x.gguf") and not any(n.startswith(".tmp-") for n in os.listdir(tmp_path))


def test_a_fused_checkpoint_writes_the_same_tensors(tmp_path):
    """A checkpoint holding each layer's experts fused (gate_up_proj (experts, 2 x width, hidden), the gate
    first, and down_proj), as transformers holds them in memory, gives the file of the per-expert one."""
    from safetensors.torch import load_file, save_file

    _, directory = model_dir(tmp_path / "hf", expert_config("qwen3_moe"))
    per_expert = write_gguf(directory, str(tmp_path / "per_expert.gguf"), "bf16")
    weights = os.path.join(directory, "model.safetensors")
    state = load_file(weights)
    fused = {k: v for k, v in state.items() if ".mlp.experts." not in k}
    for layer in range(2):
        fused.update(fused_experts(state, f"model.layers.{layer}.mlp.experts"))
    save_file(fused, weights, metadata={"format": "pt"})
    assert_same_tensors(write_gguf(directory, str(tmp_path / "fused.gguf"), "bf16"), per_expert)


def test_experts_split_over_shards_write_the_same_tensors(tmp_path):
    """A checkpoint in two shards (model.safetensors.index.json) whose layers' experts are split between
    them, as a large model's are, gives the file of the one-file checkpoint."""
    import json

    from safetensors.torch import load_file, save_file

    _, directory = model_dir(tmp_path / "hf", expert_config("qwen2_moe"))
    whole = write_gguf(directory, str(tmp_path / "whole.gguf"), "f16")
    state = load_file(os.path.join(directory, "model.safetensors"))
    os.remove(os.path.join(directory, "model.safetensors"))
    first = {k: v for k, v in state.items() if ".experts.0." in k or ".experts.1." in k or "layers.0.self_attn" in k}
    shards = {"model-00001-of-00002.safetensors": first,
              "model-00002-of-00002.safetensors": {k: v for k, v in state.items() if k not in first}}
    for name, part in shards.items():
        save_file(part, os.path.join(directory, name), metadata={"format": "pt"})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: name for name, part in shards.items() for k in part}}, f)
    assert_same_tensors(write_gguf(directory, str(tmp_path / "sharded.gguf"), "f16"), whole)
