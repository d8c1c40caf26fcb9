"""``llama_cp.model.build.model_path``: a hub id's snapshot holds every file a model directory
needs to load as it was saved (weights, config, tokenizer, chat template)."""

import fnmatch
import os
import shutil

import huggingface_hub
from transformers import AutoTokenizer, LlamaForCausalLM

from llama_cp.data.tokenizer import byte_tokenizer
from llama_cp.model.build import model_path
from llama_cp.modules.causal_lm import embedded_llama_config

TEMPLATE = "{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}<|eos|>{% endfor %}"


def test_a_hub_snapshot_fetches_every_file_a_saved_model_needs(tmp_path, monkeypatch):
    """transformers saves a chat template as chat_template.jinja: a snapshot restricted to other
    patterns loaded the tokenizer without its template, and chat data was then rendered without it."""
    saved = tmp_path / "saved"
    LlamaForCausalLM(embedded_llama_config(num_hidden_layers=1)).save_pretrained(saved)
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(saved)
    fetched = {}

    def snapshot_download(repo_id, allow_patterns):  # the hub, as a folder of what was uploaded
        fetched["patterns"] = allow_patterns
        local = tmp_path / "snapshot"
        for name in os.listdir(saved):
            if any(fnmatch.fnmatch(name, pattern) for pattern in allow_patterns):
                local.mkdir(exist_ok=True)
                shutil.copy(saved / name, local / name)
        return str(local)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    path = model_path("org/model")
    assert sorted(os.listdir(path)) == sorted(os.listdir(saved)), fetched["patterns"]
    assert AutoTokenizer.from_pretrained(path).chat_template == TEMPLATE
