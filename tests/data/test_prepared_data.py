"""Prepared rows (tokenized and packed once, read from disk) and --streaming, against build_rows."""

import json
import os
import random

import pytest
import torch

from llama_cp.config import TrainConfig
from llama_cp.data.formats import tokenize_example
from llama_cp.data.loader import DistributedRowLoader, build_rows
from llama_cp.data.packing import pack_documents
from llama_cp.data.prepared import (
    PreparedRows,
    RowBatches,
    cache_key,
    key_hash,
    load_prepared_rows,
    prepare_dataset,
)
from llama_cp.data.streaming import EVAL_EVERY, StreamingRowLoader, streaming_eval_rows
from llama_cp.data.tokenizer import byte_tokenizer

CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


def write_texts(path, count=60, seed=0):
    """Documents of 0 to 300 characters (some empty, many longer than a 64-token row)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for index in range(count):
            f.write(json.dumps({"text": "".join(rng.choice("abcdefgh ") for _ in range(rng.choice([0, 3, 40, 130, 300])))}) + "\n")
    return str(path)


def assert_rows_equal(expected, got):
    assert len(expected) == len(got)
    for index, (want, row) in enumerate(zip(expected, got)):
        assert row.keys() == want.keys()
        for key in want:
            assert row[key].dtype == want[key].dtype == torch.long
            assert torch.equal(row[key], want[key]), (index, key)


def test_prepared_rows_and_batches_equal_build_rows_and_resume_alike(tokenizer, tmp_path):
    texts = write_texts(tmp_path / "texts.jsonl")
    chats = tmp_path / "chat.jsonl"
    chats.write_text("".join(json.dumps({"messages": CHAT[: 1 + i % 2] + CHAT[1:]}) + "\n" for i in range(30)))
    for dataset in (texts, str(chats)):
        directory, summary = prepare_dataset(dataset, tokenizer, 64, cp=2, cache_dir=str(tmp_path / "cache"))
        assert not summary["reused"]
        for split in ("train", "eval"):
            expected = build_rows(dataset, tokenizer, 64, cp=2, split=split)
            rows = PreparedRows(directory / f"{split}.arrow")
            assert_rows_equal(expected, rows)
            assert summary[split]["rows"] == len(expected)
        # the loader over either gives the same batches, on every dp rank, and resumes alike
        expected, rows = build_rows(dataset, tokenizer, 64, cp=2), PreparedRows(directory / "train.arrow")
        for dp_rank in range(2):
            memory = DistributedRowLoader(expected, 2, dp_rank, 2, seed=3)
            disk = DistributedRowLoader(rows, 2, dp_rank, 2, seed=3)
            taken = [next(it) for it in [iter(disk)] for _ in range(3)]
            resumed = DistributedRowLoader(rows, 2, dp_rank, 2, seed=3)
            resumed.load_state_dict(disk.state_dict())
            assert disk.state_dict() == {"epoch": 0, "batch_index": 3}
            batches = taken + list(resumed) + list(resumed)  # the rest of epoch 0, then epoch 1
            want = list(memory) + list(memory)
            assert len(batches) == len(want) == 2 * memory.steps_per_epoch
            for a, b in zip(want, batches):
                assert_rows_equal([a], [b])


def test_summary_counts_documents_tokens_padding_and_splits(tokenizer, tmp_path):
    dataset = tmp_path / "three.jsonl"  # train: two documents (the third is held out for eval)
    dataset.write_text(json.dumps({"text": "a" * 100}) + "\n" + json.dumps({"text": "b" * 10}) + "\n"
                       + json.dumps({"text": "c"}) + "\n")
    _, summary = prepare_dataset(str(dataset), tokenizer, 64, cache_dir=str(tmp_path / "cache"))
    # 102 + 12 tokens (bos ... eos) in 2 rows of 64: 14 padding tokens; the first document crosses a row end
    assert summary["train"] == {"documents": 2, "rows": 2, "tokens": 114, "padding_fraction": round(14 / 128, 6),
                                "split_documents": 1, "truncated_documents": 0}
    assert summary["eval"] == {"documents": 1, "rows": 1, "tokens": 3, "padding_fraction": round(61 / 64, 6),
                               "split_documents": 0, "truncated_documents": 0}
    # --truncate_documents: the first document keeps its first 64 tokens, the second starts the next row
    directory, summary = prepare_dataset(str(dataset), tokenizer, 64, cache_dir=str(tmp_path / "cache"), truncate=True)
    assert summary["train"] == {"documents": 2, "rows": 2, "tokens": 76, "padding_fraction": round(52 / 128, 6),
                                "split_documents": 0, "truncated_documents": 1}
    rows = PreparedRows(directory / "train.arrow")
    assert_rows_equal(build_rows(str(dataset), tokenizer, 64, truncate=True), rows)
    assert rows[0]["input_ids"].tolist() == [tokenizer.bos_token_id] + [ord("a")] * 63
    assert rows[0]["labels"].tolist() == [ord("a")] * 63 + [-100]  # its eos is gone: the last token has no target
    assert rows[1]["input_ids"][:13].tolist() == [tokenizer.bos_token_id] + [ord("b")] * 10 + [tokenizer.eos_token_id, 256]


def test_two_tokenizing_processes_give_the_same_rows(tokenizer, tmp_path):
    dataset = write_texts(tmp_path / "texts.jsonl", count=40, seed=1)
    one, _ = prepare_dataset(dataset, tokenizer, 64, cache_dir=str(tmp_path / "one"))
    two, _ = prepare_dataset(dataset, tokenizer, 64, cache_dir=str(tmp_path / "two"), num_proc=2)
    assert one.name == two.name  # num_proc is not part of the key: the rows are the same
    assert_rows_equal(PreparedRows(one / "train.arrow"), PreparedRows(two / "train.arrow"))
    assert not any(name.startswith(".") for name in os.listdir(tmp_path / "two"))  # no temporary directory left


def test_cache_key_changes_with_tokenizer_format_context_and_cp_and_rebuilds(tokenizer, tmp_path):
    dataset = tmp_path / "data.jsonl"
    write_texts(dataset, count=30)
    base = key_hash(cache_key(str(dataset), tokenizer, 64, 1))
    other_tokenizer = byte_tokenizer()
    other_tokenizer.add_tokens(["<|extra|>"])
    assert key_hash(cache_key(str(dataset), other_tokenizer, 64, 1)) != base
    assert key_hash(cache_key(str(dataset), tokenizer, 128, 1)) != base
    assert key_hash(cache_key(str(dataset), tokenizer, 64, 2)) != base
    assert key_hash(cache_key(str(dataset), tokenizer, 64, 1, truncate=True)) != base
    assert key_hash(cache_key(str(dataset), byte_tokenizer(), 64, 1)) == base  # the same definition, the same key
    cache = str(tmp_path / "cache")
    first, summary = prepare_dataset(str(dataset), tokenizer, 64, cache_dir=cache)
    assert first.name == base and not summary["reused"]
    again, summary = prepare_dataset(str(dataset), tokenizer, 64, cache_dir=cache)
    assert again == first and summary["reused"]
    # the same file in another format (chat instead of text): another key, new rows, the old ones kept
    dataset.write_text("".join(json.dumps({"messages": CHAT}) + "\n" for _ in range(30)))
    rebuilt, summary = prepare_dataset(str(dataset), tokenizer, 64, cache_dir=cache)
    assert rebuilt != first and not summary["reused"]
    assert_rows_equal(build_rows(str(dataset), tokenizer, 64), PreparedRows(rebuilt / "train.arrow"))
    assert sorted(os.listdir(cache)) == sorted([first.name, rebuilt.name])
    for changed in (dict(context_length=128), dict(cp=2)):
        flags = {"context_length": 64, "cp": 1, **changed}
        directory, summary = prepare_dataset(str(dataset), tokenizer, flags["context_length"], flags["cp"],
                                             cache_dir=cache)
        assert directory not in (first, rebuilt) and not summary["reused"]
        assert_rows_equal(build_rows(str(dataset), tokenizer, **flags), PreparedRows(directory / "train.arrow"))


def test_load_prepared_rows_in_one_process_and_bad_data_errors(tokenizer, tmp_path):
    dataset = write_texts(tmp_path / "texts.jsonl", count=20)
    with open(dataset, "a") as f:
        f.write(json.dumps({"text": "the held-out end, longer than one row of 64 tokens " * 3}) + "\n")
    train, evaluation = load_prepared_rows(dataset, tokenizer, 64, 1, cache_dir=str(tmp_path / "cache"), say=lambda _: None)
    assert_rows_equal(build_rows(dataset, tokenizer, 64), train)
    assert_rows_equal(build_rows(dataset, tokenizer, 64, split="eval"), evaluation)
    batches = RowBatches(evaluation, range(0, len(evaluation)), 2)
    assert len(batches) == -(-len(evaluation) // 2)
    assert torch.equal(batches[0]["input_ids"], torch.stack([evaluation[0]["input_ids"], evaluation[1]["input_ids"]]))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("".join(json.dumps({"text": ""}) + "\n" for _ in range(4)))
    with pytest.raises(ValueError, match=r"^--dataset '.*empty\.jsonl' \(train split\): no usable text: "):
        prepare_dataset(str(empty), tokenizer, 64, cache_dir=str(tmp_path / "cache"))
    assert sorted(os.listdir(tmp_path / "cache")) == [train.path.split(os.sep)[-2]]  # the failed one left nothing


def test_prepare_data_recipe_prints_a_summary_and_reuses_the_cache(tmp_path, capsys):
    from llama_cp.train.cli import run_cli
    from recipes import prepare_data

    dataset = tmp_path / "three.jsonl"
    dataset.write_text(json.dumps({"text": "a" * 100}) + "\n" + json.dumps({"text": "b" * 10}) + "\n"
                       + json.dumps({"text": "c"}) + "\n")
    argv = ["--dataset", str(dataset), "--context_length", "64", "--data_cache_dir", str(tmp_path / "cache")]
    run_cli(prepare_data.main, usage="x", argv=argv)
    out = capsys.readouterr().out
    assert "prepared: " in out
    assert ("train: 2 documents -> 2 rows of 64 tokens, 114 tokens, padding 10.94%, "
            "1 documents split over rows, 0 truncated") in out
    run_cli(prepare_data.main, usage="x", argv=argv)
    assert "already prepared, reused: " in capsys.readouterr().out


# ----------------------------------------------------------------------------- streaming


def stream_split(dataset, tokenizer, dp_rank, dp_size):
    """The documents of dp rank ``dp_rank``'s share and the eval documents, as Note [Streaming rows] says."""
    with open(dataset) as f:
        examples = [json.loads(line) for line in f]
    evaluation = [e for i, e in enumerate(examples) if i % EVAL_EVERY == EVAL_EVERY - 1]
    train = [e for i, e in enumerate(examples) if i % EVAL_EVERY != EVAL_EVERY - 1]
    return [tokenize_example(e, tokenizer) for e in train[dp_rank::dp_size]], [tokenize_example(e, tokenizer) for e in evaluation]


def test_streaming_splits_documents_over_dp_ranks_and_packs_like_build_rows(tokenizer, tmp_path):
    dataset = write_texts(tmp_path / "texts.jsonl", count=50, seed=2)
    for dp_rank in range(2):
        mine, evaluation = stream_split(dataset, tokenizer, dp_rank, 2)
        expected = pack_documents(mine, 64, cp=2, pad_id=tokenizer.pad_token_id)
        loader = StreamingRowLoader(dataset, tokenizer, 64, batch_size=2, dp_rank=dp_rank, dp_size=2)
        batches = iter(loader)
        got = [next(batches) for _ in range(len(expected) // 2)]  # the whole first epoch (whole batches only)
        assert_rows_equal(expected[: 2 * len(got)], [{k: b[k][i] for k in b} for b in got for i in range(2)])
        assert loader.epoch == 0
        batch = next(batches)  # epoch 1 starts the share again
        assert_rows_equal(expected[:2], [{k: v[i] for k, v in batch.items()} for i in range(2)])
        assert loader.epoch == 1
    expected_eval = pack_documents(evaluation, 64, pad_id=tokenizer.pad_token_id)
    assert_rows_equal(expected_eval[:3], streaming_eval_rows(dataset, tokenizer, 64, 3))


def test_streaming_resumes_at_the_same_document(tokenizer, tmp_path):
    dataset = write_texts(tmp_path / "texts.jsonl", count=30, seed=3)
    first = StreamingRowLoader(dataset, tokenizer, 64, batch_size=2)
    batches = iter(first)
    for _ in range(4):
        next(batches)
    state = first.state_dict()
    mine, _ = stream_split(dataset, tokenizer, 0, 1)
    # the position is the document holding the next row's first token, and its tokens already used
    used = 4 * 2 * 64
    lengths = [len(ids) for ids, _ in mine]
    document = next(i for i in range(len(lengths)) if sum(lengths[: i + 1]) > used)
    assert state == {"streaming": [[0, document, used - sum(lengths[:document])]]}
    resumed = StreamingRowLoader(dataset, tokenizer, 64, batch_size=2)
    resumed.load_state_dict(state)
    again = iter(resumed)
    per_pass = len(pack_documents(mine, 64, pad_id=tokenizer.pad_token_id)) // 2
    for _ in range(per_pass - 4 + 3):  # on past the end of the first pass
        want, got = next(batches), next(again)
        assert_rows_equal([want], [got])
    assert resumed.state_dict() == first.state_dict() and first.epoch >= 1
    with pytest.raises(ValueError, match=r"saved by a run without --streaming; this run streams with 1 dp ranks"):
        resumed.load_state_dict({"epoch": 0, "batch_index": 2})
    with pytest.raises(ValueError, match=r"saved by a --streaming run: resume with --streaming"):
        DistributedRowLoader(build_rows(dataset, tokenizer, 64), 1).load_state_dict(state)


def test_streaming_refuses_missing_values_and_needs_max_steps(tokenizer, tmp_path):
    dataset = tmp_path / "holes.jsonl"
    dataset.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": None}) + "\n")
    with pytest.raises(ValueError, match=r"document 1 of the stream has no 'text' value, which the text format needs"):
        next(iter(StreamingRowLoader(str(dataset), tokenizer, 64, batch_size=1)))
    with pytest.raises(ValueError, match=r"^--streaming reads a file or hub --dataset of unknown length"):
        TrainConfig.from_flags(streaming=True, dataset=str(dataset), max_steps=0)
    with pytest.raises(ValueError, match=r"^--streaming reads a file or hub --dataset of unknown length"):
        TrainConfig.from_flags(streaming=True)
