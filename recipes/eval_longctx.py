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

RULER-style tasks (--task ruler_multikey, ruler_multivalue, ruler_variables, ruler_common_words,
ruler_multiquery, ruler_frequent_words, or ruler for all six; llama_cp/eval/ruler.py): several
needles, one key with several values, variable tracking, common- and frequent-word extraction,
several keys asked at once, each row filled to every --lengths, scored like retrieval (every
answer token the model's argmax). Writes <output_dir>/ruler.json (accuracy per task and length)
and ruler.png.

Rows run the trainer's model path (context parallel over --cp ranks, FSDP over the rest) and
its chunked loss, which never builds the logits of a whole row. A LoRA adapter directory is
evaluated on its base (Note [Evaluating an adapter]). ``python -m recipes.finetune_longctx
--eval_needle`` / ``--eval_perplexity`` run the same on the trained model at the end.
"""

import inspect

from llama_cp.eval.evaluate import FLAGS, evaluate_model
from llama_cp.parallel.mesh import end_distributed
from llama_cp.train.cli import run_cli


def main(**flags) -> None:
    """Evaluate --model_name on --task and write the results to --output_dir (flags: --help)."""
    evaluate_model(**flags)


# fire, --help and the unknown-flag check read the flags off main's signature: evaluate_model's
main.__signature__ = inspect.signature(evaluate_model)


def cli(argv: list[str] | None = None) -> None:
    """``python -m recipes.eval_longctx``: :func:`main` with its own flags (``--help`` lists them)."""
    run_cli(main, usage="python -m recipes.eval_longctx --model_name DIR "
                        "[--task passkey|needle|perplexity|ruler|ruler_...] [--lengths 256,512,1024] [--depths ...] "
                        "[--dataset FILE] [--cp N]", argv=argv, flags=FLAGS)


if __name__ == "__main__":
    cli()
    end_distributed()
