"""The FSDP memory regression matrix: planned per-rank peak memory by category of a mid-size
Llama over cp x dp_shard x (full, LoRA) x checkpointing x sequence length, kept as baselines.

Refresh the baselines after an intentional memory change (and say why in the commit):

    python tests/plan/memory_matrix.py
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
from pathlib import Path

from transformers import LlamaConfig

from llama_cp.config import TrainConfig
from llama_cp.plan.memory import MemoryBreakdown, step_peak
from llama_cp.plan.simulate import simulate_step_phases

BASELINES = Path(__file__).with_name("baselines.json")

#: Mid-size: big enough that every category is visible, 3 layers so one simulation is the whole model.
MID_SIZE = dict(
    vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=3, num_attention_heads=8,
    num_key_value_heads=2, head_dim=64, rope_theta=500000.0, tie_word_embeddings=False,
    max_position_embeddings=1 << 20,
)

CPS, DP_SHARDS, TUNINGS, CHECKPOINTING, SEQ_LENS = (1, 2, 4), (1, 2), ("full", "lora"), (False, True), (2048, 4096)


def mid_size_config(**overrides) -> LlamaConfig:
    return LlamaConfig(**{**MID_SIZE, **overrides})


def case_name(cp: int, dp_shard: int, tuning: str, checkpointing: bool, seq_len: int) -> str:
    return f"cp{cp}-dp{dp_shard}-{tuning}-{'ckpt' if checkpointing else 'no_ckpt'}-L{seq_len}"


CASES = {
    case_name(*case): case for case in itertools.product(CPS, DP_SHARDS, TUNINGS, CHECKPOINTING, SEQ_LENS)
}


def case_config(cp: int, dp_shard: int, tuning: str, checkpointing: bool, seq_len: int) -> TrainConfig:
    return TrainConfig.from_flags(
        context_length=seq_len, cp=cp, dp_shard=dp_shard, use_peft=tuning == "lora",
        activation_checkpointing=checkpointing, dtype="bfloat16",
        attention_backend="sdpa_cpu",  # FSDP/CP accounting; the GPU kernels' workspace: tests/attention/test_workspace.py
    )


def run_case(name: str) -> dict[str, MemoryBreakdown]:
    """The planned peaks, per phase of a step, of the busiest rank of the case's (cp x dp_shard)-rank job."""
    cp, dp_shard, *_ = CASES[name]
    return simulate_step_phases(case_config(*CASES[name]), cp * dp_shard, model_config=mid_size_config())



def once_per_arguments(monkeypatch, module, name: str, known=()) -> list:
    """Replace ``module.name`` (a deterministic planner function) for the test by one that computes
    each set of arguments (compared by equality) once and returns the same result for it after.
    ``known``: (args, kwargs, result) already computed elsewhere. Returns the list of every
    (args, kwargs, result), ``known`` first, then those computed in this test."""
    function, done = getattr(module, name), list(known)

    def once(*args, **kwargs):
        for done_args, done_kwargs, result in done:
            if (done_args, done_kwargs) == (args, kwargs):
                return result
        done.append((args, kwargs, function(*args, **kwargs)))
        return done[-1][2]

    monkeypatch.setattr(module, name, once)
    return done

def load_baselines() -> dict[str, dict[str, int]]:
    with open(BASELINES) as f:
        return json.load(f)


def write_baselines() -> None:
    results = {name: step_peak(run_case(name)).to_dict() for name in CASES}
    fd, tmp = tempfile.mkstemp(dir=BASELINES.parent, suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, BASELINES)
    print(f"wrote {len(results)} baselines to {BASELINES}")


if __name__ == "__main__":
    write_baselines()
