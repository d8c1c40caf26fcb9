"""Single-process checks of the byte tokenizer, example formats, packing, passkey rows and the dp loader."""

import json
import random

import datasets
import numpy as np
import pytest
import torch
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

from llama_cp.config import LOCAL_FILE_SUFFIXES, TrainConfig
from llama_cp.data.formats import tokenize_example
from llama_cp.data.loader import DistributedRowLoader, build_rows
from llama_cp.data.packing import pack_documents
from llama_cp.data.passkey import PASSKEY_FILLER, passkey_example, passkey_rows, passkey_warmup_lengths
from llama_cp.data.sources import FILE_BUILDERS, load_examples
from llama_cp.data.tokenizer import _byte_alphabet, build_tokenizer, byte_tokenizer

IGNORE = -100
TEXTS = ["plain ascii", "héllo wörld, 日本語 and 🎉", "  leading spaces\n\ttabs\r\n\x00nul", ""]
CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo!"},
    {"role": "user", "content": "bye"},
    {"role": "assistant", "content": "ciao"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


def trained_text(document, tokenizer) -> str:
    input_ids, label_mask = document
    return tokenizer.decode([token for token, trained in zip(input_ids, label_mask) if trained])


def row_text(rows, tokenizer) -> str:
    return tokenizer.decode(torch.cat([row["input_ids"] for row in rows]))  # rows may cut a character's bytes


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


# ----------------------------------------------------------------------------- tokenizer


def test_byte_tokenizer_is_one_token_per_byte_and_round_trips(tokenizer):
    assert set(_byte_alphabet()) == set(pre_tokenizers.ByteLevel.alphabet())
    assert len(tokenizer) == 259 < 1024
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token) == ("<|pad|>", "<|bos|>", "<|eos|>")
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (256, 257, 258)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == list(text.encode("utf-8"))  # id == byte value, nothing added by encode
        assert tokenizer.encode(text, add_special_tokens=True) == ids
        assert tokenizer.decode(ids) == text


def test_byte_tokenizer_saves_and_reloads_with_auto_tokenizer(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert reloaded.encode(text) == tokenizer.encode(text)
        assert reloaded.decode(tokenizer.encode(text)) == text
    assert (reloaded.pad_token_id, reloaded.bos_token_id, reloaded.eos_token_id) == (256, 257, 258)
    rendered = reloaded.apply_chat_template(CHAT[1:3], tokenize=False)
    assert rendered == "<|bos|>user\nhi<|eos|><|bos|>assistant\nyo!<|eos|>"
    assert reloaded.encode(rendered)[0] == reloaded.bos_token_id  # special tokens in text map to their ids


# ----------------------------------------------------------------------------- formats


def test_text_document_is_bos_text_eos_all_trained(tokenizer):
    input_ids, label_mask = tokenize_example({"text": "abc"}, tokenizer)
    assert input_ids == [257, 97, 98, 99, 258]
    assert label_mask == [False, True, True, True, True]
    assert tokenize_example({"text": ""}, tokenizer) == ([], [])


@pytest.mark.parametrize("extra_input", ["", "1 2"])
def test_alpaca_prompt_is_masked(tokenizer, extra_input):
    example = {"instruction": "Add the numbers.", "input": extra_input, "output": "3"}
    input_ids, label_mask = tokenize_example(example, tokenizer)
    assert trained_text((input_ids, label_mask), tokenizer) == "3<|eos|>"
    assert label_mask == [False] * (len(input_ids) - 2) + [True, True]  # the response is the trained suffix
    assert ("### Input:\n1 2" in tokenizer.decode(input_ids)) == bool(extra_input)
    assert input_ids[0] == tokenizer.bos_token_id


def test_chat_trains_only_assistant_turns_with_template(tokenizer):
    document = tokenize_example({"messages": CHAT}, tokenizer)
    assert tokenizer.decode(document[0]) == tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert trained_text(document, tokenizer) == "yo!<|eos|>ciao<|eos|>"  # not the "<|bos|>assistant\n" headers


def test_a_document_is_encoded_as_one_text_as_inference_sees_it():
    """Note [Encoding the whole text]: with a SentencePiece-style tokenizer, encoding the prompt and
    the completion apart starts the completion with an extra word boundary "▁" and splits the
    "ab" merge across them; the whole text's tokens are trained from where the completion starts."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "▁": 2, "a": 3, "b": 4, "x": 5, "y": 6, "ab": 7, "▁x": 8}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b"), ("▁", "x")]))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")
    assert tokenizer.encode("xa", add_special_tokens=False) + tokenizer.encode("by", add_special_tokens=False) == \
        [8, 3, 2, 4, 6]  # apart: "▁x a" + "▁ b y"
    input_ids, label_mask = tokenize_example({"prompt": "xa", "completion": "by"}, tokenizer)
    assert input_ids == [0, 8, 7, 6, 1]  # <s> ▁x ab y </s>: the text's own tokens
    assert label_mask == [False, False, False, True, True]  # "ab" starts in the prompt: not trained


def test_chat_without_template_is_refused_and_chat_template_names_one(tmp_path):
    """A tokenizer without a chat template used to render chat as ``role: content`` lines and train
    on that, a format no one prompts the model in: refused, naming --chat_template, which sets one."""
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="needs a chat template and the tokenizer has none.*--chat_template FILE"):
        tokenize_example({"messages": CHAT[1:3]}, tokenizer)
    with pytest.raises(ValueError, match="chat message 0 must be a"):
        tokenize_example({"messages": [{"text": "hi"}]}, tokenizer)
    template = tmp_path / "chat_template.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
                        "{% if add_generation_prompt %}[assistant] {% endif %}")
    tokenizer = build_tokenizer(None, str(template))
    document = tokenize_example({"messages": CHAT[1:3]}, tokenizer)
    assert tokenizer.decode(document[0]).endswith("[user] hi<|eos|>[assistant] yo!<|eos|>")
    assert trained_text(document, tokenizer) == "yo!<|eos|>"
    with pytest.raises(FileNotFoundError, match="--chat_template 'missing.jinja': no such file"):
        TrainConfig.from_flags(chat_template="missing.jinja")


def test_a_processors_chat_template_is_taken_when_the_tokenizer_has_none(tmp_path):
    """A vision-language checkpoint's template may be only in its processor's chat_template.json, which
    AutoTokenizer does not read (Note [A processor's chat template]): the tokenizer takes it, and a
    --chat_template file still wins."""
    import json

    byte_tokenizer().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    for name in ("chat_template.jinja", "chat_template.json"):  # where transformers 5 / 4 save the tokenizer's
        (tmp_path / name).unlink(missing_ok=True)
    assert build_tokenizer(str(tmp_path)).chat_template is None
    processor = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
                 "{% if add_generation_prompt %}[assistant] {% endif %}")
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": processor}))
    tokenizer = build_tokenizer(str(tmp_path))
    assert tokenizer.chat_template == processor
    assert trained_text(tokenize_example({"messages": CHAT[1:3]}, tokenizer), tokenizer) == "yo!<|eos|>"
    own = tmp_path / "own.jinja"
    own.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert build_tokenizer(str(tmp_path), str(own)).chat_template == own.read_text()


# ----------------------------------------------------------------------------- packing


def test_packing_shifts_labels_resets_positions_and_pads():
    # Note [Packed rows]: "abc" and "defghij", L = 8
    documents = [([1, 2, 3], [False, True, True]), ([4, 5, 6, 7, 8, 9, 10], [False] + [True] * 6)]
    rows = pack_documents(documents, context_length=8, cp=2, pad_id=0)
    assert len(rows) == 2
    for row in rows:
        assert set(row) == {"input_ids", "labels", "position_ids"}
        assert all(tensor.shape == (8,) and tensor.dtype == torch.long for tensor in row.values())
    assert rows[0]["input_ids"].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert rows[0]["labels"].tolist() == [2, 3, IGNORE, 5, 6, 7, 8, 9]  # 3 -> 4 crosses documents; 8 -> 9 crosses rows
    assert rows[0]["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert rows[1]["input_ids"].tolist() == [9, 10, 0, 0, 0, 0, 0, 0]
    assert rows[1]["labels"].tolist() == [10] + [IGNORE] * 7
    assert rows[1]["position_ids"].tolist() == list(range(5, 13))  # continuing through the padding


def test_packing_labels_match_a_reference_on_random_documents():
    generator = random.Random(0)
    documents = []
    for _ in range(30):
        length = generator.randint(1, 40)
        input_ids = [generator.randint(0, 255) for _ in range(length)]
        documents.append((input_ids, [generator.random() < 0.7 for _ in range(length)]))
    rows = pack_documents(documents, context_length=24, cp=3)
    assert all(row["input_ids"].shape == (24,) for row in rows)
    stream = {key: torch.cat([row[key] for row in rows]) for key in rows[0]}
    # reference: the target of token t is token t+1 of the same document, when that one is trained
    expected = [(token, document_index) for document_index, (ids, _) in enumerate(documents) for token in ids]
    reference_labels = []
    for ids, mask in documents:
        reference_labels += [ids[t + 1] if mask[t + 1] else IGNORE for t in range(len(ids) - 1)] + [IGNORE]
    real = len(expected)
    assert stream["input_ids"][:real].tolist() == [token for token, _ in expected]
    assert stream["labels"][:real].tolist() == reference_labels
    assert (stream["labels"][real:] == IGNORE).all()
    starts = (stream["position_ids"][:real] == 0).nonzero().flatten().tolist()
    assert starts == [sum(len(ids) for ids, _ in documents[:i]) for i in range(len(documents))]
    # no label crosses a document start
    assert (stream["labels"][torch.tensor(starts[1:]) - 1] == IGNORE).all()


def test_context_length_must_be_a_multiple_of_two_cp():
    documents = [([1, 2, 3], [False, True, True])]
    message = r"--context_length 100 must be a multiple of 2 x cp = 8.*padded length would be 104.*--context_length 104"
    with pytest.raises(ValueError, match=message):
        pack_documents(documents, context_length=100, cp=4)
    with pytest.raises(ValueError, match="no usable text"):
        pack_documents([([1, 2, 3], [False, False, False]), ([], [])], context_length=8)


# ----------------------------------------------------------------------------- passkey


def needle_start(row, tokenizer) -> int:
    text = tokenizer.decode(row["input_ids"][1:])  # byte tokenizer: character offset == token offset (ASCII)
    return 1 + text.index("The pass key is")


@pytest.mark.parametrize("context_length", [256, 1000, 4096])
def test_passkey_row_fills_the_context_and_trains_only_the_answer(tokenizer, context_length):
    row = passkey_example(random.Random(3), context_length, tokenizer)
    assert all(tensor.shape == (context_length,) for tensor in row.values())
    assert row["position_ids"].tolist() == list(range(context_length))
    text = tokenizer.decode(row["input_ids"])
    key = text[-len("58231<|eos|>") : -len("<|eos|>")]
    assert key.isdigit() and len(key) == 5
    assert text.startswith("<|bos|>") and text.endswith(f"What is the pass key? The pass key is {key}<|eos|>")
    assert f"The pass key is {key}. Remember it. {key} is the pass key. " in text
    trained = (row["labels"] != IGNORE).nonzero().flatten().tolist()
    assert trained == list(range(context_length - 7, context_length - 1))  # targets: 5 digits and eos
    assert tokenizer.decode(row["labels"][trained]) == f"{key}<|eos|>"


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9, 0.999])
def test_passkey_key_sits_at_the_requested_depth(tokenizer, depth):
    context_length = 2048
    row = passkey_example(random.Random(0), context_length, tokenizer, key=12345, depth=depth)
    needle = "The pass key is 12345. Remember it. 12345 is the pass key. "
    question = "What is the pass key? The pass key is "
    filler = context_length - len(needle) - len(question) - len("12345") - 2  # bos, eos
    longest_sentence = max(len(sentence) for sentence in PASSKEY_FILLER)
    filler_before = needle_start(row, tokenizer) - 1
    # the key goes in at the last sentence boundary at or before depth x filler (the first one, for depth 0)
    assert depth * filler - longest_sentence < filler_before <= max(depth * filler, longest_sentence)
    text = tokenizer.decode(row["input_ids"])
    assert text.index("The pass key is 12345.") > 0 and text.count("12345") == 3


def test_passkey_rows_are_deterministic_and_train_eval_disjoint(tokenizer):
    def keys(rows):
        return [tokenizer.decode(row["input_ids"][-6:-1]) for row in rows]

    train = build_rows("passkey", tokenizer, 256, cp=2, split="train", seed=7, num_samples=40)
    again = passkey_rows(40, 256, tokenizer, seed=7)
    evaluation = build_rows("passkey", tokenizer, 256, cp=2, split="eval", seed=7, num_samples=40)
    assert len(train) == len(evaluation) == 40
    for row, same in zip(train, again, strict=True):
        assert all(torch.equal(row[key], same[key]) for key in row)
    train_rows = {tuple(row["input_ids"].tolist()) for row in train}
    assert not train_rows & {tuple(row["input_ids"].tolist()) for row in evaluation}
    assert keys(train) != keys(evaluation) and len(set(keys(train))) > 30
    assert keys(passkey_rows(5, 256, tokenizer, seed=8)) != keys(train[:5])
    examples = load_examples("passkey", seed=7, num_passkey=40)
    assert [str(key) for key in examples["passkey"]] == keys(train)
    with pytest.raises(ValueError, match="--context_length 64 is too short for the passkey task"):
        build_rows("passkey", tokenizer, 64, num_samples=1)


@pytest.mark.parametrize("digits", [1, 2, 5])
def test_passkey_keys_have_the_requested_digits(tokenizer, digits):
    rows = passkey_rows(60, 256, tokenizer, seed=3, digits=digits)
    keys = [tokenizer.decode(row["labels"][row["labels"] != IGNORE][:-1]) for row in rows]
    assert all(key.isdigit() and len(key) == digits for key in keys), keys
    assert len(set(keys)) >= min(10, 60 // 2) and (digits == 1 or not any(key.startswith("0") for key in keys))
    if digits == 1:
        assert "0" in keys  # one digit: 0..9, zero included
    text = tokenizer.decode(rows[0]["input_ids"])
    assert f"The pass key is {keys[0]}. Remember it. {keys[0]} is the pass key. " in text


def documents_of(row):
    """(start, end) of each packed document of a row, from its restarting position_ids."""
    starts = (row["position_ids"] == 0).nonzero().flatten().tolist()
    return list(zip(starts, starts[1:] + [len(row["position_ids"])]))


def test_passkey_warmup_packs_shorter_documents_first(tokenizer):
    """Note [Passkey length warm-up]: rows 0..11 of 1024 tokens hold 8, then 4, then 2 whole
    passkey documents, each its own task (bos, needle, question, answer), rows 12.. one; the
    last document of a row takes the row's remainder when the length does not divide."""
    assert passkey_warmup_lengths(16, 1024, 12) == [128] * 32 + [256] * 16 + [512] * 8 + [1024] * 4
    assert passkey_warmup_lengths(3, 1100, 3) == [137] * 7 + [141] + [275] * 4 + [550] * 2
    assert passkey_warmup_lengths(4, 512, 4) == [128] * 8 + [256] * 4  # 512 / 8 = 64 holds no task
    assert passkey_warmup_lengths(4, 200, 4) == [200] * 4  # no length holds the task: full rows
    assert passkey_warmup_lengths(4, 1024, 0) == [1024] * 4
    with pytest.raises(ValueError, match="warmup_rows must be in 0..4"):
        passkey_warmup_lengths(4, 1024, 5)

    rows = build_rows("passkey", tokenizer, 1024, cp=2, split="train", seed=5, num_samples=16,
                      passkey_digits=1, passkey_warmup_rows=12)
    assert len(rows) == 16
    keys = []
    for index, row in enumerate(rows):
        spans = documents_of(row)
        assert len(spans) == [8, 4, 2, 1][min(index // 4, 3)], index
        for start, end in spans:
            text = tokenizer.decode(row["input_ids"][start:end])
            labels = row["labels"][start:end]
            key = tokenizer.decode(labels[labels != IGNORE][:-1])
            assert text.startswith("<|bos|>") and text.endswith(f"What is the pass key? The pass key is {key}<|eos|>")
            assert f"The pass key is {key}. Remember it." in text and len(key) == 1
            assert (labels != IGNORE).sum() == 2 and labels[-1] == IGNORE  # the digit and eos; nothing crosses
            keys.append(key)
    assert len(keys) == 8 * 4 + 4 * 4 + 2 * 4 + 4 and len(set(keys)) == 10
    # eval rows and warm-up-free train rows are full-length documents, as before
    evaluation = build_rows("passkey", tokenizer, 1024, split="eval", seed=5, num_samples=4, passkey_warmup_rows=3)
    assert all(len(documents_of(row)) == 1 for row in evaluation)
    plain = build_rows("passkey", tokenizer, 1024, split="train", seed=5, num_samples=4, passkey_digits=1)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in
               zip(plain, passkey_rows(4, 1024, tokenizer, seed=5, digits=1), strict=True))


# ----------------------------------------------------------------------------- local files


def test_local_files_and_directories_load_in_every_format(tokenizer, tmp_path):
    records = [{"text": f"document {i:02d} " + "x" * i} for i in range(20)]
    (tmp_path / "data.json").write_text(json.dumps(records))
    write_jsonl(tmp_path / "data.jsonl", records)
    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "data.parquet"))
    folder = tmp_path / "folder"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", records[:10])
    write_jsonl(folder / "b.jsonl", records[10:])
    for source in ("data.json", "data.jsonl", "data.parquet", "folder"):
        train = build_rows(str(tmp_path / source), tokenizer, 64, cp=2, split="train")
        evaluation = build_rows(str(tmp_path / source), tokenizer, 64, cp=2, split="eval")
        train_text, eval_text = row_text(train, tokenizer), row_text(evaluation, tokenizer)
        # 5% of 20 documents: one, drawn with the seed (not the tail), is held out for eval
        held = int(np.random.default_rng(0).choice(20, 1, replace=False)[0])
        assert train_text.count("<|bos|>document") == 19 and f"document {held:02d}" not in train_text, source
        assert eval_text.startswith(f"<|bos|>document {held:02d} " + "x" * held + "<|eos|>"), source
        assert len(evaluation) == 1 and all(row["input_ids"].shape == (64,) for row in train + evaluation)
    assert held != 19  # the old hold-out was the last document
    # another seed holds out another document; the held-out one is never trained on
    other = row_text(build_rows(str(tmp_path / "data.jsonl"), tokenizer, 64, split="eval", seed=3), tokenizer)
    assert other.split("<|eos|>")[0] != eval_text.split("<|eos|>")[0]


def test_text_file_is_one_document_and_eval_is_its_tail(tokenizer, tmp_path):
    body = "".join(f"line {i}: the quick brown fox. 日本\n" for i in range(40))
    (tmp_path / "book.txt").write_text(body)
    train = build_rows(str(tmp_path / "book.txt"), tokenizer, 128, split="train")
    evaluation = build_rows(str(tmp_path / "book.txt"), tokenizer, 128, split="eval")
    cut = round(0.95 * len(body))
    assert row_text(train, tokenizer).split("<|pad|>")[0] == f"<|bos|>{body[:cut]}<|eos|>"
    assert row_text(evaluation, tokenizer).split("<|pad|>")[0] == f"<|bos|>{body[cut:]}<|eos|>"


def test_instruction_and_chat_files_mask_prompts(tokenizer, tmp_path):
    alpaca = [{"instruction": f"Say {i}.", "input": "", "output": f"{i}"} for i in range(10)]
    chats = [{"messages": CHAT} for _ in range(10)]
    for name, records, answer in (("alpaca.jsonl", alpaca, "0<|eos|>"), ("chat.jsonl", chats, "yo!<|eos|>")):
        rows = build_rows(str(write_jsonl(tmp_path / name, records)), tokenizer, 512, split="train")
        targets = torch.cat([row["labels"] for row in rows])
        assert tokenizer.decode(targets[targets != IGNORE]).startswith(answer), name
        assert "Below is an instruction" not in tokenizer.decode(targets[targets != IGNORE])


def test_missing_and_unusable_datasets_have_clear_errors(tokenizer, tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match=r"--dataset .*nope\.jsonl"):
        load_examples(str(missing))
    with pytest.raises(FileNotFoundError, match=r"--dataset './data/corpus'"):
        load_examples("./data/corpus")
    bad = write_jsonl(tmp_path / "qa.jsonl", [{"question": "q", "answer": "a"}] * 3)
    with pytest.raises(ValueError, match=r"columns \['answer', 'question'\].*text: .*instruction \(alpaca\).*chat: "):
        load_examples(str(bad))
    empty = write_jsonl(tmp_path / "empty.jsonl", [{"text": ""}] * 4)
    with pytest.raises(ValueError, match=r"--dataset .*empty\.jsonl.*no usable text"):
        build_rows(str(empty), tokenizer, 64)
    with pytest.raises(ValueError, match="--context_length 60 must be a multiple of 2 x cp = 8"):
        build_rows(str(empty), tokenizer, 60, cp=4)


@pytest.mark.parametrize("content", ["", "\n  \n"])
def test_an_empty_file_is_refused_by_name(tmp_path, content):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(content)
    with pytest.raises(ValueError, match=r"--dataset '.*empty\.jsonl' is empty: it holds no rows"):
        load_examples(str(empty))
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(ValueError, match=r"--dataset '.*empty\.json' is empty: it holds no rows"):
        load_examples(str(tmp_path / "empty.json"))


def test_malformed_json_names_the_line(tmp_path, capfd):
    lines = ['{"text": "one"}', "", '{"text": "two"}', '{"text": "three"', '{"text": "four"}']
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    capfd.readouterr()
    with pytest.raises(ValueError, match=r"bad\.jsonl': line 4 is not valid JSON \(.*\): '\{\"text\": \"three\"'"):
        load_examples(str(bad))
    # only our line: not datasets' "Failed to load JSON ... in row 2" (its own count) nor its progress bars
    assert capfd.readouterr() == ("", "")
    array = tmp_path / "bad.json"
    array.write_text('[\n {"text": "one"},\n {"text": "two" oops}\n]\n')
    with pytest.raises(ValueError, match=r"bad\.json': invalid JSON at line 3, column"):
        load_examples(str(array))


@pytest.mark.parametrize("records, column, rows", [
    ([{"text": "a"}, {"txt": "b"}, {"text": None}, {"text": "d"}], "text", "rows 2, 3"),
    ([{"instruction": "i", "output": "o"}, {"instruction": "i"}], "output", "rows 2"),
    ([{"messages": CHAT}, {"messages": None}, {"messages": CHAT}], "messages", "rows 2"),
])
def test_rows_without_the_needed_value_are_refused_not_dropped(tmp_path, records, column, rows):
    path = write_jsonl(tmp_path / "rows.jsonl", records)
    with pytest.raises(ValueError, match=rf"of {len(records)} rows have no '{column}' value \(missing or null; {rows}\)"):
        load_examples(str(path))


def test_unknown_names_are_tried_as_hub_ids(monkeypatch):
    def offline(name, *args, **kwargs):
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ConnectionError, match="Couldn't reach 'someone/corpus'") as caught:
        load_examples("someone/corpus")
    assert "treated as a HuggingFace hub dataset id" in "".join(getattr(caught.value, "__notes__", [str(caught.value)]))

    # a hub dataset with its own validation split uses it for eval instead of holding out
    splits = {"train": [f"train {i}" for i in range(4)], "validation": ["held out"]}
    hub = datasets.DatasetDict({name: datasets.Dataset.from_dict({"text": texts}) for name, texts in splits.items()})
    monkeypatch.setattr(datasets, "load_dataset", lambda name, *args, **kwargs: hub)
    assert load_examples("someone/corpus", split="train")["text"] == splits["train"]
    assert load_examples("someone/corpus", split="eval")["text"] == ["held out"]


# ----------------------------------------------------------------------------- loader


def numbered_rows(count, length=4):
    """Row i is filled with the value i, so batches show which rows they hold."""
    return [{"input_ids": torch.full((length,), i), "labels": torch.full((length,), i)} for i in range(count)]


def row_numbers(batch):
    return batch["input_ids"][:, 0].tolist()


def test_loader_gives_disjoint_dp_slices_of_the_same_global_order():
    rows, batch_size, dp_size = numbered_rows(11), 2, 2
    loaders = [DistributedRowLoader(rows, batch_size, rank, dp_size, seed=5) for rank in range(dp_size)]
    assert all(loader.steps_per_epoch == 2 for loader in loaders)  # 11 // 4, the last 3 rows dropped
    order = loaders[0].epoch_order(0).tolist()
    assert order == loaders[1].epoch_order(0).tolist() and sorted(order) == sorted(set(order))
    per_rank = [list(loader) for loader in loaders]
    for step in range(2):
        batches = [per_rank[rank][step] for rank in range(dp_size)]
        assert all(batch["input_ids"].shape == (batch_size, 4) for batch in batches)
        assert row_numbers(batches[0]) + row_numbers(batches[1]) == order[4 * step : 4 * step + 4]
    assert loaders[0].state_dict() == {"epoch": 1, "batch_index": 0}
    second_epoch = [row_numbers(batch) for batch in loaders[0]]
    assert second_epoch != [row_numbers(batch) for batch in per_rank[0]]  # reshuffled
    assert loaders[0].epoch_order(1).tolist() != order


def test_loader_resumes_exactly_from_its_state():
    rows = numbered_rows(24)
    reference = DistributedRowLoader(rows, batch_size=3, dp_rank=1, dp_size=2, seed=1)
    seen, states = [], []
    for _ in range(4):  # four epochs of 4 steps
        for batch in reference:
            states.append(reference.state_dict())
            seen.append(row_numbers(batch))
    assert states[3] == {"epoch": 1, "batch_index": 0} and states[5] == {"epoch": 1, "batch_index": 2}
    for consumed in (1, 4, 6, 9):
        resumed = DistributedRowLoader(rows, batch_size=3, dp_rank=1, dp_size=2, seed=1)
        resumed.load_state_dict(states[consumed - 1])
        remaining = [row_numbers(batch) for batch in resumed]
        assert remaining == seen[consumed : (consumed // 4 + 1) * 4]  # up to the end of that epoch
        next_epoch = (consumed // 4 + 1) * 4
        assert [row_numbers(batch) for batch in resumed] == seen[next_epoch : next_epoch + 4]
    with pytest.raises(ValueError, match="batch_index=9 is outside this data: 4 batches per epoch"):
        reference.load_state_dict({"epoch": 0, "batch_index": 9})


def test_loader_without_drop_last_and_too_few_rows():
    loader = DistributedRowLoader(numbered_rows(5), batch_size=2, dp_rank=0, dp_size=2, shuffle=False, drop_last=False)
    assert loader.steps_per_epoch == 2
    assert loader.epoch_order(0).tolist() == [0, 1, 2, 3, 4, 0, 1, 2]  # completed from the start
    assert [row_numbers(batch) for batch in loader] == [[0, 1], [4, 0]]
    with pytest.raises(ValueError, match=r"3 rows are fewer than one global batch of batch_size\(2\) x dp\(2\) = 4"):
        DistributedRowLoader(numbered_rows(3), batch_size=2, dp_rank=0, dp_size=2)


def test_every_file_type_read_is_one_a_dataset_path_is_checked_for():
    # --dataset ending like a file that loading reads is checked as a local path when the flag is given
    # (llama_cp.data.grammar.check_dataset_path), never taken for a hub id
    assert set(FILE_BUILDERS) <= set(LOCAL_FILE_SUFFIXES), set(FILE_BUILDERS) - set(LOCAL_FILE_SUFFIXES)
