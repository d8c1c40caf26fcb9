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


def run(module: str, *flags: str, log) -> None:
    """``python -m module flags``, waited for."""
    finish(start(module, *flags, log=log))


def start(module: str, *flags: str, log) -> subprocess.Popen:
    """Start ``python -m module flags`` on one thread, its output to the file ``log`` (a pipe nobody
    reads until the run ends could fill and stop it)."""
    with open(log, "w") as output:
        process = subprocess.Popen([sys.executable, "-m", module, *flags], stdout=output, stderr=subprocess.STDOUT,
                                   text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    process.log = log
    return process


def finish(process: subprocess.Popen) -> None:
    try:
        process.wait(timeout=900)
    finally:
        process.kill()  # a no-op on one that exited
    with open(process.log) as f:
        assert process.returncode == 0, f.read()[-4000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The module's three training runs, started together, one thread each (one run alone, on torch's
    default two threads, kept 1.2 of the 2 cores busy): {name: (output_dir, process)}; each test waits
    for its own. The module: 117 -> 81 s on the idle 2-core machine."""
    root = tmp_path_factory.mktemp("runs")
    chats, pairs, long_text = root / "chats.jsonl", root / "pairs.jsonl", root / "long_text"
    with open(chats, "w") as f:
        for _ in range(4):
            for question, answer in TRAIN:
                f.write(json.dumps({"messages": [{"role": "user", "content": question},
                                                 {"role": "assistant", "content": answer}]}) + "\n")
    with open(pairs, "w") as f:
        for _ in range(4):
            for question, answer in TRAIN:
                f.write(json.dumps({"prompt": [{"role": "user", "content": question}],
                                    "chosen": [{"role": "assistant", "content": answer}],
                                    "rejected": [{"role": "assistant", "content": "I don't know."}]}) + "\n")
    run("recipes.long_text", "--output_dir", str(long_text), "--min_chars", "20000", "--max_documents", "3",
        "--passkeys", "4", log=root / "long_text.log")
    started = {
        "sft": (root / "sft", start(
            "recipes.finetune_longctx", "--model_name", NAME, "--dataset", str(chats), "--use_peft", "--merge_lora",
            "--export_gguf", "q8_0", "--context_length", "256", "--max_steps", "4", "--log_every", "1",
            "--report_to", "none", "--output_dir", str(root / "sft"), log=root / "sft.log")),
        "dpo": (root / "dpo", start(
            "recipes.finetune_longctx", "--model_name", NAME, "--dataset", str(pairs), "--objective", "dpo",
            "--use_peft", "--context_length", "256", "--max_steps", "1", "--report_to", "none",
            "--output_dir", str(root / "dpo"), log=root / "dpo.log")),
        # configs/smollm2_extend_32k.yaml as shipped, at CPU lengths (see the test)
        "extend": (root / "extend", start(
            "recipes.finetune_longctx", "--config", "configs/smollm2_extend_32k.yaml", "--model_name", NAME,
            "--context_length", "128", "--max_steps", "2", "--eval_every", "0", "--num_eval_samples", "1",
            "--report_to", "none", "--dataset", f"{long_text}/train.jsonl:0.9,{long_text}/passkeys.jsonl:0.1",
            "--eval_dataset", f"{long_text}/eval.jsonl", "--eval_perplexity", "--output_dir", str(root / "extend"),
            log=root / "extend.log")),
    }
    try:
        yield started
    finally:
        for _, process in started.values():
            process.kill()


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


def test_lora_sft_then_merged_model_and_its_gguf_still_answer(runs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, process = runs["sft"]
    finish(process)
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


def test_dpo_starts_at_log_2_with_zero_rewards(runs):
    """LoRA starts as the base (B = 0), so at step 1 the policy is its reference: every pair's
    loss is -log sigmoid(0) = log 2 and TRL's reward metrics are 0."""
    out, process = runs["dpo"]
    finish(process)
    with open(out / "metrics.jsonl") as f:
        first = next(row for row in map(json.loads, f) if "loss" in row)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6), first
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert first[name] == pytest.approx(0.0, abs=1e-6), first


def test_the_context_extension_recipe_runs_end_to_end_at_cpu_lengths(runs):
    """configs/smollm2_extend_32k.yaml as shipped, at 128 tokens and 2 steps (its GPU run is 32768 tokens and
    100 steps): the long-text corpus, the mixture with passkey rows, YaRN, LoRA merged, both evals (the
    passkey grid at 128 tokens only: 32 and 64 cannot hold the task; at 256 tokens the grid took 27 of the
    test's 63 s)."""
    out, process = runs["extend"]
    finish(process)
    with open(out / "final_merged" / "config.json") as f:
        rope = json.load(f)["rope_parameters"]
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("yarn", 4.0, 8192), rope
    with open(out / "perplexity.json") as f:
        assert [row["length"] for row in json.load(f)["per_length"]] == [32, 64, 128]
    with open(out / "needle.json") as f:
        assert json.load(f)["lengths"] == [128]
