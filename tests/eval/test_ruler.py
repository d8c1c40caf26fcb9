"""llama_cp/eval/ruler.py: each RULER-style task's rows (exact length, the answer the text implies,
labels on it alone, deterministic), teacher-forced scoring against plain transformers' greedy
generate(), the table and plot, the refusals, and the CLI under torchrun --cp 2 against a
single-process reference."""

import collections
import json
import os
import re

import pytest
import torch

from llama_cp.data.tokenizer import byte_tokenizer
from llama_cp.eval.plots import write_results
from llama_cp.eval.ruler import (RULER_TASKS, _separate_top, chat_frame, format_ruler, plot_ruler, ruler_row,
                                 score_row)

LENGTH = 1024  # bytes: the multi-needle tasks need about 500 with the byte tokenizer


def plain_tokenizer():
    """The byte tokenizer without its chat template: rows are plain text after bos."""
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = None
    return tokenizer


def expected_answer(task: str, text: str) -> str:
    """The answer, worked out from the row's text alone (the reply's prefix cut off)."""
    prompt = text[: text.rindex(":") + 1]  # the reply's prefix ends with the last colon
    if task == "ruler_multikey":
        key = re.search(r"What is the special magic number for (\w+)", prompt).group(1)
        (value,) = re.findall(rf"magic numbers for {key} is: (\d+)\. ", prompt)
        return " " + value
    if task == "ruler_multivalue":
        key = re.search(r"What are all the special magic numbers for (\w+)", prompt).group(1)
        return " " + ", ".join(re.findall(rf"magic numbers for {key} is: (\d+)\. ", prompt))
    if task == "ruler_variables":
        value = re.search(r"holds the value (\d+)", prompt).group(1)
        holders = []
        for name, source in re.findall(r"VAR (\w+) = (?:VAR )?(\w+)\. ", prompt):  # in the order assigned
            if source == value or source in holders:
                holders.append(name)
        return " " + ", ".join(holders)
    if task == "ruler_multiquery":
        named = re.search(r"What are the special magic numbers for (.+) mentioned in", prompt).group(1)
        keys = re.split(r", | and ", named)
        assert len(keys) == len(set(keys)) >= 2
        values = [re.findall(rf"magic numbers for {key} is: (\d+)\. ", prompt) for key in keys]
        assert all(len(found) == 1 for found in values)  # each asked key has one needle
        assert len(re.findall(r"magic numbers for \w+ is: ", prompt)) > len(keys)  # and some are not asked
        return " " + ", ".join(found[0] for found in values)
    words = prompt.split("Here is a list of words:")[1].split("\nWhat are")[0].split()
    counts = collections.Counter(words)
    top = sorted(counts, key=lambda word: -counts[word])
    if task == "ruler_frequent_words":
        ranked = [counts[word] for word in top]
        assert ranked[0] > ranked[1] > ranked[2] > ranked[3] and len(counts) > 10, ranked  # one answer
        return " " + ", ".join(top[:3])
    assert min(counts[word] for word in top[:3]) > max(counts[word] for word in top[3:])  # three stand out
    return " " + ", ".join(word for word in dict.fromkeys(words) if word in top[:3])


@pytest.mark.parametrize("template", ["chat", "plain"])
@pytest.mark.parametrize("task", RULER_TASKS)
def test_rows_have_the_length_and_label_only_the_answer(task, template):
    tokenizer = byte_tokenizer() if template == "chat" else plain_tokenizer()
    for length, index in ((LENGTH, 0), (LENGTH, 1), (1536, 0)):
        row = ruler_row(task, tokenizer, length, seed=0, index=index)
        ids, labels = row["input_ids"], row["labels"]
        assert ids.shape == labels.shape == row["position_ids"].shape == (length,)
        labelled = (labels != -100).nonzero().flatten()
        n = len(labelled)  # labels are shifted: the answer is the last n tokens, labelled at the n before
        assert labelled.tolist() == list(range(length - n - 1, length - 1))
        assert torch.equal(labels[labelled], ids[length - n:])
        text = tokenizer.decode(ids)
        answer = tokenizer.decode(ids[length - n:])
        assert answer == expected_answer(task, text), (answer, text[-300:])
        before, after = chat_frame(tokenizer)
        assert text.startswith(before) and after in text[-300:]
        if template == "plain":
            assert ids[0] == tokenizer.bos_token_id and "<|eos|>" not in text
        else:
            assert text.startswith("<|bos|>user\n") and "<|eos|><|bos|>assistant\n" in text


def test_rows_are_a_function_of_task_seed_length_and_index():
    tokenizer = byte_tokenizer()
    for task in RULER_TASKS:
        row = ruler_row(task, tokenizer, LENGTH, 3, 5)
        assert torch.equal(row["input_ids"], ruler_row(task, tokenizer, LENGTH, 3, 5)["input_ids"])
        for other in ((LENGTH, 3, 6), (LENGTH, 4, 5)):
            assert not torch.equal(row["input_ids"], ruler_row(task, tokenizer, *other)["input_ids"])
    answers = {tokenizer.decode(ruler_row("ruler_multikey", tokenizer, LENGTH, 0, i)["labels"].clamp(min=0)[-9:-1])
               for i in range(6)}
    assert len(answers) == 6


def test_the_frequent_words_cut_ranks_the_first_three_strictly_above_the_rest():
    """Whatever the draws: ties are cut, and a later word drawn more often is cut below the third."""
    assert _separate_top({"a": 5, "b": 5, "c": 5, "d": 5, "e": 1}, 3) == {"a": 5, "b": 4, "c": 3, "d": 2, "e": 1}
    assert _separate_top({"a": 3, "b": 9, "c": 1, "d": 4}, 3) == {"a": 3, "b": 2, "c": 1, "d": 0}
    assert _separate_top({"a": 9, "b": 6, "c": 4, "d": 3}, 3) == {"a": 9, "b": 6, "c": 4, "d": 3}


def test_a_length_too_short_names_the_flag_and_the_shortfall():
    for task in RULER_TASKS:
        with pytest.raises(ValueError, match=rf"^--lengths 256 is too short for --task {task}: .* \d+ tokens more$"):
            ruler_row(task, byte_tokenizer(), 256, 0, 0)


@pytest.fixture(scope="module")
def tiny_models():
    """A random one-layer Llama over the byte tokenizer's 259 ids, as plain transformers runs it
    (generate), and the same weights with our chunked loss (what the eval scores with)."""
    from transformers import LlamaForCausalLM

    from llama_cp.model.loss import enable_chunked_loss
    from llama_cp.modules.causal_lm import embedded_llama_config

    config = embedded_llama_config(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, vocab_size=259)
    torch.manual_seed(0)
    plain = LlamaForCausalLM(config).eval()
    plain.generation_config.eos_token_id = None  # generate exactly the tokens asked for
    plain.generation_config.pad_token_id = 256
    scored = LlamaForCausalLM(config).eval()
    scored.load_state_dict(plain.state_dict())
    return plain, enable_chunked_loss(scored, chunk_size=64)


@pytest.mark.parametrize("task", RULER_TASKS)
def test_teacher_forced_right_iff_greedy_generation_writes_the_answer(task, tiny_models):
    """Note [Scoring RULER-style tasks by teacher forcing]: the row's own answer (the random model
    misses it), the row whose answer is what greedy decoding writes (right), and that answer with
    one token changed (wrong at that token, and at none before it)."""
    plain, scored = tiny_models
    row = ruler_row(task, byte_tokenizer(), LENGTH, seed=0, index=0)
    n = int((row["labels"] != -100).sum())
    prompt = row["input_ids"][None, :-n]
    with torch.no_grad():
        greedy = plain.generate(prompt, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(prompt))
    greedy = greedy[0, -n:]

    def score(answer):
        ids = torch.cat([prompt[0], answer])
        labels = torch.full_like(ids, -100)
        labels[-n - 1:-1] = answer
        with torch.no_grad():
            wrong, right, tokens, loss = score_row(scored, {"input_ids": ids[None], "labels": labels[None]}).tolist()
        assert tokens == n and wrong + right == n and loss > 0
        return wrong, right

    own = row["input_ids"][-n:]
    assert (score(own)[0] == 0) == torch.equal(greedy, own)
    assert not torch.equal(greedy, own)
    assert score(greedy) == (0, n)
    for at in (0, n // 2, n - 1):
        changed = greedy.clone()
        changed[at] = (changed[at] + 1) % 256
        wrong, right = score(changed)  # the tokens before the change are greedy's, so right; it is not
        assert wrong >= 1 and right >= at


def test_results_are_written_as_json_table_and_plot(tmp_path):
    result = {"tasks": list(RULER_TASKS[:2]), "lengths": [1024, 2048], "num_samples": 4, "seed": 0,
              "accuracy": {"ruler_multikey": [0.75, 0.5], "ruler_multivalue": [0.25, 0.0]},
              "token_accuracy": {"ruler_multikey": [0.9, 0.8], "ruler_multivalue": [0.6, 0.5]},
              "answer_loss": {"ruler_multikey": [0.4, 0.6], "ruler_multivalue": [1.2, 1.5]}, "overall": 0.375}
    write_results(result, str(tmp_path), "ruler", plot=plot_ruler)
    assert json.loads((tmp_path / "ruler.json").read_text()) == result
    assert (tmp_path / "ruler.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(tmp_path)) == ["ruler.json", "ruler.png"]
    text = format_ruler(result)
    assert "overall 0.38" in text
    assert re.search(r"^ruler_multikey +0\.75 \(0\.90\) +0\.50 \(0\.80\)$", text, re.M), text
    assert re.search(r"^ruler_multivalue +0\.25 \(0\.60\) +0\.00 \(0\.50\)$", text, re.M), text


@pytest.mark.parametrize("flags, message", [
    (["--task", "ruler", "--depths", "0.5"], "--depths is read by --task passkey / needle, not --task ruler: drop it"),
    (["--task", "ruler_variables", "--passkey_digits", "3"],
     "--passkey_digits is read by --task passkey / needle, not --task ruler_variables: drop it"),
    (["--task", "ruler_multikey", "--dataset", "x.jsonl"], "--dataset is read by --task perplexity"),
    (["--task", "ruler_common_words", "--num_samples", "0"], "--num_samples must be >= 1, got 0"),
])
def test_refusals_are_one_line_before_anything_is_loaded(monkeypatch, capsys, flags, message):
    import llama_cp.model.build
    import llama_cp.parallel.mesh
    from recipes.eval_longctx import cli

    def loaded(*args, **kwargs):
        raise AssertionError("the eval started")

    monkeypatch.setattr(llama_cp.parallel.mesh, "init_distributed", loaded)
    monkeypatch.setattr(llama_cp.model.build, "build_model", loaded)
    with pytest.raises(SystemExit) as stop:
        cli(["--model_name", "embedded", *flags])
    assert stop.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


@pytest.mark.slow  # a torchrun of the command, as tests/eval/test_eval_longctx.py runs perplexity
def test_ruler_under_cp_2_equals_a_single_process_reference(tmp_path):
    """--task ruler under torchrun --cp 2 (ring) on the embedded model: per task, accuracy, answer
    tokens right and answer loss as plain transformers computes them in one process from the
    full logits of the same rows."""
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM

    from llama_cp.modules.causal_lm import embedded_llama_config
    from test_eval_longctx import run_eval

    got, stdout = run_eval(tmp_path / "cp2", "--model_name", "embedded", "--task", "ruler", "--lengths", str(LENGTH),
                           "--num_samples", "3", "--cp", "2", "--seed", "1", nproc=2, name="ruler")
    assert got["tasks"] == list(RULER_TASKS) and got["lengths"] == [LENGTH] and got["num_samples"] == 3
    assert (tmp_path / "cp2" / "ruler.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    torch.manual_seed(0)  # build_model's init of the embedded model
    model = LlamaForCausalLM(embedded_llama_config()).eval()
    tokenizer = byte_tokenizer()
    for task in RULER_TASKS:
        rows = [ruler_row(task, tokenizer, LENGTH, 1, index) for index in range(3)]
        ids, labels = torch.stack([r["input_ids"] for r in rows]), torch.stack([r["labels"] for r in rows])
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        labelled = labels != -100
        right = (logits.argmax(-1) == labels) & labelled
        loss = F.cross_entropy(logits[labelled], labels[labelled], reduction="sum")
        assert got["accuracy"][task] == [(right.sum(1) == labelled.sum(1)).float().mean().item()]
        assert got["token_accuracy"][task] == [pytest.approx(right.sum().item() / labelled.sum().item(), abs=1e-12)]
        assert got["answer_loss"][task] == [pytest.approx(loss.item() / labelled.sum().item(), rel=1e-5)]
        assert re.search(rf"^{task} +{got['accuracy'][task][0]:.2f} ", stdout, re.M), stdout
    assert any(value > 0 for values in got["token_accuracy"].values() for value in values)  # not all trivially 0
