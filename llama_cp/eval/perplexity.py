"""Loss and perplexity on your own documents by context length and by position within it
(``--task perplexity``, ``--eval_perplexity``; Note [Perplexity by position])."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from llama_cp.model.loss import IGNORE_INDEX, causal_lm_loss_sum
from llama_cp.parallel.mesh import submesh
from llama_cp.parallel.sharding import shard_batch

#: The task that reads documents instead of building rows.
PERPLEXITY = "perplexity"
#: Position buckets of each length (--buckets, and --eval_perplexity's).
DEFAULT_BUCKETS = 4


# Note [Perplexity by position]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Does the loss keep falling as the model sees more of a document? Each document of at least
# max(--lengths) + 1 tokens is tokenized as training does (bos, text, eos; labels where training
# trains: every token of a text, the completion of a prompt/completion, a chat's assistant
# turns) and evaluated alone in a row, never packed: at each length L its first L tokens, the
# labels the next L (hence the + 1). The same documents at every length, so the lengths compare.
# Each length's positions are cut into --buckets equal ranges (the last takes the remainder),
# L = 256, --buckets 4:
#
#   positions   0 ......... 63 | 64 ....... 127 | 128 ....... 191 | 192 ....... 255
#   bucket             0               1                 2                 3
#
# A position's loss is that of predicting the token after it from the tokens up to it. Per
# length: tokens (labels counted), loss (their mean) and perplexity exp(loss); per bucket the
# same over its positions. The per-token losses come from the chunked loss's own chunks
# (return_token_losses), so no row's full logits are built; under CP each rank adds up its own
# tokens by their position_ids, and the sums are reduced over every rank.


def long_documents(
    parts: Iterable[tuple[Any, Any]], tokenizer, min_tokens: int, count: int, *, spec, name: str,
    minimum: int | None = None, fix: str = "lower --lengths or --num_samples, or give longer documents",
) -> list[tuple[list[int], list[bool]]]:
    """The first ``count`` documents of ``parts`` ((source, examples) pairs, read in turn) that hold at
    least ``min_tokens`` tokens, some of them scored, tokenized as training does (``tokenize_row``) and
    cut to their first ``min_tokens``. ValueError naming ``name``, the longest document and ``fix`` when
    fewer than ``minimum`` (default ``count``) do. Rows that cannot be rendered are skipped, and so are
    those whose first ``min_tokens`` are all unscored (the prompt of an instruction or chat row: its
    completion comes later), which no length could measure."""
    from llama_cp.data.formats import detect_format
    from llama_cp.data.mixture import tokenize_row
    from llama_cp.data.sources import ROW_NUMBER

    found, seen, longest, unscored = [], 0, 0, 0
    for source, examples in parts:
        if detect_format(examples.column_names) == "passkey":
            raise ValueError(f"{source.flag} {source.name!r}: passkey rows are not natural text; perplexity reads "
                             "text, prompt/completion, instruction or chat documents")
        for index, example in enumerate(examples):
            where = f"row {example.get(ROW_NUMBER, index + 1)} of {source.flag} {source.name!r}"
            (input_ids, label_mask), _ = tokenize_row(example, tokenizer, where, spec)
            seen, longest = seen + 1, max(longest, len(input_ids))
            if len(input_ids) < min_tokens:
                continue
            if not any(label_mask[1:min_tokens]):  # perplexity_row's labels: none scored at any length
                unscored += 1
                continue
            found.append((input_ids[:min_tokens], label_mask[:min_tokens]))
            if len(found) == count:
                return found
    if len(found) < (count if minimum is None else minimum):
        held = f"only {len(found)} of its {seen} documents hold" if found else f"none of its {seen} documents holds"
        skipped = f" and some scored ({unscored} hold as many tokens, all prompt: an instruction or chat row scores " \
                  "only its completion, which comes later)" if unscored else ""
        raise ValueError(f"{name}: {held} at least {min_tokens} tokens (the longest length + 1, the last label)"
                         f"{skipped}, {count} wanted; the longest has {longest} tokens: {fix}")
    return found


def perplexity_row(document: tuple[list[int], list[bool]], length: int) -> dict[str, torch.Tensor]:
    """The first ``length`` tokens of a (input_ids, label_mask) document as one row: labels the next
    tokens where training trains them (as Note [Packed rows] shifts them), positions from 0."""
    input_ids = torch.tensor(document[0][: length + 1], dtype=torch.long)  # (length + 1,)
    trained = torch.tensor(document[1][1 : length + 1], dtype=torch.bool)  # (length,): is the next token trained
    return {"input_ids": input_ids[:-1], "labels": input_ids[1:].masked_fill(~trained, IGNORE_INDEX),
            "position_ids": torch.arange(length)}


@torch.no_grad()
def evaluate_perplexity(
    model, mesh, documents: Sequence[tuple[list[int], list[bool]]], lengths: Sequence[int],
    buckets: int = DEFAULT_BUCKETS, *, device: torch.device | str = "cpu", layout: str = "zigzag",
) -> dict:
    """Loss and perplexity of ``model`` (``build_model``'s: CP attention, the chunked loss) on the first L
    tokens of each document at each length L, by position bucket (Note [Perplexity by position]):
    ``{"task", "documents", "lengths", "buckets", "per_length": [{"length", "tokens", "loss",
    "perplexity", "buckets": [{"start", "end", "tokens", "loss", "perplexity"}, ...]}, ...]}`` (loss
    and perplexity None where nothing is scored). The dp ranks split the documents, the cp ranks
    share each row (``layout``: shard_batch's); every rank returns the same result."""
    dp = submesh(mesh, "dp")
    was_training = model.training
    model.eval()
    per_length = []
    for length in lengths:
        edges = [part * length // buckets for part in range(buckets + 1)]
        inner = torch.tensor(edges[1:-1], device=device)
        sums = torch.zeros(buckets, dtype=torch.float64, device=device)
        counts = torch.zeros(buckets, dtype=torch.float64, device=device)
        # every dp rank runs the same number of forwards (FSDP collectives); extra rows are not counted
        for index in range(dp.get_local_rank(), -(-len(documents) // dp.size()) * dp.size(), dp.size()):
            row = perplexity_row(documents[min(index, len(documents) - 1)], length)
            local = shard_batch({k: v[None] for k, v in row.items()}, mesh["cp"], layout=layout)
            local = {k: v.to(device) for k, v in local.items()}
            _, losses = causal_lm_loss_sum(model, local, return_token_losses=True)  # (1, local tokens)
            if index >= len(documents):
                continue
            scored = local["labels"] != IGNORE_INDEX
            bucket = torch.bucketize(local["position_ids"][scored], inner, right=True)
            sums.index_add_(0, bucket, losses[scored].double())
            counts.index_add_(0, bucket, torch.ones_like(bucket, dtype=torch.float64))
        dist.all_reduce(sums)  # every rank's tokens are its own (dp: documents, cp: positions)
        dist.all_reduce(counts)
        parts = [dict(start=start, end=end, **_mean_loss(total, tokens))
                 for start, end, total, tokens in zip(edges, edges[1:], sums.tolist(), counts.tolist())]
        per_length.append({"length": length, **_mean_loss(sum(sums.tolist()), sum(counts.tolist())),
                           "buckets": parts})
    model.train(was_training)
    return {"task": PERPLEXITY, "documents": len(documents), "lengths": list(lengths), "buckets": buckets,
            "per_length": per_length}


def _mean_loss(total: float, tokens: float) -> dict[str, Any]:
    loss = total / tokens if tokens else None
    return {"tokens": int(tokens), "loss": loss,
            "perplexity": None if loss is None else math.exp(loss) if loss < 700 else math.inf}


def format_perplexity(result: dict) -> str:
    """The perplexity table as text: one line per length, then the loss of each position bucket."""
    def shown(value, spec):
        return "-" if value is None else format(value, spec)

    lines = [f"perplexity on {result['documents']} documents, each at every length (its first L tokens); loss by "
             f"position in {result['buckets']} equal ranges of each length",
             f"{'length':>8} {'tokens':>9} {'loss':>8} {'perplexity':>11} | loss by position"]
    for row in result["per_length"]:
        lines.append(f"{row['length']:>8} {row['tokens']:>9} {shown(row['loss'], '.4f'):>8} "
                     f"{shown(row['perplexity'], '.3f'):>11} | "
                     + " ".join(shown(part["loss"], ".4f") for part in row["buckets"]))
    return "\n".join(lines)
