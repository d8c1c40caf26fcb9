"""DPO's stored reference log-probabilities (Note [Reference log-probabilities computed once] in
llama_cp/train/reference.py) belong to one model: ``reference_key`` names the model's weights, and a
full fine-tune of another model on the same prepared pairs, with the same cache, computes its own
reference instead of reading the first model's. The same model read back, over gloo ranks with cp
and dp: tests/model/test_preference_loss_world2.py (slow)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.distributed as dist

from llama_cp.train.reference import reference_key

SETTINGS = {"rope_theta": 10000.0, "rope_scaling": None, "dtype": "float32", "device": "cpu"}


def _save_model(path, seed: int, layers: int) -> str:
    """A small random-init Llama of ``seed`` with the embedded tokenizer, saved as a model directory."""
    from transformers import LlamaForCausalLM

    from llama_cp.data.tokenizer import byte_tokenizer
    from llama_cp.modules.causal_lm import embedded_llama_config

    torch.manual_seed(seed)
    config = embedded_llama_config(num_hidden_layers=layers, hidden_size=64, intermediate_size=128,
                                   num_attention_heads=4, head_dim=16, vocab_size=260)
    LlamaForCausalLM(config).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return str(path)


def test_the_key_names_the_model(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"  # what the key reads of a model directory: its files' stats
    for directory, size in ((first, 100), (second, 200)):
        directory.mkdir()
        (directory / "config.json").write_text("{}")
        (directory / "model.safetensors").write_bytes(bytes(size))
    first, second = str(first), str(second)
    key = reference_key(first, 0, SETTINGS, "rows")
    assert key == reference_key(first, 0, SETTINGS, "rows")  # read back by a later run of the same model
    assert key != reference_key(second, 0, SETTINGS, "rows")  # another model, same rows and settings
    weights = os.path.join(first, "model.safetensors")
    os.utime(weights, ns=(os.stat(weights).st_atime_ns, os.stat(weights).st_mtime_ns + 10**9))
    assert key != reference_key(first, 0, SETTINGS, "rows")  # the same directory's weights rewritten
    embedded = reference_key(None, 0, SETTINGS, "rows")
    assert embedded != reference_key(None, 1, SETTINGS, "rows")  # the embedded model of another seed
    assert len({embedded, reference_key(None, 0, {**SETTINGS, "dtype": "bfloat16"}, "rows"),
                reference_key(None, 0, SETTINGS, "other rows")}) == 3


@pytest.fixture
def world_of_one(monkeypatch):
    """A process group of one rank for an in-process run, taken down after (one already there is kept)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # the run's init_distributed sets them if unset
        monkeypatch.setenv(name, "0" if name != "WORLD_SIZE" else "1")
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if started and dist.is_initialized():
        dist.destroy_process_group()


def test_another_model_on_the_same_prepared_pairs_computes_its_own_reference(world_of_one, tmp_path):
    """Model A's run stores its reference with the prepared pairs; model B, saved over A in the same
    directory (the prepared rows are keyed by the tokenizer, its path included, so they are shared), on
    the same pairs and cache computes and stores its own, and its first step scores the policy against
    itself: loss log 2, margins 0 (A's reference would give B's first step a margin)."""
    from llama_cp import TrainConfig, Trainer

    with open(tmp_path / "pairs.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"Q{i}: " + "a" * (i % 3), "chosen": " yes" + "!" * (i % 2),
                                "rejected": " no" + "?" * (i % 4)}) + "\n")
    flags = dict(objective="dpo", dataset=str(tmp_path / "pairs.jsonl"), context_length=64, batch_size=2,
                 dtype="float32", eval_fraction=0, data_cache_dir=str(tmp_path / "cache"), report_to="none",
                 max_steps=1, warmup_steps=0, save_every=0)
    said = []
    model = _save_model(tmp_path / "model", seed=0, layers=1)
    first = Trainer(TrainConfig.from_flags(**flags, model_name=model, output_dir=str(tmp_path / "run_a")))
    first._say = said.append
    first.setup()
    stored = list((tmp_path / "cache").glob("*/reference/*-train.npz"))
    assert len(stored) == 1, stored

    said.clear()
    _save_model(model, seed=1, layers=2)  # another model where the first was
    second = Trainer(TrainConfig.from_flags(**flags, model_name=model, output_dir=str(tmp_path / "run_b")))
    second._say = said.append
    second.fit()
    assert not any("read from" in line for line in said), said
    assert any("computed from the initial weights" in line for line in said), said
    assert len(list((tmp_path / "cache").glob("*/reference/*-train.npz"))) == 2  # A's and B's, with one set of rows
    assert len(list((tmp_path / "cache").glob("*/reference"))) == 1
    with open(tmp_path / "run_b" / "metrics.jsonl") as f:
        row = json.loads(f.readline())
    assert row["loss"] == pytest.approx(math.log(2), abs=1e-6) and row["rewards/margins"] == pytest.approx(0, abs=1e-6)
