"""Does the model use its long context? Passkey / needle-in-a-haystack accuracy over a grid
of context lengths x needle depths, on any local HF model directory or a run's final/.

    python -m recipes.eval_longctx --model_name outputs/run/final
    torchrun --standalone --nproc_per_node 2 -m recipes.eval_longctx --model_name outputs/run/final --cp 2 \\
        --lengths 256,512,1024 --depths 0,0.25,0.5,0.75,1 --num_samples 8 --task needle

One sample is one row: filler sentences (--haystack: a text file's instead), the needle at
the given depth, then the question; it is right when the model's prediction of every token
of the key is right. With teacher forcing that is greedy decoding's exact match, so one
forward per row decides it. Rows run the trainer's model path (context parallel over --cp
ranks, FSDP over the rest) and its chunked loss, which builds logits for the key tokens
only. Writes <output_dir>/needle.json (accuracy per length and depth) and needle.png (the
heatmap). ``python -m recipes.finetune_longctx --eval_needle`` runs the same on the trained
model at the end.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence

import torch
import torch.distributed as dist

from llama_cp.data.passkey import PASSKEY_DIGITS, PASSKEY_FILLER, passkey_example
from llama_cp.model.loss import IGNORE_INDEX, causal_lm_loss_sum
from llama_cp.parallel.mesh import end_distributed, submesh
from llama_cp.parallel.sharding import check_context_length, shard_batch
from llama_cp.train.cli import run_cli
from llama_cp.train.run_dir import write_atomically

#: The tasks: the training task's needle and question, and a needle unlike it (RULER's magic number).
TASKS = {
    "passkey": {},
    "needle": dict(
        needle="The special magic number is {key}. ",
        question="What is the special magic number mentioned in the text? The special magic number is ",
    ),
}
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
#: Samples per (length, depth) cell when the training recipe runs the grid (--eval_needle).
TRAINING_SAMPLES_PER_CELL = 4
#: Shorter rows cannot hold the passkey task with the byte tokenizer (it needs about 110 tokens).
MIN_PASSKEY_LENGTH = 128


def main(
    model_name: str = "outputs/run/final",
    task: str = "passkey",
    lengths: str | Sequence[int] = "256,512,1024",
    depths: str | Sequence[float] = DEFAULT_DEPTHS,
    num_samples: int = 8,
    haystack: str | None = None,
    output_dir: str = "outputs/eval",
    seed: int = 0,
    cp: int = 1,
    cp_strategy: str = "ring",
    dtype: str = "auto",
    attention_backend: str = "auto",
    passkey_digits: int = 0,
) -> None:
    """--model_name: a local HF model directory (a run's final/, full fine-tune) or "embedded"
    (the untrained embedded model: the chance baseline); --task passkey or needle;
    --lengths and --depths: comma-separated grid (depth 0 = the start of the filler, 1 = its
    end); --num_samples per cell; --haystack: a text file whose sentences are the filler;
    --cp, --cp_strategy, --dtype, --attention_backend as in training; --passkey_digits: digits of
    the key (0 = auto, as in training: 1 for the embedded model, else 5; a run of the default job
    trained one-digit keys, so evaluate its final/ with --passkey_digits 1)."""
    from llama_cp.config import TrainConfig
    from llama_cp.model.build import build_model, model_path
    from llama_cp.parallel.mesh import init_distributed

    lengths, depths = parse_grid(lengths, depths, cp)
    if task not in TASKS:
        raise ValueError(f"--task must be one of {', '.join(TASKS)}, got {task!r}")
    if num_samples < 1:
        raise ValueError(f"--num_samples must be >= 1, got {num_samples}")
    path = os.path.expanduser(model_name)
    if model_name != "embedded" and os.path.isfile(os.path.join(path, "adapter_config.json")):
        raise ValueError(f"--model_name {model_name!r} is a LoRA adapter: merge it into its base model "
                         "(peft's merge_and_unload, then save_pretrained) and evaluate that directory")
    cfg = TrainConfig.from_flags(model_name=model_name, cp=cp, cp_strategy=cp_strategy, dtype=dtype,
                                 attention_backend=attention_backend, context_length=max(lengths),
                                 passkey_digits=passkey_digits)
    device_type = init_distributed()
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    mesh = cfg.parallel.dims().build_mesh(device_type)
    path = model_path(model_name)
    tokenizer = load_tokenizer(path)
    model = build_model(cfg, mesh, device, path)
    filler = read_haystack(haystack) if haystack else PASSKEY_FILLER
    result = evaluate_grid(model, tokenizer, mesh, lengths, depths, num_samples, task=task, seed=seed,
                           filler=filler, device=device, digits=cfg.passkey_key_digits())
    result["model"] = model_name  # the JSON says what was measured
    if dist.get_rank() == 0:
        write_results(result, output_dir)
        print(format_grid(result))


def evaluate_trained(trainer) -> dict:
    """The passkey grid on a :class:`~llama_cp.train.trainer.Trainer`'s model after ``fit``
    (``--eval_needle``): lengths --context_length / 4, / 2 and / 1 (those that hold the task),
    DEFAULT_DEPTHS, TRAINING_SAMPLES_PER_CELL rows per cell; written beside the run's metrics."""
    cfg = trainer.cfg
    step = 2 * cfg.parallel.cp
    lengths = sorted({cfg.data.context_length // part // step * step for part in (4, 2, 1)})
    lengths = [length for length in lengths if length >= MIN_PASSKEY_LENGTH] or [cfg.data.context_length]
    result = evaluate_grid(trainer.model, trainer.tokenizer, trainer.mesh, lengths, DEFAULT_DEPTHS,
                           TRAINING_SAMPLES_PER_CELL, seed=cfg.seed, device=trainer.device,
                           digits=cfg.passkey_key_digits())
    if dist.get_rank() == 0:
        write_results(result, cfg.output_dir)
        print(format_grid(result), flush=True)
    return result


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


def load_tokenizer(path: str | None):
    """The embedded byte tokenizer (``path`` None) or the model directory's."""
    if path is None:
        from llama_cp.data.tokenizer import byte_tokenizer

        return byte_tokenizer()
    from transformers import AutoTokenizer

    from llama_cp.modules.causal_lm import check_tokenizer_files

    check_tokenizer_files(path)
    return AutoTokenizer.from_pretrained(path)


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
    rng = random.Random(f"eval_longctx:{task}:{seed}:{length}:{depth}:{index}")
    row = passkey_example(rng, length, tokenizer, depth=depth, digits=digits, filler=filler, task=task, **TASKS[task])
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
    lines = [f"{result['task']} accuracy ({_key(result)}, {result['num_samples']} samples per cell), overall "
             f"{result['overall']:.2f}", header]
    for length, row in zip(result["lengths"], result["accuracy"]):
        lines.append(f"{length:>14} " + " ".join(f"{value:>5.2f}" for value in row))
    return "\n".join(lines)


def _key(result: dict) -> str:
    return f"{result['digits']}-digit keys"


def write_results(result: dict, output_dir: str, name: str = "needle") -> None:
    """``<output_dir>/<name>.json`` and ``<name>.png`` (the heatmap), each written to a temporary
    name and renamed."""
    os.makedirs(output_dir, exist_ok=True)
    write_atomically(os.path.join(output_dir, f"{name}.json"), json.dumps(result, indent=1))
    plot_heatmap(result, os.path.join(output_dir, f"{name}.png"))


def plot_heatmap(result: dict, path: str) -> None:
    """Accuracy by context length (rows) and needle depth (columns), 0 red to 1 green."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    accuracy = result["accuracy"]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.5 + 0.9 * len(result["depths"])),
                                    max(3.0, 1.2 + 0.6 * len(result["lengths"]))))
    image = ax.imshow(accuracy, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto", origin="lower")
    ax.set_xticks(range(len(result["depths"])), [f"{depth:g}" for depth in result["depths"]])
    ax.set_yticks(range(len(result["lengths"])), [str(length) for length in result["lengths"]])
    for i, row in enumerate(accuracy):
        for j, value in enumerate(row):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xlabel("needle depth (fraction of the filler)")
    ax.set_ylabel("context length (tokens)")
    ax.set_title(f"{result['task']}: accuracy, {_key(result)}, {result['num_samples']} samples per cell", fontsize=10)
    fig.colorbar(image, ax=ax, fraction=0.046)
    fig.tight_layout()
    directory, base = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".tmp-{base}")
    fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


if __name__ == "__main__":
    run_cli(main, usage="python -m recipes.eval_longctx --model_name DIR [--lengths 256,512,1024] [--depths ...] "
                        "[--task passkey|needle] [--cp N]")
    end_distributed()
