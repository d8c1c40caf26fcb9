"""Does the model use its long context? Two measures, on any local HF model directory, a
run's final/ (a full model or a LoRA adapter) or a hub id:

    python -m recipes.eval_longctx --model_name outputs/run/final
    torchrun --standalone --nproc_per_node 2 -m recipes.eval_longctx --model_name outputs/run/final --cp 2 \\
        --lengths 256,512,1024 --depths 0,0.25,0.5,0.75,1 --num_samples 8 --task needle
    python -m recipes.eval_longctx --model_name outputs/run/final --task perplexity --dataset books.jsonl \\
        --lengths 1024,4096 --buckets 4

Retrieval (--task passkey or needle): accuracy over a grid of context lengths x needle depths.
One sample is one row: filler sentences (--haystack: a text file's instead), the needle at
the given depth, then the question; it is right when the model's prediction of every token
of the key is right. With teacher forcing that is greedy decoding's exact match, so one
forward per row decides it. Writes <output_dir>/needle.json (accuracy per length and depth)
and needle.png (the heatmap).

Perplexity (--task perplexity): loss and perplexity on your own documents (--dataset) by
context length and by position within it (Note [Perplexity by position]). Writes
<output_dir>/perplexity.json and perplexity.png (loss by position, a line per length).

Rows run the trainer's model path (context parallel over --cp ranks, FSDP over the rest) and
its chunked loss, which never builds the logits of a whole row. A LoRA adapter directory is
evaluated on its base (Note [Evaluating an adapter]). ``python -m recipes.finetune_longctx
--eval_needle`` / ``--eval_perplexity`` run the same on the trained model at the end.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from llama_cp.data.passkey import PASSKEY_DIGITS, PASSKEY_FILLER, passkey_example
from llama_cp.model.loss import IGNORE_INDEX, causal_lm_loss_sum
from llama_cp.parallel.mesh import end_distributed, submesh
from llama_cp.parallel.sharding import check_context_length, shard_batch
from llama_cp.train.cli import run_cli
from llama_cp.train.export import EXPORT_INFO
from llama_cp.train.run_dir import write_atomically

#: The retrieval tasks: the training task's needle and question, and a needle unlike it (RULER's magic number).
TASKS = {
    "passkey": {},
    "needle": dict(
        needle="The special magic number is {key}. ",
        question="What is the special magic number mentioned in the text? The special magic number is ",
    ),
}
#: The task that reads --dataset's documents instead of building rows.
PERPLEXITY = "perplexity"
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
#: Position buckets of each length (--buckets, and --eval_perplexity's).
DEFAULT_BUCKETS = 4
#: Samples per (length, depth) cell when the training recipe runs the grid (--eval_needle).
TRAINING_SAMPLES_PER_CELL = 4
#: Shorter rows cannot hold the passkey task with the byte tokenizer (it needs about 110 tokens).
MIN_PASSKEY_LENGTH = 128

#: One line per parameter of :func:`main`: what ``--help`` prints beside its default.
FLAGS = {
    "model_name": "a local HF model directory (a run's final/), a LoRA adapter directory (evaluated on its base: "
                  "adapter_config.json's base_model_name_or_path, or the run's llama_cp_export.json), a hub id, or "
                  "embedded (the untrained embedded model: the chance baseline)",
    "task": "passkey or needle (retrieval accuracy over --lengths x --depths), or perplexity (loss by length and "
            "position on --dataset's documents)",
    "lengths": "comma-separated context lengths in tokens, each a multiple of 2 x --cp",
    "depths": "passkey / needle: comma-separated needle depths in [0, 1] (0 = the start of the filler, 1 = its end)",
    "num_samples": "passkey / needle: rows per (length, depth) cell; perplexity: documents, each evaluated at every "
                   "length",
    "haystack": "passkey / needle: a text file whose sentences are the filler (none = the training task's)",
    "dataset": "perplexity: the documents, as training's --dataset takes them (a json/jsonl/parquet/txt file or "
               "directory, a saved dataset or a hub id, with :options, comma-separated sources read in turn; its "
               "split=, else its validation/test split, else its first); the first --num_samples documents of at "
               "least max(--lengths) + 1 tokens are used",
    "buckets": "perplexity: each length's positions cut into this many equal ranges, a loss for each",
    "output_dir": "where needle.json and needle.png, or perplexity.json and perplexity.png, are written",
    "seed": "passkey / needle: seed of the rows (keys and filler)",
    "cp": "context-parallel degree, as in training (launch --cp ranks per row with torchrun)",
    "cp_strategy": "ring, ulysses, allgather, hybrid or auto, as in training",
    "dtype": "auto, float32 or bfloat16, as in training (auto: bfloat16 on CUDA, float32 on CPU)",
    "attention_backend": "the local attention kernel, as in training (auto: the fastest that runs)",
    "passkey_digits": "passkey / needle: digits of the key; 0 = auto, as in training: 1 for the embedded model (and "
                      "an adapter on it), else 5; a run of the default job trained one-digit keys, so evaluate its "
                      "final/ with --passkey_digits 1",
}


def main(
    model_name: str = "outputs/run/final",
    task: str = "passkey",
    lengths: str | Sequence[int] = "256,512,1024",
    depths: str | Sequence[float] = DEFAULT_DEPTHS,
    num_samples: int = 8,
    haystack: str | None = None,
    dataset: str | None = None,
    buckets: int = DEFAULT_BUCKETS,
    output_dir: str = "outputs/eval",
    seed: int = 0,
    cp: int = 1,
    cp_strategy: str = "ring",
    dtype: str = "auto",
    attention_backend: str = "auto",
    passkey_digits: int = 0,
) -> None:
    """Evaluate --model_name on --task and write the results to --output_dir (flags: --help)."""
    from llama_cp.config import TrainConfig
    from llama_cp.model.build import build_model, cp_strategy as strategy_of, model_path
    from llama_cp.parallel.mesh import init_distributed

    # every flag is checked before anything is read or built
    lengths, depths = parse_grid(lengths, depths, cp)
    if isinstance(dataset, (tuple, list)):  # fire reads --dataset a.jsonl,b.jsonl as a tuple
        dataset = ",".join(str(source) for source in dataset)
    check_task_flags(task, num_samples, dataset, buckets, lengths)
    adapter = Adapter.read(model_name)
    base = adapter.flags if adapter else {"model_name": model_name}
    cfg = TrainConfig.from_flags(**base, cp=cp, cp_strategy=cp_strategy, dtype=dtype,
                                 attention_backend=attention_backend, context_length=max(lengths),
                                 passkey_digits=passkey_digits)
    device_type = init_distributed()
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    mesh = cfg.parallel.dims().build_mesh(device_type)
    path = model_path(cfg.model.model_name)
    tokenizer = load_tokenizer(adapter.tokenizer_path(path) if adapter else path)
    if task == PERPLEXITY:  # read before the model is built: too few documents is said at once
        from llama_cp.data.mixture import DataSpec
        from llama_cp.data.sources import load_source
        from llama_cp.data_flags import parse_sources

        spec = DataSpec(dataset)
        parts = ((source, load_source(source, "all")) for source in parse_sources(dataset, "--dataset"))
        documents = long_documents(parts, tokenizer, max(lengths) + 1, num_samples, spec=spec,
                                   name=f"--dataset {dataset!r}")
    model = build_model(cfg, mesh, device, path)
    if adapter:
        adapter.load_into(model)
    if task == PERPLEXITY:
        layout = "documents" if strategy_of(cfg, model.config)[0] == "allgather" else "zigzag"
        result = evaluate_perplexity(model, mesh, documents, lengths, buckets, device=device, layout=layout)
        result.update(model=model_name, dataset=dataset)
        name, text, plot = "perplexity", format_perplexity(result), plot_perplexity
    else:
        filler = read_haystack(haystack) if haystack else PASSKEY_FILLER
        result = evaluate_grid(model, tokenizer, mesh, lengths, depths, num_samples, task=task, seed=seed,
                               filler=filler, device=device, digits=cfg.passkey_key_digits())
        result["model"] = model_name  # the JSON says what was measured
        name, text, plot = "needle", format_grid(result), plot_heatmap
    if dist.get_rank() == 0:
        write_results(result, output_dir, name, plot=plot)
        print(text)


def check_task_flags(task: str, num_samples: int, dataset: str | None, buckets: int, lengths: Sequence[int]) -> None:
    """ValueError naming the flag for a --task, --num_samples, --dataset or --buckets that cannot run."""
    from llama_cp.data_flags import PASSKEY, check_sources, parse_sources

    if task not in (*TASKS, PERPLEXITY):
        raise ValueError(f"--task must be one of {', '.join([*TASKS, PERPLEXITY])}, got {task!r}")
    if num_samples < 1:
        raise ValueError(f"--num_samples must be >= 1, got {num_samples}")
    if task != PERPLEXITY:
        if dataset is not None:
            raise ValueError(f"--dataset is read by --task perplexity; --task {task} builds its own rows "
                             "(--haystack: a text file for the filler)")
        return
    if not dataset:
        raise ValueError("--task perplexity needs --dataset: a file, directory or hub id of your documents")
    dataset = str(dataset)
    if dataset == PASSKEY:
        raise ValueError("--task perplexity --dataset passkey: the passkey task is not natural text; give a file, "
                         "directory or hub id of documents (--task passkey measures retrieval)")
    sources = parse_sources(dataset, "--dataset")
    if any(source.weight is not None for source in sources):
        raise ValueError(f"--dataset {dataset!r}: perplexity reads the sources in turn; drop the mixture weights")
    check_sources(sources)
    if not isinstance(buckets, int) or not 1 <= buckets <= min(lengths):
        raise ValueError(f"--buckets must be a whole number from 1 to the shortest length ({min(lengths)}), "
                         f"got {buckets!r}")


def training_lengths(cfg) -> list[int]:
    """--context_length / 4, / 2 and / 1, each rounded down to a multiple of 2 x cp (the lengths
    --eval_needle and --eval_perplexity evaluate)."""
    step = 2 * cfg.parallel.cp
    return sorted({cfg.data.context_length // part // step * step for part in (4, 2, 1)} - {0})


def evaluate_trained(trainer) -> dict:
    """The passkey grid on a :class:`~llama_cp.train.trainer.Trainer`'s model after ``fit``
    (``--eval_needle``): lengths --context_length / 4, / 2 and / 1 (those that hold the task),
    DEFAULT_DEPTHS, TRAINING_SAMPLES_PER_CELL rows per cell; written beside the run's metrics."""
    cfg = trainer.cfg
    lengths = [length for length in training_lengths(cfg) if length >= MIN_PASSKEY_LENGTH] or [cfg.data.context_length]
    result = evaluate_grid(trainer.model, trainer.tokenizer, trainer.mesh, lengths, DEFAULT_DEPTHS,
                           TRAINING_SAMPLES_PER_CELL, seed=cfg.seed, device=trainer.device,
                           digits=cfg.passkey_key_digits())
    if dist.get_rank() == 0:
        write_results(result, cfg.output_dir)
        print(format_grid(result), flush=True)
    return result


def evaluate_trained_perplexity(trainer) -> dict:
    """``--eval_perplexity``: :func:`evaluate_perplexity` of a :class:`~llama_cp.train.trainer.Trainer`'s
    model after ``fit``, at :func:`training_lengths` in DEFAULT_BUCKETS buckets, on the run's eval
    documents (--eval_dataset, else each source's validation/test split or its --eval_fraction
    hold-out: text the run did not train on), one per row: the first --num_eval_samples of at
    least --context_length + 1 tokens, at least one; written beside the run's metrics."""
    from llama_cp.data.mixture import DataSpec

    cfg = trainer.cfg
    lengths = training_lengths(cfg)
    spec = DataSpec.of(cfg.data, cfg.seed)
    where = f"--eval_dataset {cfg.data.eval_dataset!r}" if cfg.data.eval_dataset else \
        f"the eval part of --dataset {cfg.data.dataset!r}"
    documents = long_documents(
        spec.examples("eval"), trainer.tokenizer, max(lengths) + 1, cfg.data.num_eval_samples, spec=spec,
        name=f"--eval_perplexity on {where}", minimum=1,
        fix="give --eval_dataset longer documents or lower --context_length; final/ is written, and python -m "
            "recipes.eval_longctx --task perplexity evaluates it at the lengths you choose",
    )
    layout = "documents" if trainer.cp_strategy == "allgather" else "zigzag"
    result = evaluate_perplexity(trainer.model, trainer.mesh, documents, lengths, DEFAULT_BUCKETS,
                                 device=trainer.device, layout=layout)
    result.update(model=os.path.join(cfg.output_dir, "final"), dataset=where)
    if dist.get_rank() == 0:
        write_results(result, cfg.output_dir, "perplexity", plot=plot_perplexity)
        print(format_perplexity(result), flush=True)
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


# Note [Evaluating an adapter]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A LoRA adapter directory holds the adapters' weights only. Its model is rebuilt as the run
# built it, with the trainer's build_model, and then the adapters' weights are put in:
#
#   adapter_config.json   base_model_name_or_path  -> --model_name (a local directory or hub id)
#                         r, lora_alpha, target_modules, target_parameters
#                                                  -> --use_peft --lora_r --lora_alpha --lora_target_*
#   llama_cp_export.json  model_name "embedded", seed  -> the embedded model's random init of that
#   (the trainer's export)                          seed, which build_model makes from --seed
#                         rope_theta, rope_scaling -> the run's --rope_theta / --rope_scaling (peft
#                                                     alone would load the base with its own RoPE)
#
#   build_model(cfg)             FSDP2-sharded peft model, its LoRA weights freshly initialised
#   adapter_model.safetensors    read whole on every rank (it is small); set_model_state_dict with
#                                full tensors keeps each rank's shards of them (DTensors)
#
# peft saves each adapter tensor under the model's name with the adapter's name taken out
# (...q_proj.lora_A.default.weight -> ...q_proj.lora_A.weight). Every tensor of the file must
# find its LoRA tensor in the model, and every LoRA tensor of the model its tensor in the file,
# else the adapter is refused (other targets). rsLoRA, DoRA and modules_to_save copies are the
# trainer's own flags (--use_rslora, --use_dora, --lora_modules_to_save): build_model makes those
# layers, and their tensors come from the file like A and B (peft saves a DoRA magnitude as
# ...q_proj.lora_magnitude_vector and a copy under the name of what it copies). Per-module ranks
# or alphas (rank_pattern, alpha_pattern) are refused: build_model makes none.


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter directory and the training flags that rebuild its model (Note [Evaluating an
    adapter])."""

    path: str
    #: TrainConfig flags of the base and the adapters' shape
    flags: dict[str, Any]

    @classmethod
    def read(cls, model_name: str) -> Adapter | None:
        """The adapter at ``--model_name``; None when it is no adapter directory. ValueError naming
        the flag for an adapter this cannot rebuild."""
        path = os.path.expanduser(model_name)
        if model_name == "embedded" or not os.path.isfile(os.path.join(path, "adapter_config.json")):
            return None
        with open(os.path.join(path, "adapter_config.json")) as f:
            config = json.load(f)
        info = {}
        if os.path.isfile(os.path.join(path, EXPORT_INFO)):
            with open(os.path.join(path, EXPORT_INFO)) as f:
                info = json.load(f)
        where = f"--model_name {model_name!r} is a LoRA adapter"
        merge = "merge it into its base (peft's merge_and_unload, then save_pretrained) and evaluate that directory"
        if config.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"--model_name {model_name!r} is a {config['peft_type']} adapter, not LoRA: {merge}")
        if config.get("rank_pattern") or config.get("alpha_pattern"):
            raise ValueError(f"{where} with per-module ranks or alphas (rank_pattern / alpha_pattern), which the "
                             f"trainer's model does not build: {merge}")
        targets = config.get("target_modules") or []
        if isinstance(targets, str):
            raise ValueError(f"{where} whose target_modules is the pattern {targets!r}, not a list of layer names: "
                             f"{merge}")
        base = "embedded" if info.get("model_name") == "embedded" else (
            config.get("base_model_name_or_path") or info.get("model_name"))
        if not base:
            raise ValueError(f"{where} that names no base model (adapter_config.json's base_model_name_or_path is "
                             f"null, and there is no {EXPORT_INFO}): set base_model_name_or_path to the base's "
                             f"directory or hub id (for the embedded model write {EXPORT_INFO}: "
                             '{"model_name": "embedded", "seed": <the run\'s --seed>})')
        flags = {"model_name": base, "use_peft": True, "lora_r": config["r"], "lora_alpha": config["lora_alpha"],
                 "lora_target_modules": tuple(targets),
                 "lora_target_parameters": tuple(config.get("target_parameters") or ()),
                 "use_rslora": bool(config.get("use_rslora")), "use_dora": bool(config.get("use_dora")),
                 "lora_modules_to_save": tuple(config.get("modules_to_save") or ())}
        if base == "embedded":
            flags["seed"] = info.get("seed", 0)
        flags.update({key: info[key] for key in ("rope_theta", "rope_scaling") if info.get(key) is not None})
        return cls(path, flags)

    def tokenizer_path(self, base_path: str | None) -> str | None:
        """The adapter directory when it holds a tokenizer (the trainer's export does), else the base's."""
        from llama_cp.modules.causal_lm import TOKENIZER_FILES

        own = any(os.path.isfile(os.path.join(self.path, name)) for name in TOKENIZER_FILES)
        return self.path if own else base_path

    def load_into(self, model) -> None:
        """Put the adapters' weights into ``model`` (``build_model`` of :attr:`flags`, sharded or not)."""
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_model_state_dict, set_model_state_dict,
        )

        file = os.path.join(self.path, "adapter_model.safetensors")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"--model_name {self.path!r}: no adapter_model.safetensors (peft's "
                                    "save_pretrained writes it)")
        saved = load_file(file)
        own = get_model_state_dict(model)  # this rank's shards, under the model's names
        names = {_saved_name(name): name for name in own if ".lora_" in name or ".modules_to_save." in name}
        unknown, missing = sorted(set(saved) - set(names)), sorted(set(names) - set(saved))
        wrong = sorted(key for key in set(saved) & set(names) if saved[key].shape != own[names[key]].shape)
        if unknown or missing or wrong:
            found = [f"{len(found)} {what}, e.g. {found[0]}" for found, what in
                     ((unknown, "not in the model"), (missing, "missing"), (wrong, "of another shape")) if found]
            raise ValueError(f"--model_name {self.path!r}: the adapter's tensors do not match the LoRA layers of "
                             f"its adapter_config.json ({'; '.join(found)})")
        full = {names[key]: value.to(own[names[key]].dtype) for key, value in saved.items()}
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=False))


def _saved_name(name: str) -> str:
    """The name peft's save_pretrained gives the model's trainable tensor ``name``: the adapter's
    name taken out, a DoRA magnitude without its .weight, a modules_to_save copy under the name of
    what it copies."""
    if ".lora_magnitude_vector." in name:
        return name.split(".lora_magnitude_vector.")[0] + ".lora_magnitude_vector"
    if ".modules_to_save." in name:
        head, tail = name.split(".modules_to_save.", 1)
        return f"{head}.{tail.split('.', 1)[1]}"
    return name.replace(".default.", ".")


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
    least ``min_tokens`` tokens, tokenized as training does (``tokenize_row``) and cut to their first
    ``min_tokens``. ValueError naming ``name``, the longest document and ``fix`` when fewer than
    ``minimum`` (default ``count``) do. Rows that cannot be rendered are skipped."""
    from llama_cp.data.formats import detect_format
    from llama_cp.data.mixture import tokenize_row
    from llama_cp.data.sources import ROW_NUMBER

    found, seen, longest = [], 0, 0
    for source, examples in parts:
        if detect_format(examples.column_names) == "passkey":
            raise ValueError(f"{source.flag} {source.name!r}: passkey rows are not natural text; perplexity reads "
                             "text, prompt/completion, instruction or chat documents")
        for index, example in enumerate(examples):
            where = f"row {example.get(ROW_NUMBER, index + 1)} of {source.flag} {source.name!r}"
            (input_ids, label_mask), _ = tokenize_row(example, tokenizer, where, spec)
            seen, longest = seen + 1, max(longest, len(input_ids))
            if len(input_ids) >= min_tokens:
                found.append((input_ids[:min_tokens], label_mask[:min_tokens]))
                if len(found) == count:
                    return found
    if len(found) < (count if minimum is None else minimum):
        held = f"only {len(found)} of its {seen} documents hold" if found else f"none of its {seen} documents holds"
        raise ValueError(f"{name}: {held} at least {min_tokens} tokens (the longest length + 1, the last label), "
                         f"{count} wanted; the longest has {longest} tokens: {fix}")
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


def write_results(result: dict, output_dir: str, name: str = "needle", plot=None) -> None:
    """``<output_dir>/<name>.json`` and ``<name>.png`` (``plot(result, path)``; default the needle
    heatmap), each written to a temporary name and renamed."""
    os.makedirs(output_dir, exist_ok=True)
    write_atomically(os.path.join(output_dir, f"{name}.json"), json.dumps(result, indent=1))
    (plot or plot_heatmap)(result, os.path.join(output_dir, f"{name}.png"))


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
    _save_figure(fig, path)


def plot_perplexity(result: dict, path: str) -> None:
    """Loss by position (each bucket at its middle), one line per length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for row in result["per_length"]:
        points = [((part["start"] + part["end"] - 1) / 2, part["loss"]) for part in row["buckets"]
                  if part["loss"] is not None]
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o",
                label=f"{row['length']} tokens: loss {row['loss']:.3f}" if row["loss"] is not None else str(row["length"]))
    ax.set_xlabel("position in the document (tokens)")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(f"loss by position, {result['documents']} documents, {result['buckets']} buckets per length",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save_figure(fig, path)


def _save_figure(fig, path: str) -> None:
    """Write ``fig`` to ``path`` as PNG under a temporary name, then rename it (never half a file)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    directory, base = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".tmp-{base}")
    fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


def cli(argv: list[str] | None = None) -> None:
    """``python -m recipes.eval_longctx``: :func:`main` with its own flags (``--help`` lists them)."""
    run_cli(main, usage="python -m recipes.eval_longctx --model_name DIR [--task passkey|needle|perplexity] "
                        "[--lengths 256,512,1024] [--depths ...] [--dataset FILE] [--cp N]", argv=argv, flags=FLAGS)


if __name__ == "__main__":
    cli()
    end_distributed()
