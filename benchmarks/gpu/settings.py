"""The shapes of a GPU acceptance run, all chosen from the number of GPUs N (or the tiny ones of
--dry_run), and the model config and rows every part builds from them."""

from __future__ import annotations

import dataclasses
import math

import torch

from llama_cp.config import TrainConfig

#: In --dry_run, the longest context that "fits" (a CPU has no out-of-memory error to find).
DRY_RUN_FITS = 192


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is at least ``value``."""
    return -(-value // multiple) * multiple


def heads_for(n: int, at_least: int, head_dim: int) -> dict[str, int]:
    """Attention shapes that every strategy splits on N ranks: the fewest heads >= ``at_least``
    that are a multiple of N (Ulysses; a hybrid degree divides N, hence them) and of 4, with
    a quarter as many KV heads."""
    heads = round_up(at_least, math.lcm(n, 4))
    return {"num_attention_heads": heads, "num_key_value_heads": heads // 4, "hidden_size": heads * head_dim,
            "head_dim": head_dim}


def hybrid_degree(n: int, heads: int) -> int:
    """--ulysses_degree of the hybrid checks: the largest divisor of N below N that divides the
    heads, so that Ulysses and the ring both span several ranks where N allows (4: 2 x 2, 6:
    3 x 2, 8: 4 x 2); at a prime N, 1: the ring over the sub-groups the hybrid makes, Ulysses
    over single ranks."""
    return max((u for u in range(1, n) if n % u == 0 and heads % u == 0), default=1)


@dataclasses.dataclass
class Settings:
    """The shapes of one acceptance run (GPU, or --dry_run), all chosen from N = ``nproc``."""

    device_type: str
    nproc: int
    exact_len: int
    """tokens of the exactness rows, a multiple of 16 N"""
    feature_len: int
    """tokens of the sliding-window and soft-capping rows (Gemma 2's reference is eager attention)"""
    exact_model: dict
    memory_lens: list[int]
    speed_len: int
    doc_len: int
    steps: int
    start_len: int
    layers: int
    model: dict
    fits: int | None = None
    """--dry_run: the longest context that counts as running (a CPU has no out-of-memory error to find)."""

    @property
    def window(self) -> int:
        """The Mistral case's sliding window: 5/16 of its row, longer than a zigzag chunk (L / 2N) at N >= 2."""
        return self.feature_len * 5 // 16

    @classmethod
    def of(cls, dry_run: bool, nproc: int | None, layers: int) -> "Settings":
        from llama_cp.modules.causal_lm import EMBEDDED_LLAMA
        from llama_cp.plan.simulate import MODEL_PRESETS

        if dry_run:
            n = nproc or 2
            tiny = {**EMBEDDED_LLAMA, "num_hidden_layers": 2, **heads_for(n, 8, 32)}  # N = 2: the embedded model's
            length = round_up(64, 16 * n)
            return cls("cpu", n, length, length, tiny, [round_up(128, 2 * n)], round_up(128, 2 * n), 16, 2,
                       round_up(128, 2 * n), 2, tiny, fits=DRY_RUN_FITS)
        if not torch.cuda.is_available():
            raise SystemExit("error: no CUDA GPU here; --dry_run runs the pipeline on the CPU")
        n = nproc or min(torch.cuda.device_count(), 8)
        shape = heads_for(n, 16, 64)  # N = 1, 2, 4, 8: 16 heads of 64, 4 KV heads, hidden 1024
        # widths of multiples of 256: whole blocks of adamw8bit's state in every FSDP2 shard
        small = {**EMBEDDED_LLAMA, **shape, "intermediate_size": round_up(shape["hidden_size"] * 11 // 4, 256),
                 "vocab_size": 32000, "num_hidden_layers": 2}
        model = {**MODEL_PRESETS["llama3-8b"], "num_hidden_layers": layers, "max_position_embeddings": 1 << 24}
        lengths = [round_up(length, 2 * n) for length in (32768, 65536, 131072, 262144, 524288)]
        return cls("cuda", n, round_up(8192, 16 * n), round_up(2048, 16 * n), small, lengths,
                   round_up(65536, 2 * n), 2048, 5, round_up(32768, 2 * n), layers, model)


def set_flags(cfg: TrainConfig, flags: dict) -> None:
    """Set training flags (``--name`` -> value) in ``cfg``, each in its section."""
    for name, value in flags.items():
        section = TrainConfig.flag_names()[name]
        setattr(getattr(cfg, section) if section else cfg, name, value)


def llama_config(shape: dict):
    """A Llama config of ``shape`` (the fields of a ``LlamaConfig``)."""
    from transformers import LlamaConfig

    return LlamaConfig(**shape)


def random_row(config, length: int, doc_len: int | None, seed: int = 0) -> dict[str, torch.Tensor]:
    """One row of random tokens: one document, or documents of ``doc_len`` tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (1, length + 1), generator=g)
    positions = torch.arange(length) if doc_len is None else torch.arange(length) % doc_len
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:].clone(), "position_ids": positions[None]}
