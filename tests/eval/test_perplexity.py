"""llama_cp/eval/perplexity.py: the per-token losses it reads, the long documents and the rows
made of them, and --eval_perplexity's refusal of the passkey task (CP against a single-process
reference: tests/eval/test_eval_longctx.py)."""

import json

import pytest
import torch
import torch.nn.functional as F

from llama_cp.data.tokenizer import byte_tokenizer
from llama_cp.eval.perplexity import long_documents, perplexity_row


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return str(path)


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
    shifts them (a prompt's tokens unscored); a document whose first tokens are all unscored is skipped."""
    from llama_cp.data.mixture import DataSpec
    from llama_cp.data.packing import pack_documents
    from llama_cp.data.sources import load_source
    from llama_cp.data.grammar import parse_sources

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
    # a document whose first min_tokens are all prompt has nothing to score at any length: skipped, and said
    d = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p" * 80, "completion": "g" * 10}])
    assert [tokenizer.decode(ids[1:3]) for ids, _ in read(f"{d},{c}", 65, 2)] == ["ee", "ff"]
    assert len(read(d, 90, 1)) == 1  # its completion inside the first 90 tokens: scored, read
    with pytest.raises(ValueError, match=r"none of its 1 documents holds at least 65 tokens \(the longest length \+ 1, "
                                         r"the last label\) and some scored \(1 hold as many tokens, all prompt"):
        read(d, 65, 1)


def test_eval_perplexity_needs_natural_text():
    from llama_cp.config import TrainConfig

    with pytest.raises(ValueError, match="^--eval_perplexity measures the loss on natural text, and the passkey task"):
        TrainConfig.from_flags(eval_perplexity=True)
