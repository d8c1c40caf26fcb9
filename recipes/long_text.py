"""Write long real documents that ship offline: the source files and documentation of the
installed Python packages (never text a model wrote), split by package into train and eval, and
optionally passkey retrieval rows to mix in (llama_cp/data/installed_text.py).

    python -m recipes.long_text --output_dir data/long_text --passkeys 256
    python -m recipes.eval_longctx --model_name smollm2-135m-instruct --task perplexity \\
        --dataset data/long_text/eval.jsonl --lengths 1024,4096,8192,16384
"""

from __future__ import annotations

from llama_cp.data.installed_text import write_long_text
from llama_cp.train.cli import run_cli

FLAGS = {
    "output_dir": "where train.jsonl, eval.jsonl (and passkeys.jsonl) are written",
    "min_chars": "the shortest file kept, in characters (about 3-4 per token of code)",
    "max_documents": "at most this many documents in each of train and eval (0 = all)",
    "passkeys": "also write this many passkey rows (a 5-digit key at a seeded depth, filling a row) to passkeys.jsonl",
    "seed": "seed of the passkey rows",
}


def main(output_dir: str = "data/long_text", min_chars: int = 100_000, max_documents: int = 0, passkeys: int = 0,
         seed: int = 0) -> None:
    """Write the documents (flags: --help) and say how many each file holds."""
    counts = write_long_text(output_dir, min_chars=min_chars, max_documents=max_documents, passkeys=passkeys, seed=seed)
    print(", ".join(f"{name}.jsonl: {count} rows" for name, count in counts.items()) + f" in {output_dir}")


if __name__ == "__main__":
    run_cli(main, usage="python -m recipes.long_text [--output_dir DIR] [--passkeys N] [--debug]", flags=FLAGS)
