"""A model named on the command line, evaluated end to end (``python -m recipes.eval_longctx``):
its flags checked before anything is read or built, the model built as the trainer builds it
(context parallel over --cp ranks, FSDP over the rest; a LoRA adapter on its base), one task
measured, the result written and its table printed by rank 0."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from llama_cp.data.passkey import PASSKEY_FILLER
from llama_cp.eval.adapter import Adapter, load_tokenizer
from llama_cp.eval.needle import DEFAULT_DEPTHS, RETRIEVAL_TASKS, evaluate_grid, format_grid, parse_grid, read_haystack
from llama_cp.eval.perplexity import DEFAULT_BUCKETS, PERPLEXITY, evaluate_perplexity, format_perplexity, long_documents
from llama_cp.eval.plots import plot_heatmap, plot_perplexity, write_results
from llama_cp.eval.ruler import (RULER, RULER_TASKS, evaluate_ruler, format_ruler, parse_ruler_task, plot_ruler,
                                  ruler_row)
from llama_cp.parallel.sharding import layout_for

#: Every --task. A task is a module of its own beside needle.py and perplexity.py (the RULER-style
#: tasks: ruler.py), named here, its flags checked in check_task_flags and its measure taken in
#: evaluate_model.
TASKS = (*RETRIEVAL_TASKS, PERPLEXITY, RULER, *RULER_TASKS)

#: One line per parameter of :func:`evaluate_model`: what ``--help`` prints beside its default.
FLAGS = {
    "model_name": "a local HF model directory (a run's final/), a LoRA adapter directory (evaluated on its base: "
                  "adapter_config.json's base_model_name_or_path, or the run's llama_cp_export.json), a hub id, or "
                  "embedded (the untrained embedded model: the chance baseline)",
    "task": "passkey or needle (retrieval accuracy over --lengths x --depths), perplexity (loss by length and "
            "position on --dataset's documents), or a RULER-style task by --lengths: ruler_multikey, ruler_multivalue, "
            "ruler_variables, ruler_common_words, ruler_multiquery, ruler_frequent_words, or ruler for all six",
    "lengths": "comma-separated context lengths in tokens, each a multiple of 2 x --cp",
    "depths": "passkey / needle: comma-separated needle depths in [0, 1] (0 = the start of the filler, 1 = its end); "
              "the ruler tasks draw their needles' depths and refuse it",
    "num_samples": "passkey / needle: rows per (length, depth) cell; ruler: rows per (task, length); perplexity: "
                   "documents, each evaluated at every length",
    "haystack": "passkey / needle / ruler: a text file whose sentences are the filler (none = the training task's)",
    "dataset": "perplexity: the documents, as training's --dataset takes them (a json/jsonl/parquet/txt file or "
               "directory, a saved dataset or a hub id, with :options, comma-separated sources read in turn; its "
               "split=, else its validation/test split, else its first); the first --num_samples documents of at "
               "least max(--lengths) + 1 tokens are used",
    "buckets": "perplexity: each length's positions cut into this many equal ranges, a loss for each",
    "output_dir": "where needle.json and needle.png, perplexity.json and perplexity.png, or ruler.json and "
                  "ruler.png are written",
    "seed": "passkey / needle / ruler: seed of the rows (keys and filler)",
    "cp": "context-parallel degree, as in training (launch --cp ranks per row with torchrun)",
    "cp_strategy": "ring, ulysses, allgather, hybrid or auto, as in training",
    "dtype": "auto, float32 or bfloat16, as in training (auto: bfloat16 on CUDA, float32 on CPU)",
    "attention_backend": "the local attention kernel, as in training (auto: the fastest that runs)",
    "passkey_digits": "passkey / needle: digits of the key; 0 = auto, as in training: 1 for the embedded model (and "
                      "an adapter on it), else 5; a run of the default job trained one-digit keys, so evaluate its "
                      "final/ with --passkey_digits 1",
}


def evaluate_model(
    *,
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
) -> dict:
    """Evaluate ``model_name`` on ``task`` (the parameters: :data:`FLAGS`), write the result to
    ``output_dir`` and print its table on rank 0; every rank returns the result."""
    from llama_cp.config import TrainConfig
    from llama_cp.model.build import build_model, cp_strategy as strategy_of, model_path
    from llama_cp.parallel.mesh import init_distributed

    # every flag is checked before anything is read or built
    # the flags told (fire hands a default over as the very object): a task that does not read one refuses it
    given = ["depths"] * (depths is not DEFAULT_DEPTHS) + ["passkey_digits"] * (passkey_digits != 0)
    lengths, depths = parse_grid(lengths, depths, cp)
    if isinstance(dataset, (tuple, list)):  # fire reads --dataset a.jsonl,b.jsonl as a tuple
        dataset = ",".join(str(source) for source in dataset)
    check_task_flags(task, num_samples, dataset, buckets, lengths, given)
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
        from llama_cp.data.grammar import parse_sources
        from llama_cp.data.mixture import DataSpec
        from llama_cp.data.sources import load_source

        spec = DataSpec(dataset)
        parts = ((source, load_source(source, "all")) for source in parse_sources(dataset, "--dataset"))
        documents = long_documents(parts, tokenizer, max(lengths) + 1, num_samples, spec=spec,
                                   name=f"--dataset {dataset!r}")
    filler = read_haystack(haystack) if haystack else PASSKEY_FILLER
    for ruler_task in parse_ruler_task(task) if task == RULER or task in RULER_TASKS else ():
        ruler_row(ruler_task, tokenizer, min(lengths), seed, 0, filler)  # too short is said before the model is built
    model = build_model(cfg, mesh, device, path)
    if adapter:
        adapter.load_into(model)
    if task == PERPLEXITY:
        layout = layout_for(strategy_of(cfg, model.config)[0])
        result = evaluate_perplexity(model, mesh, documents, lengths, buckets, device=device, layout=layout)
        result.update(model=model_name, dataset=dataset)
        name, text, plot = "perplexity", format_perplexity(result), plot_perplexity
    elif task == RULER or task in RULER_TASKS:
        result = evaluate_ruler(model, tokenizer, mesh, parse_ruler_task(task), lengths, num_samples, seed=seed,
                                filler=filler, device=device)
        result["model"] = model_name
        name, text, plot = "ruler", format_ruler(result), plot_ruler
    else:
        result = evaluate_grid(model, tokenizer, mesh, lengths, depths, num_samples, task=task, seed=seed,
                               filler=filler, device=device, digits=cfg.passkey_key_digits())
        result["model"] = model_name  # the JSON says what was measured
        name, text, plot = "needle", format_grid(result), plot_heatmap
    if dist.get_rank() == 0:
        write_results(result, output_dir, name, plot=plot)
        print(text)
    return result


def check_task_flags(task: str, num_samples: int, dataset: str | None, buckets: int, lengths: Sequence[int],
                     given: Sequence[str] = ()) -> None:
    """ValueError naming the flag for a --task, --num_samples, --dataset or --buckets that cannot run,
    or one of ``given`` (the flags set off their defaults) that the task does not read."""
    from llama_cp.data.grammar import PASSKEY, check_sources, parse_sources

    if task not in TASKS:
        raise ValueError(f"--task must be one of {', '.join(TASKS)}, got {task!r}")
    if num_samples < 1:
        raise ValueError(f"--num_samples must be >= 1, got {num_samples}")
    if task == RULER or task in RULER_TASKS:
        for flag in given:  # the needles of a ruler row go at depths drawn with its keys; its answers are not passkeys
            raise ValueError(f"--{flag} is read by --task passkey / needle, not --task {task}: drop it")
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
