"""recipes/eval_longctx.py: the CLI under torchrun with CP (perplexity against a single-process
reference; the passkey grid on a model the training recipe taught: tests/train/test_notebook.py),
its own flags, and its refusals before anything is loaded. The library it runs: the other
tests of tests/eval/."""

import inspect
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from recipes.eval_longctx import FLAGS, cli, main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_eval(output_dir, *flags, nproc=1, name="needle"):
    launcher = [sys.executable, "-m", "recipes.eval_longctx"]
    if nproc > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                    "-m", "recipes.eval_longctx"]
    result = subprocess.run([*launcher, "--output_dir", str(output_dir), *flags], capture_output=True, text=True,
                            cwd=ROOT, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    with open(os.path.join(output_dir, f"{name}.json")) as f:
        return json.load(f), result.stdout


def test_help_lists_its_own_flags_only(capsys):
    """``python -m recipes.eval_longctx --help`` lists the parameters of its main, each with its
    default and one line, not the ~60 training flags (it printed TrainConfig.help)."""
    cli(["--help"])
    out = capsys.readouterr().out
    assert list(FLAGS) == list(inspect.signature(main).parameters)
    for name, doc in FLAGS.items():
        assert f"\n  --{name} (default " in out and doc in out, name
    assert "--depths (default 0,0.25,0.5,0.75,1): " in out and "--dataset (default none): " in out
    assert "--context_length" not in out and "--lora_r" not in out


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return str(path)


@pytest.mark.parametrize("flags, message", [
    (["--num_sample", "4"], "unknown flag --num_sample; did you mean --num_samples?"),
    (["--task", "bogus"], "--task must be one of passkey, needle, perplexity, ruler, ruler_multikey, ruler_multivalue, "
                            "ruler_variables, ruler_common_words, ruler_multiquery, ruler_frequent_words, got 'bogus'"),
    (["--lengths", "250", "--cp", "2"], "--lengths: 250 is not a multiple of 2 x cp = 4"),
    (["--task", "perplexity"], "--task perplexity needs --dataset"),
    (["--task", "perplexity", "--dataset", "passkey"], "the passkey task is not natural text"),
    (["--task", "perplexity", "--dataset", "/no/such/docs.jsonl"], "--dataset '/no/such/docs.jsonl': no such file"),
    (["--task", "perplexity", "--dataset", "DOCS", "--buckets", "0"], "--buckets must be a whole number from 1"),
    (["--task", "perplexity", "--dataset", "DOCS:0.5,DOCS:0.5"], "perplexity reads the sources in turn"),
    (["--dataset", "DOCS"], "--dataset is read by --task perplexity"),
])
def test_unknown_flags_and_bad_values_are_refused_before_anything_is_loaded(tmp_path, monkeypatch, capsys, flags,
                                                                            message):
    """One line on stderr, exit status 1, and no process group or model (fire ran the whole eval
    and complained about a mistyped flag after)."""
    import llama_cp.model.build
    import llama_cp.parallel.mesh

    def loaded(*args, **kwargs):
        raise AssertionError("the eval started")

    monkeypatch.setattr(llama_cp.parallel.mesh, "init_distributed", loaded)
    monkeypatch.setattr(llama_cp.model.build, "build_model", loaded)
    docs = _write_jsonl(tmp_path / "docs.jsonl", [{"text": "x" * 300}])
    with pytest.raises(SystemExit) as stop:
        cli(["--model_name", "embedded", *[flag.replace("DOCS", docs) for flag in flags]])
    assert stop.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


@pytest.mark.slow  # a torchrun of the command (end to end); .ci/run's floors job runs it by name too
def test_perplexity_under_cp_2_equals_a_single_process_reference(tmp_path):
    """--task perplexity under torchrun --cp 2 (ring) on the embedded model: per length and per
    position bucket, the loss of the first L tokens of the first 3 documents of >= 257 tokens (a
    short one skipped), as plain transformers computes it in one process from the full logits."""
    from transformers import LlamaForCausalLM

    from llama_cp.modules.causal_lm import embedded_llama_config

    texts = [f"{index} the quick brown fox jumps over the lazy dog. " * count
             for index, count in enumerate((2, 7, 6, 9, 8))]  # 90 to 400 bytes: the first is too short
    docs = _write_jsonl(tmp_path / "docs.jsonl", [{"text": text} for text in texts])
    got, stdout = run_eval(tmp_path / "cp2", "--model_name", "embedded", "--task", "perplexity", "--dataset", docs,
                           "--lengths", "128,256", "--num_samples", "3", "--buckets", "4", "--cp", "2",
                           nproc=2, name="perplexity")
    assert (tmp_path / "cp2" / "perplexity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    torch.manual_seed(0)  # build_model's init of the embedded model (--seed 0)
    model = LlamaForCausalLM(embedded_llama_config()).eval()
    rows = torch.tensor([[257, *text.encode()][:257] for text in texts[1:4]])  # bos, then the bytes
    with torch.no_grad():
        logits = model(input_ids=rows[:, :256]).logits
    token_losses = F.cross_entropy(logits.transpose(1, 2), rows[:, 1:], reduction="none")  # (3, 256)
    assert got["documents"] == 3 and got["lengths"] == [128, 256] and got["buckets"] == 4
    for result in got["per_length"]:
        length = result["length"]
        losses = token_losses[:, :length]  # causal: the first L positions do not see the rest
        assert result["tokens"] == 3 * length
        assert result["loss"] == pytest.approx(losses.mean().item(), rel=1e-5)
        assert result["perplexity"] == pytest.approx(math.exp(result["loss"]), rel=1e-12)
        quarter = length // 4
        assert [(b["start"], b["end"], b["tokens"]) for b in result["buckets"]] == [
            (k * quarter, (k + 1) * quarter, 3 * quarter) for k in range(4)]
        for k, bucket in enumerate(result["buckets"]):
            assert bucket["loss"] == pytest.approx(losses[:, k * quarter:(k + 1) * quarter].mean().item(), rel=1e-5)
        assert re.search(rf"^ +{length} +{3 * length} +{result['loss']:.4f} ", stdout, re.M), stdout
