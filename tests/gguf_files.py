"""Tiny HF model directories with a small byte-level BPE tokenizer, written by the GGUF tests
(tests/train/test_gguf_export.py, test_gguf_experts.py) and read back by transformers' GGUF reader
the way GGUF in reads a file."""

from __future__ import annotations

import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llama_cp.modules.gguf import _file_config, reading_once

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXTS = ("What is the capital of France? 123", "<|im_start|>user\nBerlin, 456.<|im_end|>\n", "  two  spaces\n\nand é")
CAST = {"f16": torch.float16, "bf16": torch.bfloat16}
#: The expert models' routers, which a GGUF file holds in F32 whatever its type.
ROUTERS = ("mlp.gate.weight", "mlp.shared_expert_gate.weight")


def small_tokenizer():
    """A byte-level BPE (GPT-2's split, so llama.cpp's "gpt-2") trained on a few sentences, with ChatML's tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(["The capital of France is Paris. What is the capital of Germany? Berlin, 12 345."] * 8,
                                trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", unk_token="<|endoftext|>", chat_template=CHATML)


def tiny_config(model_type: str = "llama", **overrides):
    """2 layers, hidden 64, 4 query / 2 key-value heads; weights large enough that attention is not uniform."""
    from transformers import AutoConfig

    settings = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1,
                    eos_token_id=2, pad_token_id=2, initializer_range=0.2)
    return AutoConfig.for_model(model_type, **{**settings, **overrides})


def model_dir(path, config, tokenizer=None, seed: int = 0):
    """An HF model directory as the exports write it: (model, its path)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(path)
    (tokenizer or small_tokenizer()).save_pretrained(path)
    return model, str(path)


def read_back(path: str):
    """transformers' reading of the GGUF file ``path`` as GGUF in reads it: (model in float32, tokenizer);
    the file parsed once for both (Note [Reading a GGUF file once] in llama_cp/modules/gguf.py), the
    head size llama.cpp's (Note [A GGUF file's head size])."""
    folder, name = os.path.split(path)
    with reading_once():
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=_file_config(path),
                                                     dtype=torch.float32).eval()
        return model, AutoTokenizer.from_pretrained(folder, gguf_file=name)


def fields(path: str) -> dict:
    import gguf

    reader = gguf.GGUFReader(path)
    out = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("tokenizer.ggml.merges")}
    out["tensors"] = {tensor.name: tensor.tensor_type.name for tensor in reader.tensors}
    return out


def logits(model, tokenizer) -> torch.Tensor:
    ids = torch.tensor([tokenizer(TEXTS[0]).input_ids])
    with torch.no_grad():
        return model(ids).logits


def cast_copy(model, dtype):
    """``model`` with every matrix rounded to ``dtype`` and back (the 1-D tensors and the experts' routers stay
    float32, as in the file: Note [GGUF tensor types])."""
    copy = AutoModelForCausalLM.from_config(model.config).eval()
    copy.load_state_dict({k: v.to(dtype).float() if v.dim() > 1 and not k.endswith(ROUTERS) else v
                          for k, v in model.state_dict().items()})
    return copy
