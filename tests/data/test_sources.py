"""--dataset's sources (Note [Dataset sources]): options, column mapping, hub configs / splits /
revisions / data_files, mixtures (Note [Mixtures]), the eval set, prompt/completion rows and
--on_bad_row; in one process, against rows built by hand."""

import json
import re
from collections import Counter

import datasets
import numpy as np
import pytest
import torch

from llama_cp.config import TrainConfig
from llama_cp.data.formats import tokenize_example
from llama_cp.data.grammar import Source, parse_sources
from llama_cp.data.loader import build_rows
from llama_cp.data.mixture import DataSpec, mixed_stream, mixture_order
from llama_cp.data.streaming import StreamingRowLoader, streaming_eval_rows
from llama_cp.data.tokenizer import byte_tokenizer

IGNORE = -100


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def documents(rows, tokenizer) -> list[str]:
    """The documents of packed rows, as text (bos ... eos), padding dropped."""
    text = tokenizer.decode(torch.cat([row["input_ids"] for row in rows]))
    return ["<|bos|>" + piece for piece in text.replace("<|pad|>", "").split("<|bos|>") if piece]


def trained(rows, tokenizer) -> str:
    labels = torch.cat([row["labels"] for row in rows])
    return tokenizer.decode(labels[labels != IGNORE])


# ----------------------------------------------------------------------------- the grammar


def test_sources_parse_options_weights_and_column_maps():
    got = parse_sources("org/corpus:config=en:split=train[:10%]:revision=v1.2:data_files=en/*.jsonl:0.7,"
                        "notes.jsonl:text=body:weight=0.3")
    assert got == (
        Source("org/corpus", config="en", split="train[:10%]", revision="v1.2", data_files="en/*.jsonl", weight=0.7),
        Source("notes.jsonl", weight=0.3, columns=(("text", "body"),)),
    )
    # a ":" that starts no option stays in the path; one source's weight means nothing
    assert parse_sources("/data/a:b.jsonl") == (Source("/data/a:b.jsonl"),)
    assert parse_sources("a.jsonl:2") == (Source("a.jsonl"),)
    # --dataset_columns maps every source that maps nothing itself
    assert parse_sources("a.jsonl,b.jsonl:text=x", columns="text=body") == (
        Source("a.jsonl", columns=(("text", "body"),)), Source("b.jsonl", columns=(("text", "x"),)))


@pytest.mark.parametrize("value, message", [
    ("a.jsonl:colour=red", r"--dataset 'a.jsonl:colour=red': unknown option 'colour'; a source takes config, split"),
    ("a.jsonl:0.7,b.jsonl", r"give every source of a mixture a weight \(e.g. a.jsonl:0.7,b.jsonl:0.3\)"),
    ("a.jsonl:-1", "a mixture weight must be a positive number"),
    ("a.jsonl:split=x:split=y", "split is given twice"),
    ("a.jsonl,,b.jsonl", "an empty source between commas"),
    ("a.jsonl:prompt=q:answer=a", "unknown option 'answer'"),
    ("passkey,a.jsonl", "passkey is the built-in task"),
])
def test_malformed_sources_are_refused_naming_the_flag(value, message):
    with pytest.raises(ValueError, match=message):
        parse_sources(value)


def test_config_checks_every_source_and_option(tmp_path):
    present = write_jsonl(tmp_path / "a.jsonl", [{"text": "x"}])
    with pytest.raises(FileNotFoundError, match=r"--dataset '.*missing\.jsonl': no such file"):
        TrainConfig.from_flags(dataset=f"{present}:0.5,{tmp_path / 'missing.jsonl'}:0.5")
    with pytest.raises(FileNotFoundError, match=r"--eval_dataset '.*dev\.jsonl': no such file"):
        TrainConfig.from_flags(dataset=str(present), eval_dataset=str(tmp_path / "dev.jsonl"))
    with pytest.raises(ValueError, match="config= and data_files= apply to hub datasets and dataset directories"):
        TrainConfig.from_flags(dataset=f"{present}:config=en")
    with pytest.raises(ValueError, match="revision= picks a version of a hub dataset"):
        TrainConfig.from_flags(dataset=f"{present}:revision=main")
    with pytest.raises(ValueError, match=r"--dataset_columns 'body': 'body' is not FORMAT_COLUMN=COLUMN"):
        TrainConfig.from_flags(dataset=str(present), dataset_columns="body")
    with pytest.raises(ValueError, match=r"--eval_fraction 1.0: give a share of the documents in \[0, 1\)"):
        TrainConfig.from_flags(dataset=str(present), eval_fraction=1.0)
    # fire hands a comma-separated value over as a tuple: it is the same mixture
    assert TrainConfig.from_flags(dataset=(f"{present}:0.5", f"{present}:0.5")).data.dataset == \
        f"{present}:0.5,{present}:0.5"


# ----------------------------------------------------------------------------- formats and columns


def test_prompt_completion_trains_the_completion_only(tokenizer, tmp_path):
    plain = tokenize_example({"prompt": "2+2=", "completion": "4"}, tokenizer)
    assert tokenizer.decode(plain[0]) == "<|bos|>2+2=4<|eos|>"
    assert tokenizer.decode([t for t, m in zip(*plain) if m]) == "4<|eos|>"
    # conversational: one conversation, the prompt's assistant turn is not trained
    prompt = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
              {"role": "user", "content": "2+2?"}]
    chat = tokenize_example({"prompt": prompt, "completion": [{"role": "assistant", "content": "4"}]}, tokenizer)
    assert tokenizer.decode(chat[0]) == tokenizer.apply_chat_template(
        [*prompt, {"role": "assistant", "content": "4"}], tokenize=False)
    assert tokenizer.decode([t for t, m in zip(*chat) if m]) == "4<|eos|>"
    # a file of them, with its columns under other names
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": f"q{i}?", "answer": f"a{i}"} for i in range(20)])
    rows = build_rows(DataSpec(str(path), columns="prompt=question,completion=answer", eval_fraction=0), tokenizer, 64)
    assert trained(rows, tokenizer) == "".join(f"a{i}<|eos|>" for i in range(20))
    with pytest.raises(ValueError, match=r"prompt=quest maps a column the data does not have; its columns are "
                                         r"\['answer', 'question'\]"):
        build_rows(f"{path}:prompt=quest:completion=answer", tokenizer, 64)


def test_a_mapped_column_replaces_one_of_the_same_name(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "two.jsonl", [{"text": "not me", "body": f"body {i}"} for i in range(4)])
    rows = build_rows(DataSpec(f"{path}:text=body", eval_fraction=0), tokenizer, 64)
    assert documents(rows, tokenizer) == [f"<|bos|>body {i}<|eos|>" for i in range(4)]


# ----------------------------------------------------------------------------- hub options


@pytest.fixture
def repository(tmp_path):
    """A dataset repository as the hub holds one: two configs, each with train and dev splits,
    declared in the dataset card."""
    root = tmp_path / "repo"
    for config in ("en", "fr"):
        (root / config).mkdir(parents=True)
        for split in ("train", "dev"):
            write_jsonl(root / config / f"{split}.jsonl", [{"body": f"{config} {split} {i}"} for i in range(10)])
    card = ["---", "configs:"]
    for config in ("en", "fr"):
        card += [f"- config_name: {config}", "  data_files:"]
        card += [f"  - split: {split}\n    path: {config}/{split}.jsonl" for split in ("train", "dev")]
    (root / "README.md").write_text("\n".join([*card, "---", "# a toy corpus", ""]))
    return root


def test_configs_splits_and_data_files_pick_the_rows(tokenizer, repository):
    def texts(value, split="train", **spec):
        rows = build_rows(DataSpec(value, columns="text=body", **spec), tokenizer, 64, split=split)
        return [doc.removeprefix("<|bos|>").removesuffix("<|eos|>") for doc in documents(rows, tokenizer)]

    assert texts(f"{repository}:config=fr:split=dev", eval_fraction=0) == [f"fr dev {i}" for i in range(10)]
    assert texts(f"{repository}:config=fr:split=train[:30%]", eval_fraction=0) == [f"fr train {i}" for i in range(3)]
    assert texts(f"{repository}:data_files=en/dev.jsonl", eval_fraction=0) == [f"en dev {i}" for i in range(10)]
    # without split=, a tenth of the train split held out for eval, drawn with the seed
    train, held = texts(f"{repository}:config=en"), texts(f"{repository}:config=en", split="eval")
    assert len(train) == 9 and len(held) == 1 and sorted(train + held) == sorted(f"en train {i}" for i in range(10))
    # --eval_dataset: another split for eval, and nothing held out of training
    assert texts(f"{repository}:config=en:split=train", eval_dataset=f"{repository}:config=en:split=dev",
                 split="eval") == [f"en dev {i}" for i in range(10)]
    assert len(texts(f"{repository}:config=en:split=train", eval_dataset=f"{repository}:config=en:split=dev")) == 10


def test_two_repositories_of_one_name_are_read_apart(tokenizer, repository, tmp_path):
    """datasets caches a local repository's rows under its folder name and card: a second
    folder named alike (or the same folder's files edited) read the first one's rows, or
    failed on the first one's columns (sources._private_cache)."""
    other = tmp_path / "elsewhere" / "repo"
    other.mkdir(parents=True)
    (other / "README.md").write_text((repository / "README.md").read_text())
    for config in ("en", "fr"):
        (other / config).mkdir()
        for split in ("train", "dev"):
            write_jsonl(other / config / f"{split}.jsonl", [{"text": f"other {i}"} for i in range(3)])
    for root, want in ((repository, "fr dev 0"), (other, "other 0"), (repository, "fr dev 0")):
        mapping = ":text=body" if root == repository else ""  # the other's column is text itself
        rows = build_rows(DataSpec(f"{root}:config=fr:split=dev{mapping}", eval_fraction=0), tokenizer, 64)
        assert documents(rows, tokenizer)[0] == f"<|bos|>{want}<|eos|>"


def test_hub_options_reach_load_dataset(tokenizer, monkeypatch):
    seen = []

    def hub(path, **options):
        seen.append((path, options))
        return datasets.Dataset.from_dict({"text": [f"doc {i}" for i in range(20)]})

    monkeypatch.setattr(datasets, "load_dataset", hub)
    rows = build_rows("org/corpus:config=de:split=train:revision=3f2a9c1:data_files=de/*.parquet", tokenizer, 64)
    assert seen == [("org/corpus", {"streaming": False, "name": "de", "split": "train", "revision": "3f2a9c1",
                                    "data_files": "de/*.parquet"})]
    assert len(documents(rows, tokenizer)) == 19  # one of 20 held out


# ----------------------------------------------------------------------------- mixtures


def test_mixture_order_draws_by_weight_until_a_source_runs_out():
    sizes, weights = [1000, 300], [0.7, 0.3]
    order = mixture_order(sizes, weights, seed=0)
    source = (order >= 1000).astype(int)
    # each source's documents in their order; the order is the seed's, another seed another order
    assert (np.diff(order[source == 0]) == 1).all() and (np.diff(order[source == 1]) == 1).all()
    assert np.array_equal(order, mixture_order(sizes, weights, seed=0))
    assert not np.array_equal(order[:100], mixture_order(sizes, weights, seed=1)[:100])
    # it stops when a draw finds a source empty: one of the two is used up
    counts = np.bincount(source, minlength=2)
    assert counts[0] == 1000 or counts[1] == 300
    assert abs(counts[1] / counts.sum() - 0.3) < 0.05
    # the stream gives the same order
    streams = [range(1000), range(1000, 1300)]
    assert [item for _, item in mixed_stream(streams, weights, seed=0)] == order.tolist()
    assert np.array_equal(mixture_order([3, 2], None, 0), np.arange(5))


def test_a_mixture_keeps_each_sources_format_and_is_reproducible(tokenizer, tmp_path):
    notes = write_jsonl(tmp_path / "notes.jsonl", [{"body": f"note {i}"} for i in range(60)])
    chats = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": f"u{i}"},
                                                                 {"role": "assistant", "content": f"a{i}"}]}
                                                   for i in range(30)])
    said = []
    spec = DataSpec(f"{notes}:text=body:0.5,{chats}:0.5", eval_fraction=0.1)
    rows = build_rows(spec, tokenizer, 128, say=said.append)
    docs = documents(rows, tokenizer)
    kinds = Counter("note" if "note" in doc else "chat" for doc in docs if "assistant" not in doc)  # a chat: 2 turns
    docs = [doc for doc in docs if "assistant" not in doc]
    assert kinds["chat"] == 27 or kinds["note"] == 54  # the first source to run out ends the mixture
    assert abs(kinds["chat"] - kinds["note"]) < 0.4 * len(docs)
    # chat is trained on its assistant turns only, text whole
    assert "<|bos|>user\nu" not in trained(rows, tokenizer) and "note " in trained(rows, tokenizer)
    assert said == [f"train mixture: {len(docs)} documents ({notes} {kinds['note']} of 54, {chats} {kinds['chat']} of 27)"]
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in
               zip(rows, build_rows(spec, tokenizer, 128), strict=True))


# ----------------------------------------------------------------------------- eval


def test_eval_fraction_zero_holds_nothing_out(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"text": f"doc {i}"} for i in range(40)])
    assert build_rows(DataSpec(str(path), eval_fraction=0), tokenizer, 64, split="eval") == []
    assert len(documents(build_rows(DataSpec(str(path), eval_fraction=0), tokenizer, 64), tokenizer)) == 40
    held = documents(build_rows(DataSpec(str(path), eval_fraction=0.25), tokenizer, 64, split="eval"), tokenizer)
    assert len(held) == 10 and held != [f"<|bos|>doc {i}<|eos|>" for i in range(30, 40)]  # not the tail


# ----------------------------------------------------------------------------- bad rows


def test_a_row_the_template_cannot_render_is_skipped_or_refused(tokenizer, tmp_path):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    broken = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]}
    path = write_jsonl(tmp_path / "chat.jsonl", [good, broken, good, good])
    said = []
    rows = build_rows(DataSpec(str(path), eval_fraction=0), tokenizer, 64, say=said.append)
    assert trained(rows, tokenizer) == "yo<|eos|>" * 3
    assert len(said) == 1 and said[0].startswith(
        f"skipped 1 of 4 rows that could not be rendered (--on_bad_row skip); the first: row 2 of --dataset '{path}': "
        "the chat template cannot render this conversation"), said
    with pytest.raises(ValueError, match=rf"row 2 of --dataset '{path}': .*cannot render.*\(the tokenizer's chat "
                                         r"template\); fix the row, or pass --on_bad_row skip to train on the others"):
        build_rows(DataSpec(str(path), eval_fraction=0, on_bad_row="error"), tokenizer, 64)


#: datasets 4.7 and later read JSON objects of other shapes into their Json feature (Note [JSON objects stored as structs])
JSON_FEATURE = hasattr(datasets, "Json")


def test_tools_the_template_does_not_write_are_refused_naming_the_row(tokenizer, tmp_path):
    """Note [A row's tools]: the embedded tokenizer's template writes no tools; SFT and DPO rows with
    a 'tools' column are refused for the run, at the first such row, not skipped."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    user, assistant = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}
    sft = write_jsonl(tmp_path / "sft.jsonl", [{"messages": [user, assistant]}, {"messages": [user, assistant],
                                                                                   "tools": tools}])
    with pytest.raises(ValueError, match=rf"^row 2 of --dataset '{sft}': the rows have tools \(a 'tools' column\) "
                                         "and the chat template writes none of them"):
        build_rows(DataSpec(str(sft), eval_fraction=0), tokenizer, 64)
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": [user], "chosen": [assistant], "tools": tools,
                                                    "rejected": [{"role": "assistant", "content": "no"}]}] * 2)
    from llama_cp.data.prepared import prepare_dataset

    with pytest.raises(ValueError, match=rf"^row 1 of --dataset '{pairs}': the rows have tools"):
        prepare_dataset(DataSpec(str(pairs), eval_fraction=0), tokenizer, 64, cache_dir=str(tmp_path / "cache"),
                        objective="dpo")


def test_tool_calls_of_other_shapes_read_back_as_written_or_are_refused(tmp_path):
    """Note [JSON objects stored as structs]: rows whose tool-call arguments and tool parameters differ
    in their keys either read back as written (datasets >= 4.7's Json) or, stored as one struct for every
    row (datasets < 4.7; a parquet file written so), are refused naming the row and the fix, never
    trained with keys a row never had, as null."""
    from llama_cp.data.formats import check_free_form_structs
    from llama_cp.data.sources import load_source

    def row(name, arguments):
        properties = {key: {"type": "string"} for key in arguments}
        return {"messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": name, "arguments": arguments}}]}],
                "tools": [{"type": "function", "function": {"name": name, "parameters": {
                    "type": "object", "properties": properties}}}]}

    rows = [row("get_weather", {"city": "Rome"}), row("search", {"query": "cats", "limit": "3"})]
    path = write_jsonl(tmp_path / "calls.jsonl", rows)
    message = r"row 1's 'messages' has tool_calls.function.arguments with (query, limit|limit, query): null\. The rows'"
    from llama_cp.data.streaming import _stream_documents

    for read in (lambda: list(load_source(parse_sources(str(path))[0], "train", eval_fraction=0)),
                 lambda: list(_stream_documents(DataSpec(str(path), eval_fraction=0), eval_part=False))):
        try:
            loaded = read()
        except ValueError as error:  # datasets < 4.7: the arguments as one struct
            assert JSON_FEATURE is False
            assert re.search(message.replace("row 1", "(row 1|document 0 of the stream)"), str(error)), error
            assert "upgrade datasets (>= 4.7" in str(error), error
        else:
            assert JSON_FEATURE is True
            assert [(r["messages"], r["tools"]) for r in loaded] == [(r["messages"], r["tools"]) for r in rows]
    # the struct form, on any datasets version: refused where a row holds a null, read as written where none does
    def as_structs(records, keys):
        text = datasets.Value("string")
        return datasets.Dataset.from_list(records, features=datasets.Features({
            "messages": [{"role": text, "content": text, "tool_calls": [
                {"type": text, "function": {"name": text, "arguments": {key: text for key in keys}}}]}],
            "tools": [{"type": text, "function": {"name": text, "parameters": {
                "type": text, "properties": {key: {"type": text} for key in keys}}}}]}))

    with pytest.raises(ValueError, match=message):
        check_free_form_structs(as_structs(rows, ("city", "query", "limit")), "calls.jsonl")
    check_free_form_structs(as_structs([row("search", {"query": "a", "limit": "1"}),
                                        row("search", {"query": "b", "limit": "2"})], ("query", "limit")), "same keys")


# ----------------------------------------------------------------------------- streaming


def test_a_streamed_mixture_and_eval_dataset(tokenizer, tmp_path, repository):
    notes = write_jsonl(tmp_path / "notes.jsonl", [{"body": f"note {i}"} for i in range(60)])
    spec = DataSpec(f"{notes}:text=body:0.6,{repository}:config=fr:split=train:text=body:0.4",
                    eval_dataset=f"{repository}:config=en:split=dev:text=body", seed=3)
    loader = StreamingRowLoader(spec, tokenizer, 64, batch_size=1)
    streamed = [batch["input_ids"][0] for batch, _ in zip(loader, range(6))]
    # the same documents as the prepared mixture, in the same order (rows packed alike)
    built = build_rows(spec, tokenizer, 64)
    assert all(torch.equal(a, b["input_ids"]) for a, b in zip(streamed, built))
    assert any("fr train" in tokenizer.decode(row) for row in streamed)
    evaluation = streaming_eval_rows(spec, tokenizer, 64, num_rows=2)
    assert documents(evaluation, tokenizer)[0] == "<|bos|>en dev 0<|eos|>"
    assert streaming_eval_rows(DataSpec(str(notes), columns="text=body", eval_fraction=0), tokenizer, 64, 2) == []


# ----------------------------------------------------------------------------- review: edges


def test_sources_edges_name_what_is_wrong(tokenizer, tmp_path, monkeypatch):
    from llama_cp.data.prepared import prepare_dataset

    # every row skipped: the refusal says why, not only "no usable text"
    sharegpt = write_jsonl(tmp_path / "sharegpt.jsonl",
                           [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}] * 4)
    with pytest.raises(ValueError, match=r"no usable text.*; skipped 4 of 4 rows that could not be rendered.*row 1 of "
                                         r"--dataset .*sharegpt\.jsonl.*chat message 0 must be a"):
        prepare_dataset(DataSpec(f"{sharegpt}:messages=conversations", eval_fraction=0), tokenizer, 64,
                        cache_dir=str(tmp_path / "cache"))
    # a column of strings in some rows and message lists in others is refused by name, not half-read
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [
        {"prompt": [{"role": "user", "content": "2+2?"}], "completion": [{"role": "assistant", "content": "4"}]},
        {"prompt": "3+3=", "completion": "6"}])
    with pytest.raises(ValueError, match=r"mixed\.jsonl.*mixes strings and"):
        build_rows(str(mixed), tokenizer, 64)
    # huge weights are shares like any others
    assert sorted(mixture_order([3, 3], [1e308, 1e308], seed=0).tolist())[:3] == [0, 1, 2]
    # a hub dataset's split that is not read may hold other columns
    hub = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": [f"doc {i}" for i in range(20)]}),
                                "leaderboard": datasets.Dataset.from_dict({"score": [1.0]})})
    monkeypatch.setattr(datasets, "load_dataset", lambda path, **options: hub)
    assert len(documents(build_rows("org/corpus", tokenizer, 64), tokenizer)) == 19
    hub["train"] = datasets.Dataset.from_dict({"body": ["x"] * 4})
    with pytest.raises(ValueError, match=r"--dataset 'org/corpus \(split train\)': rows have columns \['body'\]"):
        build_rows("org/corpus", tokenizer, 64)


def test_a_streamed_repository_reads_the_split_its_card_names(tokenizer, tmp_path):
    root = tmp_path / "cloned"
    root.mkdir()
    write_jsonl(root / "train.jsonl", [{"text": f"train {i}"} for i in range(30)])
    write_jsonl(root / "test.jsonl", [{"text": f"TEST {i}"} for i in range(5)])
    (root / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
                                    "    path: train.jsonl\n  - split: test\n    path: test.jsonl\n---\n")
    loader = StreamingRowLoader(DataSpec(str(root), eval_fraction=0), tokenizer, 64, batch_size=1)
    text = tokenizer.decode(torch.cat([batch["input_ids"][0] for batch, _ in zip(loader, range(12))]))
    assert "train 29" in text and "TEST" not in text
