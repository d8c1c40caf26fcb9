"""Prepared rows (tokenized and packed once, read from disk) and --streaming, against build_rows."""

import hashlib
import json
import os
import random
import re
import time
from unittest import mock

import pyarrow as pa
import pytest
import torch

from llama_cp.config import TrainConfig
from llama_cp.data.formats import tokenize_example
from llama_cp.data.loader import DistributedRowLoader, build_rows
from llama_cp.data.mixture import DataSpec
from llama_cp.data.packing import pack_documents
from dist_harness import map_in_processes
from llama_cp.data.prepared import (
    DamagedRowsError,
    PreparedRows,
    _host,
    RowBatches,
    cache_key,
    key_hash,
    load_prepared_rows,
    prepare_dataset,
    summary_lines,
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
    dataset = tmp_path / "two.jsonl"  # train: two documents; eval: --eval_dataset's one
    dataset.write_text(json.dumps({"text": "a" * 100}) + "\n" + json.dumps({"text": "b" * 10}) + "\n")
    (tmp_path / "dev.jsonl").write_text(json.dumps({"text": "c"}) + "\n")
    spec = DataSpec(str(dataset), eval_dataset=str(tmp_path / "dev.jsonl"))
    _, summary = prepare_dataset(spec, tokenizer, 64, cache_dir=str(tmp_path / "cache"))
    counts = ("documents", "rows", "tokens", "padding_fraction", "split_documents", "truncated_documents", "formats")
    # 102 + 12 tokens (bos ... eos) in 2 rows of 64: 14 padding tokens; the first document crosses a row end
    assert {key: summary["train"][key] for key in counts} == {
        "documents": 2, "rows": 2, "tokens": 114, "padding_fraction": round(14 / 128, 6), "split_documents": 1,
        "truncated_documents": 0, "formats": {"text": 2}}
    assert {key: summary["eval"][key] for key in counts} == {
        "documents": 1, "rows": 1, "tokens": 3, "padding_fraction": round(61 / 64, 6), "split_documents": 0,
        "truncated_documents": 0, "formats": {"text": 1}}
    assert summary_lines(summary, 64)[0] == (
        "train: 2 documents (text 2) -> 2 rows of 64 tokens, 114 tokens, padding 10.94%, 1 documents split over "
        "rows, 0 truncated")
    # --truncate_documents: the first document keeps its first 64 tokens, the second starts the next row
    directory, summary = prepare_dataset(spec, tokenizer, 64, cache_dir=str(tmp_path / "cache"), truncate=True)
    assert {key: summary["train"][key] for key in counts} == {
        "documents": 2, "rows": 2, "tokens": 76, "padding_fraction": round(52 / 128, 6), "split_documents": 0,
        "truncated_documents": 1, "formats": {"text": 2}}
    rows = PreparedRows(directory / "train.arrow")
    assert_rows_equal(build_rows(spec, tokenizer, 64, truncate=True), rows)
    assert rows[0]["input_ids"].tolist() == [tokenizer.bos_token_id] + [ord("a")] * 63
    assert rows[0]["labels"].tolist() == [ord("a")] * 63 + [-100]  # its eos is gone: the last token has no target
    assert rows[1]["input_ids"][:13].tolist() == [tokenizer.bos_token_id] + [ord("b")] * 10 + [tokenizer.eos_token_id, 256]


def test_rows_with_no_scored_token_are_counted_and_said(tokenizer, tmp_path):
    """A prompt longer than a row leaves rows that hold only prompt tokens: they train nothing, and the
    summary counts them (against the prepared rows' own labels) and says so; rows that all train say nothing."""
    dataset = tmp_path / "long_prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": "q" * 150, "completion": "a" * 5}) + "\n" for _ in range(4)))
    directory, summary = prepare_dataset(str(dataset), tokenizer, 64, cache_dir=str(tmp_path / "cache"))
    rows = PreparedRows(directory / "train.arrow")
    unscored = sum(bool((row["labels"] == -100).all()) for row in rows)
    assert 0 < unscored < len(rows) and summary["train"]["unscored_rows"] == unscored
    assert summary_lines(summary, 64)[0].endswith(
        f", {unscored} rows with no scored token (prompt tokens only: nothing to learn or score; a longer "
        "--context_length keeps prompts with their completions)")
    _, summary = prepare_dataset(str(dataset), tokenizer, 256, cache_dir=str(tmp_path / "cache"))
    assert summary["train"]["unscored_rows"] == 0 and summary_lines(summary, 256)[0].endswith(" 0 truncated")


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
    # rows an older llama-cp made, which encoded examples otherwise, are not reused
    from llama_cp.data import cache_key as module

    with mock.patch.object(module, "DOCUMENT_VERSION", module.DOCUMENT_VERSION - 1):
        assert key_hash(cache_key(str(dataset), tokenizer, 64, 1)) != base
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


# ----------------------------------------------------------------------------- checks and the lock


def prepared_texts(tokenizer, tmp_path, count=30):
    """(the dataset, the cache, the prepared directory) of ``count`` texts in rows of 64 tokens."""
    dataset, cache = write_texts(tmp_path / "texts.jsonl", count=count), str(tmp_path / "cache")
    directory, _ = prepare_dataset(dataset, tokenizer, 64, cache_dir=cache)
    return dataset, cache, directory


def damage_message(directory, problem):
    """The start of a DamagedRowsError's message, as a regex: the directory, ``problem`` (a regex), the fix."""
    where = re.escape(str(directory))
    return rf"^prepared rows {where}: {problem}: delete {where} and run again \(or recipes\.prepare_data\)"


def read_or_raise(rows, expected, path, indices=None):
    """Read the rows of ``indices`` (default: all) of ``rows``: each equals ``expected``'s, or raises
    naming its file and index. Returns the indices that raised."""
    raised = []
    for index in range(len(expected)) if indices is None else indices:
        try:
            row = rows[index]
        except DamagedRowsError as error:
            assert re.match(damage_message(path.parent, rf"row {index} of {path.name} (differs from its checksum|"
                                                        r"cannot be read \(.*\))"), str(error)), str(error)
            raised.append(index)
        else:
            assert_rows_equal([expected[index]], [row])
    return raised


def row_messages(data):
    """[start, end) in the bytes ``data`` of an Arrow file of each record batch's message (row)."""
    source = pa.BufferReader(data)
    source.seek(8)  # the magic "ARROW1" and its padding; then the schema, the batches, the footer
    messages, reader, start = [], pa.ipc.MessageReader.open_stream(source), 8
    for message in iter(reader.read_next_message, None):
        if message.type == "record batch":
            messages.append((start, source.tell()))
        start = source.tell()
        if start >= len(data) - 16:
            break
    return messages


def test_damaged_bytes_in_a_row_raise_when_it_is_read_and_never_give_other_rows(tokenizer, tmp_path):
    dataset, _, directory = prepared_texts(tokenizer, tmp_path)
    expected, path = build_rows(dataset, tokenizer, 64), directory / "train.arrow"
    original = path.read_bytes()
    messages = row_messages(original)
    assert len(messages) == len(expected)
    # random bytes over 4 of one row's tokens, in the middle of the file: that row raises, naming the file
    # and the row; every other row reads as written
    row = len(expected) // 2
    tokens = expected[row]["input_ids"].numpy().astype("<i4").tobytes()
    assert original.count(tokens) == 1
    at, rng = original.index(tokens) + 64, random.Random(0)
    path.write_bytes(original[:at] + bytes(b ^ rng.randrange(1, 256) for b in original[at : at + 16])
                     + original[at + 16 :])
    assert read_or_raise(PreparedRows(path), expected, path) == [row]
    # each byte of that row's message changed in turn (its metadata, buffers, Arrow's padding), and a few
    # of its neighbours': the row holding the byte reads as written or raises, the others read as written.
    # A byte of the row's tokens always raises.
    tokens_at = range(original.index(tokens), original.index(tokens) + len(tokens))
    start, end = messages[row]
    for at in range(start - 8, end + 8):
        path.write_bytes(original[:at] + bytes([original[at] ^ 0x5A]) + original[at + 1 :])
        holder = next(index for index, (first, last) in enumerate(messages) if first <= at < last)
        raised = read_or_raise(PreparedRows(path), expected, path, (row - 1, row, row + 1))
        assert raised == [row] if at in tokens_at else raised in ([], [holder])


def test_a_truncated_or_unreadable_file_is_refused_and_prepared_anew(tokenizer, tmp_path):
    dataset, cache, directory = prepared_texts(tokenizer, tmp_path)
    path, expected = directory / "train.arrow", build_rows(dataset, tokenizer, 64)
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[: size // 2])
    with pytest.raises(DamagedRowsError, match=damage_message(directory, rf"train\.arrow is {size // 2} bytes, "
                                                                         rf"its summary says {size}")):
        PreparedRows(path)
    # a stale temporary directory of a killed preparer on this node is removed, another node's is left
    key = directory.name
    for stale in (f".{key}.tmp-{_host()}-killed", f".{key}.tmp-othernode-alive"):
        os.makedirs(os.path.join(cache, stale, "train.arrow.tmp"))
    said = []
    again, summary = prepare_dataset(dataset, tokenizer, 64, cache_dir=cache, say=said.append)
    assert again == directory and not summary["reused"]
    assert said == [(f"prepared rows {directory}: train.arrow is {size // 2} bytes, its summary says {size}: "
                     "removed, preparing anew")]
    assert_rows_equal(expected, PreparedRows(path))
    assert sorted(os.listdir(cache)) == sorted([f".{key}.tmp-othernode-alive", key])  # no lock file either
    # the same size, the footer overwritten: refused in one line naming the file, not Arrow's bare error
    original = path.read_bytes()
    path.write_bytes(original[:-64] + bytes(64))
    with pytest.raises(DamagedRowsError, match=damage_message(directory, r"train\.arrow cannot be opened \(.+\)")):
        PreparedRows(path)
    train, _ = load_prepared_rows(dataset, tokenizer, 64, 1, cache_dir=cache, say=said.append)
    assert [line for line in said if line.startswith(f"prepared rows {directory}: train.arrow cannot be opened (")]
    assert_rows_equal(expected, train)


def test_missing_or_mismatched_rowsums_and_summary_are_caught(tokenizer, tmp_path):
    dataset, cache, directory = prepared_texts(tokenizer, tmp_path)
    summary_path, rowsums = directory / "summary.json", directory / "train.rowsums"
    summary, digests = json.loads(summary_path.read_text()), rowsums.read_bytes()
    rows = summary["checks"]["train"]["rows"]
    assert rows == summary["train"]["rows"] and len(digests) == 8 * rows

    def refused(problem, split="train"):
        with pytest.raises(DamagedRowsError, match=damage_message(directory, problem)):
            PreparedRows(directory / f"{split}.arrow")

    (directory / "eval.rowsums").rename(directory / "eval.rowsums.away")
    refused(r"eval\.rowsums is missing", "eval")
    (directory / "eval.rowsums.away").rename(directory / "eval.rowsums")
    rowsums.write_bytes(digests[:8] + bytes([digests[8] ^ 1]) + digests[9:])
    refused(r"train\.rowsums differs from its sha256 in the summary")
    rowsums.write_bytes(digests)

    def summarise(change):
        changed = json.loads(json.dumps(summary))
        change(changed)
        summary_path.write_text(json.dumps(changed))

    summarise(lambda s: s["checks"]["train"].update(rows=rows + 1))
    refused(rf"train\.arrow holds {rows} rows, its summary says {rows + 1}")
    rowsums.write_bytes(digests[:-8])  # a digest short, the summary's sha256 its own
    summarise(lambda s: s["checks"]["train"].update(rowsums_sha256=hashlib.sha256(digests[:-8]).hexdigest()))
    refused(rf"train\.rowsums holds {rows - 1} digests for {rows} rows")
    rowsums.write_bytes(digests)
    summarise(lambda s: s.pop("checks"))  # a summary without checks (written before them)
    refused(r"summary\.json has no checks for train\.arrow")
    summary_path.unlink()
    refused(r"summary\.json is missing")
    # the preparer never reuses such a directory: it says so and prepares anew
    said = []
    again, prepared = prepare_dataset(dataset, tokenizer, 64, cache_dir=cache, say=said.append)
    assert again == directory and not prepared["reused"]
    assert said == [f"prepared rows {directory}: summary.json is missing: removed, preparing anew"]
    assert json.loads(summary_path.read_text())["checks"] == summary["checks"]  # the same rows again
    assert_rows_equal(build_rows(dataset, tokenizer, 64), PreparedRows(directory / "train.arrow"))


def prepare_at_once(job):
    """One of two preparers (test_two_preparers_...): it waits until both have started, then prepares."""
    dataset, cache, started, index = job
    open(os.path.join(started, str(index)), "w").close()
    deadline = time.monotonic() + 60
    while len(os.listdir(started)) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    said = []
    directory, summary = prepare_dataset(dataset, byte_tokenizer(), 64, cache_dir=cache, say=said.append)
    return str(directory), summary["reused"], said


def test_two_preparers_of_one_key_at_once_prepare_it_once(tokenizer, tmp_path):
    dataset, cache, started = write_texts(tmp_path / "texts.jsonl", count=40), str(tmp_path / "cache"), tmp_path / "go"
    started.mkdir()
    results = map_in_processes(prepare_at_once, [(dataset, cache, str(started), index) for index in range(2)])
    (directory, *others), reused, said = zip(*results)
    assert set(others) == {directory}
    # one prepared; the other waited on the lock (unless it came after the first had finished), then reused
    assert sorted(reused) == [False, True] and said[reused.index(False)] == []
    lock = f"{cache}/.{os.path.basename(directory)}.lock"
    assert said[reused.index(True)] in ([], [f"waiting for another preparer of {directory} (it holds {lock})"])
    assert os.listdir(cache) == [os.path.basename(directory)]  # no temporary directory, no lock file
    for split in ("train", "eval"):
        assert_rows_equal(build_rows(dataset, tokenizer, 64, split=split), PreparedRows(f"{directory}/{split}.arrow"))


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
    # the seed's hold-out is the third document here
    assert ("train: 2 documents (text 2) -> 2 rows of 64 tokens, 114 tokens, padding 10.94%, "
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


def test_passkey_rows_of_a_file_fill_a_row_on_every_path(tokenizer, tmp_path):
    """A passkey file's rows without a length fill a row of --context_length (the retrieval rows of
    configs/smollm2_extend_32k.yaml's mixture): prepared and in memory alike, each row holding its key
    as the only trained tokens (--streaming refuses passkey files)."""
    keys = tmp_path / "passkeys.jsonl"
    keys.write_text("".join(json.dumps({"passkey": f"{k}", "depth": d}) + "\n"
                            for k, d in [(3, 0.1), (7, 0.5), (5, 0.9)] * 8))
    directory, _ = prepare_dataset(str(keys), tokenizer, 128, cache_dir=str(tmp_path / "cache"))
    prepared = list(PreparedRows(directory / "train.arrow"))
    memory = build_rows(str(keys), tokenizer, 128, split="train")
    assert_rows_equal(memory, prepared)
    for row in prepared:
        assert row["input_ids"].shape == (128,) and row["position_ids"][-1] == 127  # one document, the whole row
        trained = row["labels"][row["labels"] != -100]
        assert tokenizer.decode(trained).rstrip(tokenizer.eos_token) in {"3", "7", "5"}
