"""Tokenize and pack a dataset once, ahead of training, on a CPU machine.

    python -m recipes.prepare_data --dataset data.jsonl --context_length 131072 --cp 8 \\
        --model_name /path/to/Llama-3.1-8B --num_proc 16

Takes the training recipe's flags (the same --config preset works); what the rows depend
on is the data flags (--dataset, --eval_dataset, --dataset_columns, --eval_fraction, --seed,
--on_bad_row, --chat_template), --model_name (its tokenizer), --context_length, --cp, --truncate_documents and
--objective (dpo: rows of whole preference pairs); they are
written under --data_cache_dir, where a training run with the same flags finds and reuses
them (Note [Prepared rows] in llama_cp/data/prepared.py). Prints a summary per split.
"""

from __future__ import annotations

from llama_cp.config import TrainConfig
from llama_cp.data.mixture import DataSpec
from llama_cp.data.prepared import prepare_dataset, summary_lines
from llama_cp.data.tokenizer import build_tokenizer
from llama_cp.model.build import model_path
from llama_cp.train.cli import run_cli


def main(config: str | None = None, **flags) -> None:
    """``--config preset.yaml`` then any flag of :class:`llama_cp.config.TrainConfig`."""
    cfg = TrainConfig.from_flags(config, **flags)
    d = cfg.data
    tokenizer = build_tokenizer(model_path(cfg.model.model_name), cfg.data.chat_template)
    directory, summary = prepare_dataset(
        DataSpec.of(d, cfg.seed), tokenizer, d.context_length, cfg.parallel.cp, d.data_cache_dir, d.num_proc,
        progress=True, truncate=d.truncate_documents, objective=cfg.objective,
    )
    print(f"{'already prepared, reused' if summary['reused'] else 'prepared'}: {directory}")
    for line in summary_lines(summary, d.context_length):
        print(line)


if __name__ == "__main__":
    run_cli(main, usage="python -m recipes.prepare_data [--config preset.yaml] [--flag value ...] [--debug]")
