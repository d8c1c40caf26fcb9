"""recipes/eval_longctx.py: the grid's rows, the logits it builds, its JSON and heatmap, and
the CLI under torchrun with CP on a model the training recipe taught the passkey task."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from llama_cp.data.tokenizer import byte_tokenizer
from recipes.eval_longctx import parse_grid, read_haystack, retrieval_row, write_results

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    chunk_logits = loss._chunk_logits
    monkeypatch.setattr(loss, "_chunk_logits", lambda hidden, *a: rows.append(hidden.shape[0]) or chunk_logits(hidden, *a))
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


def run_eval(output_dir, *flags, nproc=1):
    launcher = [sys.executable, "-m", "recipes.eval_longctx"]
    if nproc > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                    "-m", "recipes.eval_longctx"]
    result = subprocess.run([*launcher, "--output_dir", str(output_dir), *flags], capture_output=True, text=True,
                            cwd=ROOT, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    with open(os.path.join(output_dir, "needle.json")) as f:
        return json.load(f), result.stdout


#: The default job (1024-token rows, one per step, 200 steps, the passkey warm-up and a one-digit
#: key), with fewer log rows. Measured (docs/recipe.md): 1.00 held-out accuracy on 5 seeds; 68 s
#: with one thread.
DEFAULT_RUN = ["--num_eval_samples", "16", "--log_every", "25", "--report_to", "none"]


@pytest.mark.slow
def test_the_default_job_learns_retrieval_and_the_eval_sees_it_under_cp(tmp_path):
    """The default job learns to retrieve the passkey from full 1024-token rows: its held-out
    accuracy goes from 0 (the untrained model) to >= 0.9 (chance: 0.1, one digit and eos), printed
    as one line; --eval_needle writes the trained model's grid (lengths 256 to 1024, every
    depth), and the eval CLI on the exported final/ under torchrun --cp 2 gives the same row."""
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "recipes.finetune_longctx", *DEFAULT_RUN, "--eval_needle", "--output_dir", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=600,  # torch's own threads, as the README's command runs
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = re.search(r"passkey accuracy on 16 held-out rows of 1024 tokens: (\S+) before training -> (\S+) after",
                     result.stdout)
    assert line is not None, result.stdout[-3000:]
    assert float(line[1]) == 0.0 and float(line[2]) >= 0.9, line[0]
    with open(out / "needle.json") as f:
        trained = json.load(f)
    assert trained["lengths"] == [256, 512, 1024] and trained["digits"] == 1 and trained["num_samples"] == 4
    assert trained["overall"] >= 0.9, trained
    assert (out / "needle.png").exists()
    cp2, stdout = run_eval(tmp_path / "cp2", "--model_name", str(out / "final"), "--lengths", "1024",
                           "--num_samples", "4", "--cp", "2", "--passkey_digits", "1", nproc=2)
    assert cp2["accuracy"] == trained["accuracy"][-1:], (cp2, trained)
    assert f"passkey accuracy (1-digit keys, 4 samples per cell), overall {cp2['overall']:.2f}" in stdout
