"""Long-context fine-tuning of an HF Llama model: context parallelism on FSDP2.

    python -m recipes.finetune_longctx                                   # embedded model, passkey task
    python -m recipes.finetune_longctx --eval_needle                     # ... and the accuracy heatmap
    python -m recipes.finetune_longctx --dataset books.jsonl --eval_perplexity   # ... loss by length and position
    torchrun --standalone --nproc_per_node 8 -m recipes.finetune_longctx \\
        --model_name /models/Llama-3.1-8B --context_length 131072 --cp 8 --use_peft

Flags: ``--help``, docs/flags.md, or ``llama_cp/config.py`` (one flag per config field).
"""

from llama_cp.config import TrainConfig
from llama_cp.eval.trained import evaluate_trained, evaluate_trained_perplexity
from llama_cp.parallel.mesh import end_distributed
from llama_cp.train.cli import run_cli
from llama_cp.train.trainer import Trainer


def main(config: str | None = None, **flags) -> None:
    """``--config preset.yaml`` then any flag of :class:`llama_cp.config.TrainConfig`."""
    cfg = TrainConfig.from_flags(config, **flags)
    trainer = Trainer(cfg)
    trainer.fit()
    if cfg.eval_needle:
        evaluate_trained(trainer)
    if cfg.eval_perplexity:
        evaluate_trained_perplexity(trainer)


if __name__ == "__main__":
    run_cli(main, usage="python -m recipes.finetune_longctx [--config preset.yaml] [--flag value ...] [--debug]")
    end_distributed()
