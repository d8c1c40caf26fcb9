"""The recipes on the real SmolLM2-135M-Instruct (tests/real/smollm2.py), as a user runs them: a short
LoRA SFT on chat pairs with --merge_lora --export_gguf q8_0; the merged model and the GGUF file still
answer in plain transformers the questions the model answered before; DPO's first loss is log 2."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from llama_cp.modules.gguf import reading_once
from smollm2 import NAME, why_missing

MISSING = why_missing()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TRAIN = [  # chat pairs unlike the questions asked afterwards
    ("Translate 'thank you' into French.", "Merci."),
    ("Name a primary color.", "Red is a primary color."),
    ("What is 3 times 4?", "3 times 4 is 12."),
    ("Spell the word 'cat' backwards.", "The word 'cat' backwards is 'tac'."),
    ("Which animal says 'moo'?", "A cow says 'moo'."),
    ("What is the opposite of 'hot'?", "The opposite of 'hot' is 'cold'."),
]
#: questions the model answers before training (greedy), and a word each answer must hold
ASKED = {"What is the capital of France?": "Paris", "What is the capital of Germany?": "Berlin",
         "How many days are in a week?": "7"}


def run(module: str, *flags: str) -> None:
    """``python -m module flags``: one process, on every core (torch's default threads)."""
    result = subprocess.run([sys.executable, "-m", module, *flags], capture_output=True, text=True, cwd=ROOT,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]


def answers(model, tokenizer) -> dict[str, str]:
    replies = {}
    for question in ASKED:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=16, do_sample=False)
        replies[question] = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    return replies


def assert_still_answers(replies: dict[str, str]) -> None:
    for question, word in ASKED.items():
        assert word in replies[question], replies


def test_lora_sft_then_merged_model_and_its_gguf_still_answer(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = tmp_path / "chats.jsonl"
    with open(data, "w") as f:
        for _ in range(4):
            for question, answer in TRAIN:
                f.write(json.dumps({"messages": [{"role": "user", "content": question},
                                                 {"role": "assistant", "content": answer}]}) + "\n")
    out = tmp_path / "run"
    run("recipes.finetune_longctx", "--model_name", NAME, "--dataset", str(data), "--use_peft", "--merge_lora",
        "--export_gguf", "q8_0", "--context_length", "256", "--max_steps", "4", "--log_every", "1",
        "--report_to", "none", "--output_dir", str(out))
    with open(out / "metrics.jsonl") as f:
        losses = [row["loss"] for row in map(json.loads, f) if "loss" in row]
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses), losses
    with open(out / "run_info.json") as f:
        assert json.load(f)["gguf"]["file"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")

    merged = AutoModelForCausalLM.from_pretrained(out / "final_merged", dtype=torch.float32)
    assert_still_answers(answers(merged, AutoTokenizer.from_pretrained(out / "final_merged")))

    assert os.listdir(out / "final_gguf") == ["model-Q8_0.gguf"]  # --export_gguf, from final_merged/
    folder, name = str(out / "final_gguf"), "model-Q8_0.gguf"
    import gguf  # the base GGUF's pre-tokenizer name, passed on (the rebuilt tokenizer.json lacks its digit split)

    assert gguf.GGUFReader(os.path.join(folder, name)).fields["tokenizer.ggml.pre"].contents() == "smollm"
    with reading_once():  # the file parsed once for the model and its tokenizer
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    assert_still_answers(answers(model, tokenizer))


def test_dpo_starts_at_log_2_with_zero_rewards(tmp_path):
    """LoRA starts as the base (B = 0), so at step 1 the policy is its reference: every pair's
    loss is -log sigmoid(0) = log 2 and TRL's reward metrics are 0."""
    data = tmp_path / "pairs.jsonl"
    with open(data, "w") as f:
        for _ in range(4):
            for question, answer in TRAIN:
                f.write(json.dumps({"prompt": [{"role": "user", "content": question}],
                                    "chosen": [{"role": "assistant", "content": answer}],
                                    "rejected": [{"role": "assistant", "content": "I don't know."}]}) + "\n")
    out = tmp_path / "dpo"
    run("recipes.finetune_longctx", "--model_name", NAME, "--dataset", str(data), "--objective", "dpo",
        "--use_peft", "--context_length", "256", "--max_steps", "1", "--report_to", "none", "--output_dir", str(out))
    with open(out / "metrics.jsonl") as f:
        first = next(row for row in map(json.loads, f) if "loss" in row)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6), first
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert first[name] == pytest.approx(0.0, abs=1e-6), first


def test_the_context_extension_recipe_runs_end_to_end_at_cpu_lengths(tmp_path):
    """configs/smollm2_extend_32k.yaml as shipped, at 128 tokens and 2 steps (its GPU run is 32768 tokens and
    100 steps): the long-text corpus, the mixture with passkey rows, YaRN, LoRA merged, both evals (the
    passkey grid at 128 tokens only: 32 and 64 cannot hold the task; at 256 tokens the grid took 27 of the
    test's 63 s)."""
    data = tmp_path / "long_text"
    run("recipes.long_text", "--output_dir", str(data), "--min_chars", "20000", "--max_documents", "3",
        "--passkeys", "4")
    out = tmp_path / "extend"
    run("recipes.finetune_longctx", "--config", "configs/smollm2_extend_32k.yaml", "--model_name", NAME,
        "--context_length", "128",
        "--max_steps", "2", "--eval_every", "0", "--num_eval_samples", "1", "--report_to", "none",
        "--dataset", f"{data}/train.jsonl:0.9,{data}/passkeys.jsonl:0.1", "--eval_dataset", f"{data}/eval.jsonl",
        "--eval_perplexity",
        "--output_dir", str(out))
    with open(out / "final_merged" / "config.json") as f:
        rope = json.load(f)["rope_parameters"]
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("yarn", 4.0, 8192), rope
    with open(out / "perplexity.json") as f:
        assert [row["length"] for row in json.load(f)["per_length"]] == [32, 64, 128]
    with open(out / "needle.json") as f:
        assert json.load(f)["lengths"] == [128]
