"""Prepared rows at corpus scale (issue 22): start-up with a ready cache, host memory while the
loader reads every batch, and the loss trajectory against the in-memory rows.

    python benchmarks/data_loading.py loader --dataset big.jsonl --context_length 8192 --data_cache_dir DIR
    python benchmarks/data_loading.py in_memory --dataset big.jsonl --context_length 8192
    python benchmarks/data_loading.py losses --dataset small.jsonl --context_length 256 --steps 8
    python benchmarks/data_loading.py prepare --dataset big.jsonl --context_length 8192 --num_proc 2
    python benchmarks/data_loading.py stream_resume --dataset small.jsonl --context_length 256 --steps 6

Memory is read from /proc/self/status: RssAnon (the process's own memory) and RssFile
(mapped files), before the data is opened and the largest seen while iterating.
"""

from __future__ import annotations

import argparse
import json
import time

START = time.perf_counter()

import torch  # noqa: E402

from llama_cp.data.loader import DistributedRowLoader, build_rows  # noqa: E402
from llama_cp.data.tokenizer import byte_tokenizer  # noqa: E402


def memory_mib() -> dict[str, float]:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {key: int(fields[key].split()[0]) / 1024 for key in ("VmRSS", "RssAnon", "RssFile")}


def iterate(loader: DistributedRowLoader) -> dict[str, float]:
    """Read every batch of one epoch; the largest memory seen and the batches per second."""
    peak, count, began = memory_mib(), 0, time.perf_counter()
    for batch in loader:
        count += 1
        if count % 50 == 0:
            peak = {key: max(value, memory_mib()[key]) for key, value in peak.items()}
        assert batch["input_ids"].shape[1] > 0
    peak = {key: max(value, memory_mib()[key]) for key, value in peak.items()}
    return {"batches": count, "batches_per_s": count / (time.perf_counter() - began), "peak_mib": peak}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["loader", "in_memory", "losses", "prepare", "stream_resume"])
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--context_length", type=int, default=8192)
    parser.add_argument("--data_cache_dir", default="")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--num_proc", type=int, default=1)
    args = parser.parse_args()
    imported = time.perf_counter() - START
    if args.mode in ("losses", "stream_resume"):
        print(json.dumps((losses if args.mode == "losses" else stream_resume)(args)))
        return
    tokenizer = byte_tokenizer()
    if args.mode == "prepare":  # into a new cache directory; the dataset's own Arrow conversion done beforehand
        import tempfile

        from llama_cp.data.sources import load_examples
        from llama_cp.data.prepared import prepare_dataset

        load_examples(args.dataset)
        with tempfile.TemporaryDirectory(dir=args.data_cache_dir or None) as cache:
            began = time.perf_counter()
            _, summary = prepare_dataset(args.dataset, tokenizer, args.context_length, cache_dir=cache,
                                         num_proc=args.num_proc)
            seconds = time.perf_counter() - began
        tokens = summary["train"]["tokens"] + summary["eval"]["tokens"]
        print(json.dumps({"mode": "prepare", "num_proc": args.num_proc, "tokens": tokens, "seconds": round(seconds, 1),
                          "tokens_per_s": round(tokens / seconds)}))
        return
    before = memory_mib()
    began = time.perf_counter()
    if args.mode == "loader":
        from llama_cp.data.prepared import load_prepared_rows

        rows, _ = load_prepared_rows(args.dataset, tokenizer, args.context_length, 1, args.data_cache_dir,
                                     say=lambda _: None)
    else:
        rows = build_rows(args.dataset, tokenizer, args.context_length)
    opened = time.perf_counter() - began
    after_open = memory_mib()
    result = iterate(DistributedRowLoader(rows, batch_size=1, seed=0))
    print(json.dumps({"mode": args.mode, "rows": len(rows), "imports_s": round(imported, 2),
                      "open_s": round(opened, 2), "before_mib": before, "after_open_mib": after_open, **result}))


def losses(args) -> dict[str, list[float]]:
    """Losses of ``--steps`` steps of the embedded model from the prepared rows and from
    ``build_rows`` (the trainer's data path before issue 22), everything else equal."""
    import os
    import tempfile

    from llama_cp.config import TrainConfig
    from llama_cp.data import prepared
    from llama_cp.train.trainer import Trainer

    def in_memory(dataset, tokenizer, context_length, cp, *rest, **options):
        return (build_rows(dataset, tokenizer, context_length, cp), build_rows(dataset, tokenizer, context_length, cp,
                                                                                split="eval"))

    results = {}
    with tempfile.TemporaryDirectory() as root:
        for name in ("prepared", "in_memory"):
            original = prepared.load_prepared_rows
            if name == "in_memory":
                prepared.load_prepared_rows = in_memory
            try:
                cfg = TrainConfig.from_flags(
                    dataset=args.dataset, context_length=args.context_length, max_steps=args.steps, log_every=1,
                    warmup_steps=2, report_to="none", output_dir=os.path.join(root, name),
                    data_cache_dir=os.path.join(root, "cache"),
                )
                Trainer(cfg).fit()
            finally:
                prepared.load_prepared_rows = original
            with open(os.path.join(root, name, "metrics.jsonl")) as f:
                results[name] = [row["loss"] for row in map(json.loads, f) if "loss" in row and "step" in row]
    results["identical"] = results["prepared"] == results["in_memory"]
    return results


def stream_resume(args) -> dict:
    """--streaming: ``--steps`` steps saving every steps/2, then the same run resumed from
    its middle checkpoint; the losses after the resume must be the uninterrupted ones."""
    import os
    import shutil
    import tempfile

    from llama_cp.config import TrainConfig
    from llama_cp.train.trainer import Trainer

    def read(out):
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [row["loss"] for row in map(json.loads, f) if "loss" in row and "step" in row]

    flags = dict(dataset=args.dataset, streaming=True, context_length=args.context_length, max_steps=args.steps,
                 save_every=args.steps // 2, log_every=1, warmup_steps=2, report_to="none")
    with tempfile.TemporaryDirectory() as root:
        first, second = os.path.join(root, "first"), os.path.join(root, "second")
        Trainer(TrainConfig.from_flags(output_dir=first, **flags)).fit()
        shutil.copytree(first, second)
        newest = sorted(os.listdir(os.path.join(second, "checkpoints")))[-1]
        shutil.rmtree(os.path.join(second, "checkpoints", newest))  # as if the run had stopped halfway
        Trainer(TrainConfig.from_flags(output_dir=second, resume="true", **flags)).fit()
        results = {"uninterrupted": read(first), "resumed": read(second)}
    results["identical"] = results["uninterrupted"] == results["resumed"]
    return results


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
