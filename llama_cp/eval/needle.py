"""Retrieval over a grid of context lengths x needle depths (``--task passkey`` or ``needle``).

One sample is one row: filler sentences, the needle at the given depth, then the question; it
is right when the model's prediction of every token of the key is right. With teacher forcing
that is greedy decoding's exact match, so one forward per row decides it.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence

import torch
import torch.distributed as dist

from llama_cp.data.passkey import PASSKEY_DIGITS, PASSKEY_FILLER, passkey_example
from llama_cp.model.loss import IGNORE_INDEX, causal_lm_loss_sum
from llama_cp.parallel.mesh import submesh
from llama_cp.parallel.sharding import check_context_length, shard_batch

#: The retrieval tasks: the training task's needle and question, and a needle unlike it (RULER's magic number).
RETRIEVAL_TASKS = {
    "passkey": {},
    "needle": dict(
        needle="The special magic number is {key}. ",
        question="What is the special magic number mentioned in the text? The special magic number is ",
    ),
}
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def parse_grid(lengths, depths, cp: int = 1) -> tuple[list[int], list[float]]:
    """--lengths and --depths as lists (comma-separated strings, or fire's tuples), checked."""
    def split(value):  # fire hands over "256,512" as a tuple, "256" as an int
        if isinstance(value, (int, float)):
            return [value]
        return [part for part in value.split(",") if part.strip()] if isinstance(value, str) else list(value)

    try:
        lengths = [int(v) for v in split(lengths)]
        depths = [float(v) for v in split(depths)]
    except ValueError as error:
        raise ValueError(f"--lengths and --depths are comma-separated numbers ({error})") from None
    if not lengths or not depths:
        raise ValueError("--lengths and --depths need at least one value each")
    for length in lengths:
        try:
            check_context_length(length, cp)
        except ValueError:
            raise ValueError(f"--lengths: {length} is not a multiple of 2 x cp = {2 * cp}") from None
    if any(not 0 <= depth <= 1 for depth in depths):
        raise ValueError(f"--depths are fractions of the filler in [0, 1], got {depths}")
    return sorted(set(lengths)), depths


def read_haystack(path: str) -> list[str]:
    """The sentences of the text file ``path`` (each keeps its full stop and a space)."""
    with open(os.path.expanduser(path), encoding="utf-8") as f:
        text = " ".join(f.read().split())
    sentences = [part.strip() + ". " for part in text.split(". ") if part.strip()]
    if not sentences:
        raise ValueError(f"--haystack {path!r} holds no text")
    return sentences


def retrieval_row(
    task: str, tokenizer, length: int, depth: float, seed: int, index: int, filler, digits: int = PASSKEY_DIGITS
) -> dict:
    """Row ``index`` of the (length, depth) cell: labels only on the key's tokens (``digits``
    digits; not the eos after it, which a general model has no reason to predict)."""
    # keys and filler are a function of this string, its old first word included: earlier results stay comparable
    rng = random.Random(f"eval_longctx:{task}:{seed}:{length}:{depth}:{index}")
    row = passkey_example(rng, length, tokenizer, depth=depth, digits=digits, filler=filler, task=task,
                          **RETRIEVAL_TASKS[task])
    row["labels"][row["labels"] == tokenizer.eos_token_id] = IGNORE_INDEX
    return row


@torch.no_grad()
def evaluate_grid(
    model, tokenizer, mesh, lengths: Sequence[int], depths: Sequence[float], num_samples: int, *,
    task: str = "passkey", seed: int = 0, filler=PASSKEY_FILLER, device: torch.device | str = "cpu",
    digits: int = PASSKEY_DIGITS,
) -> dict:
    """Accuracy of ``model`` (built by ``llama_cp.model.build.build_model``: CP attention and the chunked
    loss) per (length, depth): ``{"task", "lengths", "depths", "num_samples", "accuracy":
    [[...] per length] , "overall"}``. The dp ranks split the rows of a cell, the cp ranks
    share each row; every rank returns the same result."""
    dp = submesh(mesh, "dp")
    cp_group = mesh["cp"].get_group()
    was_training = model.training
    model.eval()
    accuracy = []
    for length in lengths:
        per_depth = []
        for depth in depths:
            correct = torch.zeros((), dtype=torch.float64, device=device)
            # every dp rank runs the same number of forwards (FSDP collectives); extra rows are not counted
            for index in range(dp.get_local_rank(), -(-num_samples // dp.size()) * dp.size(), dp.size()):
                row = retrieval_row(task, tokenizer, length, depth, seed, min(index, num_samples - 1), filler, digits)
                local = shard_batch({k: v[None] for k, v in row.items()}, mesh["cp"])
                local = {k: v.to(device) for k, v in local.items()}
                _, right = causal_lm_loss_sum(model, local, return_correct=True)
                wrong = (~right).sum().to(torch.float64)
                dist.all_reduce(wrong, group=cp_group)  # right when every key token is, on every cp rank
                correct += float(wrong.item() == 0 and index < num_samples)
            dist.all_reduce(correct, group=dp.get_group())
            per_depth.append(correct.item() / num_samples)
        accuracy.append(per_depth)
    model.train(was_training)
    cells = [value for per_depth in accuracy for value in per_depth]
    return {"task": task, "digits": digits, "lengths": list(lengths), "depths": list(depths), "num_samples": num_samples,
            "accuracy": accuracy, "overall": sum(cells) / len(cells)}


def format_grid(result: dict) -> str:
    """The accuracy table as text: one line per length, one column per depth."""
    header = "length \\ depth " + " ".join(f"{depth:>5.2f}" for depth in result["depths"])
    lines = [f"{result['task']} accuracy ({describe_keys(result)}, {result['num_samples']} samples per cell), overall "
             f"{result['overall']:.2f}", header]
    for length, row in zip(result["lengths"], result["accuracy"]):
        lines.append(f"{length:>14} " + " ".join(f"{value:>5.2f}" for value in row))
    return "\n".join(lines)


def describe_keys(result: dict) -> str:
    """How a grid's keys are written in its table and heatmap: ``5-digit keys``."""
    return f"{result['digits']}-digit keys"
