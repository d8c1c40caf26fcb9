"""Preference pairs (llama_cp/data/preference.py): TRL's preference formats made into
(chosen, rejected) documents, pairs packed whole into rows (Note [Packed preference pairs]),
and their sequence_ids sharded over cp as the labels are.

Byte tokenizer ids: a byte is its own id; 256 pad, 257 bos, 258 eos.
"""

from pathlib import Path

import pytest
import torch

from llama_cp.data.chat import ChatRenderError
from llama_cp.data.preference import (
    detect_preference_format,
    pack_pairs,
    preference_pairs,
    tokenize_pair,
    truncate_pair,
)
from llama_cp.data.tokenizer import byte_tokenizer
from llama_cp.parallel import sharding

PAD, BOS, EOS = 256, 257, 258
TEMPLATES = Path(__file__).parent / "chat_templates"


def ids(text):
    return list(text.encode())


def qwen_tokenizer():
    """The byte tokenizer with Qwen2.5-Instruct's special tokens and chat template (no bos, eos <|im_end|>)."""
    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|endoftext|>"], "eos_token": "<|im_end|>"})
    tokenizer.bos_token = None
    tokenizer.chat_template = (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    return tokenizer


def marked(document, tokenizer):
    """The document's text with each run of scored tokens between « and »."""
    text, run, scored = "", [], False
    for token, mask in [*zip(*document), (None, None)]:
        if mask != scored or token is None:
            piece = tokenizer.decode(run)
            text += f"«{piece}»" if scored and piece else piece
            run, scored = [], mask
        run.append(token)
    return text


def user(content):
    return {"role": "user", "content": content}


def assistant(content):
    return {"role": "assistant", "content": content}


def test_detect_preference_format_by_columns():
    assert detect_preference_format(["prompt", "chosen", "rejected", "score"]) == "preference"
    assert detect_preference_format(["chosen", "rejected"]) == "implicit_preference"
    with pytest.raises(ValueError, match=r"columns \['chosen', 'prompt'\].*implicit_preference"):
        detect_preference_format(["prompt", "chosen"])


def test_string_pair_scores_the_completion_and_eos_after_bos_and_the_prompt():
    chosen, rejected = tokenize_pair({"prompt": "Q:", "chosen": "ab", "rejected": "c"}, byte_tokenizer())
    assert chosen == ([BOS, *ids("Q:ab"), EOS], [False, False, False, True, True, True])
    assert rejected == ([BOS, *ids("Q:c"), EOS], [False, False, False, True, True])
    no_bos = byte_tokenizer()
    no_bos.bos_token = None
    assert tokenize_pair({"prompt": "Q:", "chosen": "ab", "rejected": "c"}, no_bos)[1] == (
        [*ids("Q:c"), EOS], [False, False, True, True])


QWEN_PROMPT = [{"role": "system", "content": "be brief"}, user("hi"), assistant("yo!"), user("bye")]
QWEN_RENDERED_PROMPT = (
    "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    "yo!<|im_end|>\n<|im_start|>user\nbye<|im_end|>\n<|im_start|>assistant\n"
)


def test_conversational_pair_scores_only_the_last_assistant_message_through_its_end_of_turn():
    """The prompt's assistant turn ("yo!") is prompt; the template's newline after <|im_end|> and
    the eos the encoder appends are not scored."""
    tokenizer = qwen_tokenizer()
    chosen, rejected = tokenize_pair(
        {"prompt": QWEN_PROMPT, "chosen": [assistant("ciao")], "rejected": [assistant("no")]}, tokenizer)
    assert marked(chosen, tokenizer) == QWEN_RENDERED_PROMPT + "«ciao<|im_end|>»\n<|im_end|>"
    assert marked(rejected, tokenizer) == QWEN_RENDERED_PROMPT + "«no<|im_end|>»\n<|im_end|>"
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert [t for t, scored in zip(*chosen) if scored] == [*ids("ciao"), im_end]
    # a completion of several messages: only its last is scored, the assistant turn before it is prompt
    longer = tokenize_pair({"prompt": QWEN_PROMPT[:2], "chosen": [assistant("yo!"), user("bye"), assistant("ciao")],
                            "rejected": [assistant("no")]}, tokenizer)[0]
    assert longer == chosen


def test_implicit_prompt_is_the_longest_common_prefix_of_the_conversations():
    tokenizer = qwen_tokenizer()
    explicit = tokenize_pair({"prompt": QWEN_PROMPT, "chosen": [assistant("ciao")], "rejected": [assistant("no")]},
                             tokenizer)
    implicit = tokenize_pair({"chosen": [*QWEN_PROMPT, assistant("ciao")],
                              "rejected": [*QWEN_PROMPT, assistant("no")]}, tokenizer)
    assert implicit == explicit


@pytest.mark.parametrize("example, message", [
    ({"chosen": [user("a"), assistant("b")], "rejected": [user("c"), assistant("d")]},
     "row 2: 'chosen' and 'rejected' share no first message.*add a 'prompt' column"),
    ({"chosen": [user("a"), assistant("b"), user("c")], "rejected": [user("a"), assistant("d")]},
     "row 2: the 'chosen' completion must end with an assistant message.*'user'"),
    ({"chosen": [user("a"), assistant("b")], "rejected": [user("a"), assistant("b")]},
     "row 2: 'chosen' and 'rejected' are the same conversation, so it has no completion"),
    ({"chosen": [user("a")], "rejected": [user("a"), assistant("b")]},
     "row 2: 'chosen' is all prompt"),
    ({"chosen": "a b", "rejected": "a c"}, "row 2: 'chosen' and 'rejected' without a 'prompt' must be message lists"),
    ({"prompt": [user("a")], "chosen": [], "rejected": [assistant("b")]},
     "row 2: the 'chosen' completion must end with an assistant message.*got no messages"),
    ({"prompt": "a", "chosen": [assistant("b")], "rejected": [assistant("c")]},
     "row 2: 'prompt', 'chosen' and 'rejected' must all be strings or all be message lists, got str, list and list"),
])
def test_rows_that_make_no_pair_are_refused_naming_the_row(example, message):
    good = {"prompt": [user("a")], "chosen": [assistant("b")], "rejected": [assistant("c")]}
    with pytest.raises(ChatRenderError, match=message):
        list(preference_pairs([good, example], qwen_tokenizer()))


def string_pair(prompt, chosen, rejected):
    return tokenize_pair({"prompt": prompt, "chosen": chosen, "rejected": rejected}, byte_tokenizer())


def test_pairs_are_packed_whole_chosen_then_rejected_never_split_over_rows():
    """9 + 9 tokens do not fit 16: the second pair starts row 1 (it would have been split), where
    the third (3 + 3) joins it."""
    rows = pack_pairs([string_pair("Q", "ab", "c"), string_pair("R", "d", "ef"), string_pair("", "g", "h")], 16,
                      cp=2, pad_id=PAD)
    _ = -100
    expected = [
        {"input_ids": [BOS, *ids("Qab"), EOS, BOS, *ids("Qc"), EOS] + [PAD] * 7,
         "labels": [_, *ids("ab"), EOS, _, _, *ids("c"), EOS, _] + [_] * 7,
         "position_ids": [0, 1, 2, 3, 4, 0, 1, 2, 3, *range(4, 11)],
         "sequence_ids": [-1, 0, 0, 0, -1, -1, 1, 1, -1] + [-1] * 7, "pair_count": 1},
        {"input_ids": [BOS, *ids("Rd"), EOS, BOS, *ids("Ref"), EOS, BOS, *ids("g"), EOS, BOS, *ids("h"), EOS, PAD],
         "labels": [_, *ids("d"), EOS, _, _, *ids("ef"), EOS, _, *ids("g"), EOS, _, *ids("h"), EOS, _, _],
         "position_ids": [0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3],
         "sequence_ids": [-1, 0, 0, -1, -1, 1, 1, 1, -1, 2, 2, -1, 3, 3, -1, -1], "pair_count": 2},
    ]
    assert [{key: value.tolist() for key, value in row.items()} for row in rows] == expected
    with pytest.raises(ValueError, match="no preference pairs"):
        pack_pairs([], 16)


def test_a_pair_longer_than_a_row_is_refused_or_its_completions_truncated():
    long_chosen = string_pair("Q", "abcdefghij", "xyz")  # 13 + 6 tokens
    with pytest.raises(ValueError, match=r"preference pair 1: its sequences \(13 \+ 6 tokens\) do not fit a row of "
                                         r"--context_length 16 .*--truncate_documents"):
        pack_pairs([string_pair("Q", "a", "b"), long_chosen], 16)
    # the prompts take 2 + 2 tokens: 12 are left; the rejected completion (4 with eos) stays whole
    row, = pack_pairs([long_chosen], 16, pad_id=PAD, truncate=True)
    assert row["input_ids"].tolist() == [BOS, *ids("Qabcdefgh"), BOS, *ids("Qxyz"), EOS]
    assert row["labels"].tolist() == [-100, *ids("abcdefgh"), -100, -100, *ids("xyz"), EOS, -100]
    assert row["sequence_ids"].tolist() == [-1, *[0] * 8, -1, -1, *[1] * 4, -1]
    # both long: each completion cut to 6 tokens
    assert truncate_pair(string_pair("Q", "abcdefghij", "klmnopqrst"), 16) == (
        ([BOS, *ids("Qabcdef")], [False, False, *[True] * 6]), ([BOS, *ids("Qklmnop")], [False, False, *[True] * 6]))
    # prompts of 7 tokens leave one completion token each; of 8, none: refused
    assert truncate_pair(string_pair("012345", "ab", "cd"), 16) == (
        ([BOS, *ids("012345a")], [*[False] * 7, True]), ([BOS, *ids("012345c")], [*[False] * 7, True]))
    with pytest.raises(ValueError, match=r"preference pair 0: the prompts \(8 \+ 8 tokens\) leave 0 of the row's 16 "
                                         r"tokens .*raise --context_length"):
        pack_pairs([string_pair("0123456", "ab", "cd")], 16, truncate=True)
    assert pack_pairs([string_pair("Q", "ab", "c")], 16, truncate=True)[0]["input_ids"][:9].tolist() == [
        BOS, *ids("Qab"), EOS, BOS, *ids("Qc"), EOS]  # a pair that fits is not cut


@pytest.mark.parametrize("layout", ["zigzag", "documents"])
def test_sequence_ids_are_sharded_over_cp_as_the_labels_are(layout, monkeypatch):
    """cp 2, one process: each rank's shard of sequence_ids holds the same positions as its shard
    of labels, and the ranks' scored (sequence, target) tokens together are the row's."""
    rows = pack_pairs([string_pair("Q", "ab", "c"), string_pair("R", "d", "ef"), string_pair("", "g", "h")], 16,
                      cp=2, pad_id=PAD)
    batch = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}  # (2, 16); pair_count (2,)
    shards, scored = [], []
    for rank in range(2):
        monkeypatch.setattr(sharding, "cp_rank_and_size", lambda cp, rank=rank: (rank, 2))
        local = sharding.shard_batch(batch, None, layout=layout)
        index = local["seq_index"] if layout == "documents" else sharding.zigzag_index(16, 2, rank)
        assert local["sequence_ids"].shape == (2, 8)
        for key in ("sequence_ids", "labels", "position_ids", "input_ids"):
            assert torch.equal(local[key], batch[key][:, index]), key
        assert torch.equal(local["pair_count"], torch.tensor([1, 2]))
        shards.append(local)
        scored += [(row, s, t) for row in range(2)
                   for s, t in zip(local["sequence_ids"][row].tolist(), local["labels"][row].tolist()) if t != -100]
    full = [(row, s, t) for row in range(2)
            for s, t in zip(batch["sequence_ids"][row].tolist(), batch["labels"][row].tolist()) if t != -100]
    assert sorted(scored) == sorted(full) and all(s >= 0 for _, s, _ in scored)
    assert torch.equal(batch["sequence_ids"] >= 0, batch["labels"] != -100)
    if layout == "zigzag":
        assert torch.equal(sharding.unshard_sequence([local["sequence_ids"] for local in shards]), batch["sequence_ids"])
    else:
        assert sorted(torch.cat([local["seq_index"] for local in shards]).tolist()) == list(range(16))


def write_pairs(path, count=9):
    """A preference jsonl: string pairs of varied lengths, one conversational row is not allowed
    with strings in a source, so all are strings."""
    import json

    with open(path, "w") as f:
        for i in range(count):
            f.write(json.dumps({"prompt": f"Q{i}: " + "x" * (i % 4), "chosen": f" yes {i}" + "!" * (i % 3),
                                "rejected": f" no {i}" + "?" * (i % 5), "score": i}) + "\n")
    return str(path)


def test_prepared_pairs_read_back_as_pack_pairs_packs_them(tmp_path):
    """prepare_dataset(objective="dpo") stores pairs in the SFT row layout; PreferenceRows finds every
    row's sequence_ids and pair_count again, equal to pack_pairs' (and row_index); summary counts pairs."""
    import json

    from llama_cp.data.mixture import DataSpec
    from llama_cp.data.preference import PAIR_COUNT, ROW_INDEX, SEQUENCE_IDS
    from llama_cp.data.prepared import load_prepared_rows

    data = write_pairs(tmp_path / "pairs.jsonl")
    tokenizer = byte_tokenizer()
    said = []
    train, evaluation = load_prepared_rows(DataSpec(data, eval_fraction=0), tokenizer, 64, 2,
                                           cache_dir=str(tmp_path / "cache"), say=said.append, objective="dpo")
    with open(data) as f:
        want = pack_pairs(preference_pairs([json.loads(line) for line in f], tokenizer), 64, 2, pad_id=PAD)
    assert len(train) == len(want) > 1 and len(evaluation) == 0
    assert any(int(row[PAIR_COUNT]) > 1 for row in want)  # several pairs in a row
    for index, expected in enumerate(want):
        got = train[index]
        assert set(got) == {*expected, ROW_INDEX} and int(got[ROW_INDEX]) == index
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=lambda m, key=key: f"row {index} {key}: {m}")
    assert (torch.cat([train[i][SEQUENCE_IDS] for i in range(len(train))]) >= 0).any()
    assert any(line.startswith("train: 9 pairs (preference 9) -> ") for line in said), said
    # the same file for SFT is another cache key, and is refused naming the flag and the fix
    with pytest.raises(ValueError, match=r"--dataset '.*pairs.jsonl' holds preference pairs .* --objective dpo"):
        load_prepared_rows(DataSpec(data, eval_fraction=0), tokenizer, 64, 2, cache_dir=str(tmp_path / "cache"),
                           say=said.append)


def test_dpo_on_sft_data_is_refused_naming_the_formats(tmp_path):
    from llama_cp.data.mixture import DataSpec
    from llama_cp.data.prepared import prepare_dataset

    path = tmp_path / "text.jsonl"
    path.write_text('{"text": "hello"}\n{"text": "world"}\n')
    with pytest.raises(ValueError, match=r"--objective dpo trains on preference pairs, and --dataset '.*text.jsonl' "
                                         r"is in the text format"):
        prepare_dataset(DataSpec(str(path), eval_fraction=0), byte_tokenizer(), 64, cache_dir=str(tmp_path / "c"),
                        objective="dpo")


def test_batch_sequences_numbers_the_batch_as_one_and_counts_each_sequence():
    from llama_cp.data.preference import SEQUENCE_IDS, SEQUENCE_LENGTHS, batch_sequences

    rows = pack_pairs([string_pair("P", "ab", "c"), string_pair("Q", "d", "efg"), string_pair("R", "hi", "j")], 24,
                      pad_id=PAD)
    assert [int(row["pair_count"]) for row in rows] == [2, 1]
    batch = batch_sequences({key: torch.stack([row[key] for row in rows]) for key in rows[0]})
    ids = batch[SEQUENCE_IDS]
    assert sorted(ids[0].unique().tolist()) == [-1, 0, 1, 2, 3] and sorted(ids[1].unique().tolist()) == [-1, 4, 5]
    # completion + eos scored: ab -> 3, c -> 2, d -> 2, efg -> 4, hi -> 3, j -> 2
    assert batch[SEQUENCE_LENGTHS].tolist() == [3, 2, 2, 4, 3, 2]


def test_passkey_pairs_share_the_prompt_and_differ_in_the_key():
    from llama_cp.data.preference import passkey_pairs
    from llama_cp.data.tokenizer import build_tokenizer
    from llama_cp.model.build import model_path

    tokenizer = build_tokenizer(model_path("embedded"), "")
    pairs = passkey_pairs(6, 256, tokenizer, seed=3)
    for (chosen, chosen_mask), (rejected, rejected_mask) in pairs:
        prompt = chosen_mask.index(True)
        assert rejected_mask.index(True) == prompt and chosen[:prompt] == rejected[:prompt]
        assert chosen[prompt:] != rejected[prompt:] and chosen[-1] == rejected[-1] == tokenizer.eos_token_id
        assert len(chosen) + len(rejected) <= 256
    key = tokenizer.decode(pairs[0][0][0][pairs[0][0][1].index(True):-1])
    assert f"The pass key is {key}." in tokenizer.decode(pairs[0][0][0])  # the needle holds the chosen key
    assert passkey_pairs(6, 256, tokenizer, seed=3) == pairs and passkey_pairs(6, 256, tokenizer, "eval", 3) != pairs
    assert all(int(row["pair_count"]) == 1 for row in pack_pairs(pairs, 256))
