"""recipes/eval_longctx.py: the grid's rows, the logits it builds, its JSON and heatmap, and
the CLI under torchrun with CP on a model the training recipe taught the passkey task; its own
flags; the perplexity task (documents, rows, per-token losses, CP against a single-process
reference); what rebuilds a LoRA adapter's model (the reload itself: tests/train/test_recipe.py)."""

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

from llama_cp.data.tokenizer import byte_tokenizer
from recipes.eval_longctx import (
    FLAGS, Adapter, cli, long_documents, main, parse_grid, perplexity_row, read_haystack, retrieval_row, write_results,
)

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
    (["--task", "bogus"], "--task must be one of passkey, needle, perplexity, got 'bogus'"),
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


def test_token_losses_are_the_terms_of_the_loss_sum():
    """return_token_losses gives each token's cross-entropy (0 where ignored), from the same chunks
    as the sum, through linear_cross_entropy and through the model's loss path; what the other
    calls return is unchanged."""
    import llama_cp.model.loss as loss
    from llama_cp.modules.causal_lm import build_causal_lm, embedded_llama_config

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 9, 8, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(11, 8, dtype=torch.float64, generator=generator)
    labels = torch.randint(0, 11, (2, 9), generator=generator)
    labels[0, :3] = labels[1, -1] = -100
    want = F.cross_entropy((hidden @ weight.t()).reshape(-1, 11), labels.reshape(-1), reduction="none").reshape(2, 9)
    total, losses = loss.linear_cross_entropy(hidden, weight, labels, chunk_size=4, return_token_losses=True)
    torch.testing.assert_close(losses, want.detach())
    torch.testing.assert_close(total, want.sum())
    assert losses.requires_grad and total.requires_grad  # the token losses carry gradients (DPO)
    _, correct, again = loss.linear_cross_entropy(hidden, weight, labels, chunk_size=5, return_correct=True,
                                                  return_token_losses=True)
    torch.testing.assert_close(again, losses) and correct.shape == (2, 9)
    assert loss.linear_cross_entropy(hidden, weight, labels, chunk_size=4).shape == ()  # a scalar, as before

    torch.manual_seed(0)
    model = loss.enable_chunked_loss(build_causal_lm(embedded_llama_config(num_hidden_layers=1)), chunk_size=16)
    ids = torch.randint(0, 256, (1, 40), generator=generator)
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        total, losses = loss.causal_lm_loss_sum(model, {"input_ids": ids, "labels": labels}, return_token_losses=True)
    want = F.cross_entropy(logits[0], labels[0], reduction="none")
    torch.testing.assert_close(losses[0], want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(total, want.sum(), rtol=1e-5, atol=1e-5)


def test_perplexity_reads_long_documents_into_rows_labelled_as_training(tmp_path):
    """The first documents of >= max(lengths) + 1 tokens, in order, across sources; too few is one
    line naming the longest; a row holds the document's first L tokens with labels as packing
    shifts them (a prompt's tokens unscored)."""
    from llama_cp.data.mixture import DataSpec
    from llama_cp.data.packing import pack_documents
    from llama_cp.data.sources import load_source
    from llama_cp.data_flags import parse_sources

    tokenizer = byte_tokenizer()
    a = _write_jsonl(tmp_path / "a.jsonl", [{"text": "a" * 20}, {"text": "b" * 70}, {"text": "c" * 40}])
    b = _write_jsonl(tmp_path / "b.jsonl", [{"prompt": "q" * 30, "completion": "d" * 50}])
    c = _write_jsonl(tmp_path / "c.jsonl", [{"text": "e" * 90}, {"text": "f" * 90}])

    def read(dataset, min_tokens, count):
        parts = ((s, load_source(s, "all")) for s in parse_sources(dataset))
        return long_documents(parts, tokenizer, min_tokens, count, spec=DataSpec(dataset), name=f"--dataset {dataset!r}")

    documents = read(f"{a},{b},{c}", 65, 3)  # bos + 70 bytes + eos = 72 tokens, then the 82-token prompt/completion
    assert [tokenizer.decode(ids[1:3]) for ids, _ in documents] == ["bb", "qq", "ee"]
    assert all(len(ids) == len(mask) == 65 for ids, mask in documents)
    with pytest.raises(ValueError, match=r"--dataset '.*a.jsonl': only 1 of its 3 documents hold at least 65 tokens "
                                         r"\(the longest length \+ 1, the last label\), 2 wanted; the longest has 72"):
        read(a, 65, 2)
    with pytest.raises(ValueError, match="none of its 3 documents holds at least 100 tokens"):
        read(a, 100, 1)
    ids, mask = read(b, 82, 1)[0]
    row = perplexity_row((ids, mask), 64)
    packed = pack_documents([(ids, mask)], 82)[0]
    assert torch.equal(row["input_ids"], packed["input_ids"][:64]) and torch.equal(row["labels"], packed["labels"][:64])
    assert torch.equal(row["position_ids"], torch.arange(64))
    assert (row["labels"][:30] == -100).all() and (row["labels"][31:] != -100).all()  # the prompt is not scored


def test_adapter_settings_are_read_and_unusable_adapters_refused(tmp_path):
    """An adapter directory gives the flags of its base (llama_cp_export.json's embedded seed and
    RoPE, else base_model_name_or_path) and its LoRA shape; one that cannot be rebuilt is one line."""
    def adapter(name, config, info=None):
        os.makedirs(tmp_path / name)
        config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
                  "base_model_name_or_path": None, **config}
        (tmp_path / name / "adapter_config.json").write_text(json.dumps(config))
        if info is not None:
            (tmp_path / name / "llama_cp_export.json").write_text(json.dumps(info))
        return str(tmp_path / name)

    embedded = Adapter.read(adapter("embedded", {}, {"model_name": "embedded", "seed": 3, "rope_theta": 1e6,
                                                      "rope_scaling": "none", "context_length": 512}))
    assert embedded.flags == {"model_name": "embedded", "seed": 3, "use_peft": True, "lora_r": 4, "lora_alpha": 8,
                              "lora_target_modules": ("q_proj", "v_proj"), "lora_target_parameters": (),
                              "use_rslora": False, "use_dora": False, "lora_modules_to_save": (),
                              "rope_theta": 1e6, "rope_scaling": "none"}
    hub = Adapter.read(adapter("hub", {"base_model_name_or_path": "org/base", "use_rslora": True, "use_dora": True,
                                       "modules_to_save": ["embed_tokens", "norm"]}))
    assert hub.flags["model_name"] == "org/base" and "seed" not in hub.flags
    assert hub.flags["use_rslora"] and hub.flags["use_dora"] and hub.flags["lora_modules_to_save"] == ("embed_tokens",
                                                                                                        "norm")
    assert Adapter.read("embedded") is None and Adapter.read(str(tmp_path)) is None
    for name, config, message in [
        ("pattern", {"rank_pattern": {"q_proj": 16}}, "per-module ranks"),
        ("regex", {"target_modules": "all-linear", "base_model_name_or_path": "org/base"}, "the pattern 'all-linear'"),
        ("orphan", {}, "names no base model"),
    ]:
        with pytest.raises(ValueError, match=message):
            Adapter.read(adapter(name, config))


def test_eval_perplexity_needs_natural_text():
    from llama_cp.config import TrainConfig

    with pytest.raises(ValueError, match="^--eval_perplexity measures the loss on natural text, and the passkey task"):
        TrainConfig.from_flags(eval_perplexity=True)


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
