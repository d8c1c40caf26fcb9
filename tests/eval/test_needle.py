"""llama_cp/eval/needle.py and plots.py: the grid's flags, its rows, the logits it builds, its
JSON and heatmap."""

import json
import os

import pytest
import torch

from llama_cp.data.tokenizer import byte_tokenizer
from llama_cp.eval.needle import parse_grid, read_haystack, retrieval_row
from llama_cp.eval.plots import write_results


def test_grid_flags_are_checked():
    assert parse_grid("512,256", "0,0.5,1", cp=2) == ([256, 512], [0.0, 0.5, 1.0])
    assert parse_grid((256,), (0.25,)) == ([256], [0.25]) == parse_grid(256, 0.25)
    with pytest.raises(ValueError, match=r"^--lengths: 250 is not a multiple of 2 x cp = 4$"):
        parse_grid("256,250", "0", cp=2)
    with pytest.raises(ValueError, match=r"^--depths are fractions of the filler in \[0, 1\], got \[0.0, 1.5\]$"):
        parse_grid("256", "0,1.5")
    with pytest.raises(ValueError, match="^--lengths and --depths are comma-separated numbers"):
        parse_grid("256,x", "0")


@pytest.mark.parametrize("task, needle, question", [
    ("passkey", "The pass key is {key}. Remember it.", "What is the pass key? The pass key is "),
    ("needle", "The special magic number is {key}.", "The special magic number is "),
])
def test_rows_train_only_the_key_at_the_depth(task, needle, question):
    tokenizer = byte_tokenizer()
    rows = {depth: retrieval_row(task, tokenizer, 512, depth, seed=0, index=0, filler=["The sky is blue. "])
            for depth in (0.0, 1.0)}
    for depth, row in rows.items():
        text = tokenizer.decode(row["input_ids"])
        key = tokenizer.decode(row["labels"][row["labels"] != -100])
        assert len(key) == 5 and key.isdigit() and row["input_ids"].shape == (512,)
        assert text.endswith(question + key + "<|eos|>")  # the eos closes the row but is not scored
        where = text.index(needle.format(key=key))
        assert (where < 20) if depth == 0.0 else (where > 300)
    assert retrieval_row(task, tokenizer, 512, 0.5, 0, 1, ["x. "])["labels"].ne(-100).sum() == 5
    one = retrieval_row(task, tokenizer, 512, 0.5, 0, 1, ["x. "], digits=1)  # the embedded default's key
    key = tokenizer.decode(one["labels"][one["labels"] != -100])
    assert len(key) == 1 and key.isdigit() and tokenizer.decode(one["input_ids"]).endswith(question + key + "<|eos|>")


def test_haystack_file_gives_the_filler(tmp_path):
    (tmp_path / "essay.txt").write_text("First line. Second\nline. Third")
    assert read_haystack(str(tmp_path / "essay.txt")) == ["First line. ", "Second line. ", "Third. "]
    (tmp_path / "blank.txt").write_text("  \n")
    with pytest.raises(ValueError, match="holds no text"):
        read_haystack(str(tmp_path / "blank.txt"))


def test_eval_builds_logits_for_the_labelled_tokens_only(monkeypatch):
    """Without grad, the chunked loss's correct-mask path computes the logits of the labelled
    rows alone, with the same loss and mask as the full path."""
    import llama_cp.model.cross_entropy as cross_entropy
    import llama_cp.model.loss as loss
    from llama_cp.modules.causal_lm import build_causal_lm, embedded_llama_config

    torch.manual_seed(0)
    model = loss.enable_chunked_loss(build_causal_lm(embedded_llama_config(num_hidden_layers=1)), chunk_size=16)
    ids = torch.randint(0, 256, (2, 64))
    labels = torch.full((2, 64), -100)
    labels[0, 10:13], labels[1, 60] = ids[0, 11:14], ids[1, 61]
    full_loss, full_correct = loss.causal_lm_loss_sum(model, {"input_ids": ids, "labels": labels},
                                                      return_correct=True)
    rows = []
    chunk_logits = cross_entropy._chunk_logits
    monkeypatch.setattr(cross_entropy, "_chunk_logits",
                        lambda hidden, *a: rows.append(hidden.shape[0]) or chunk_logits(hidden, *a))
    with torch.no_grad():
        got_loss, got_correct = loss.causal_lm_loss_sum(model, {"input_ids": ids, "labels": labels},
                                                        return_correct=True)
    assert rows == [4]
    torch.testing.assert_close(got_loss, full_loss.detach())
    assert torch.equal(got_correct, full_correct) and got_correct.shape == (2, 64)


def test_results_are_written_as_json_and_heatmap(tmp_path):
    result = {"task": "passkey", "digits": 5, "lengths": [256, 512], "depths": [0.0, 0.5, 1.0], "num_samples": 4,
              "accuracy": [[1.0, 0.75, 0.5], [0.25, 0.0, 1.0]], "overall": 3.5 / 6}
    write_results(result, str(tmp_path / "eval"))
    assert json.loads((tmp_path / "eval" / "needle.json").read_text()) == result
    assert (tmp_path / "eval" / "needle.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(tmp_path / "eval")) == ["needle.json", "needle.png"]
