"""What an evaluation leaves in its output directory: the result as JSON and its picture (the
retrieval heatmap, or the loss by position), each written whole or not at all."""

from __future__ import annotations

import json
import os

from llama_cp.eval.needle import describe_keys
from llama_cp.files import write_text, write_whole


def write_results(result: dict, output_dir: str, name: str = "needle", plot=None) -> None:
    """``<output_dir>/<name>.json`` and ``<name>.png`` (``plot(result, path)``; default the needle
    heatmap), each written to a temporary name and renamed."""
    os.makedirs(output_dir, exist_ok=True)
    write_text(os.path.join(output_dir, f"{name}.json"), json.dumps(result, indent=1))
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
    ax.set_title(f"{result['task']}: accuracy, {describe_keys(result)}, {result['num_samples']} samples per cell",
                 fontsize=10)
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
    """Write ``fig`` to ``path`` as PNG, whole or not at all."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    write_whole(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)
