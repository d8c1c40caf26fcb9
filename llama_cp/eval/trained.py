"""The evaluations a training run ends with (``--eval_needle``, ``--eval_perplexity``): the trained
model of a :class:`~llama_cp.train.trainer.Trainer` measured where it stands, at lengths up to its
--context_length, the results written beside the run's metrics."""

from __future__ import annotations

import os

import torch.distributed as dist

from llama_cp.eval.needle import DEFAULT_DEPTHS, evaluate_grid, format_grid
from llama_cp.eval.perplexity import DEFAULT_BUCKETS, evaluate_perplexity, format_perplexity, long_documents
from llama_cp.eval.plots import plot_perplexity, write_results
from llama_cp.parallel.sharding import layout_for

#: Samples per (length, depth) cell of --eval_needle's grid.
TRAINING_SAMPLES_PER_CELL = 4
#: Shorter rows cannot hold the passkey task with the byte tokenizer (it needs about 110 tokens).
MIN_PASSKEY_LENGTH = 128


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


def perplexity_documents(trainer) -> list[tuple[list[int], list[bool]]]:
    """The documents ``--eval_perplexity`` reads, one per row: of the run's eval documents (--eval_dataset,
    else each source's validation/test split or its --eval_fraction hold-out: text the run did not
    train on), the first --num_eval_samples of at least --context_length + 1 tokens, at least one.
    :meth:`~llama_cp.train.trainer.Trainer.setup` chooses them, so that eval documents too short are
    refused before the first step, not after the last."""
    from llama_cp.data.mixture import DataSpec

    cfg = trainer.cfg
    spec = DataSpec.of(cfg.data, cfg.seed)
    return long_documents(
        spec.examples("eval"), trainer.tokenizer, max(training_lengths(cfg)) + 1, cfg.data.num_eval_samples,
        spec=spec, name=f"--eval_perplexity on {_eval_source(cfg)}", minimum=1,
        fix="give --eval_dataset longer documents, lower --context_length or drop --eval_perplexity (nothing is "
            "trained yet); python -m recipes.eval_longctx --task perplexity evaluates a model at the lengths you "
            "choose",
    )


def _eval_source(cfg) -> str:
    return f"--eval_dataset {cfg.data.eval_dataset!r}" if cfg.data.eval_dataset else \
        f"the eval part of --dataset {cfg.data.dataset!r}"


def evaluate_trained_perplexity(trainer) -> dict:
    """``--eval_perplexity``: :func:`evaluate_perplexity` of a :class:`~llama_cp.train.trainer.Trainer`'s
    model after ``fit``, at :func:`training_lengths` in DEFAULT_BUCKETS buckets, on the
    :func:`perplexity_documents` its setup chose; written beside the run's metrics."""
    cfg = trainer.cfg
    documents = getattr(trainer, "perplexity_documents", None) or perplexity_documents(trainer)
    layout = layout_for(trainer.cp_strategy)
    result = evaluate_perplexity(trainer.model, trainer.mesh, documents, training_lengths(cfg), DEFAULT_BUCKETS,
                                 device=trainer.device, layout=layout)
    result.update(model=os.path.join(cfg.output_dir, "final"), dataset=_eval_source(cfg))
    if dist.get_rank() == 0:
        write_results(result, cfg.output_dir, "perplexity", plot=plot_perplexity)
        print(format_perplexity(result), flush=True)
    return result
