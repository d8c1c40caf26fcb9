"""SmolLM2-135M-Instruct (real weights, real tokenizer and chat template) at cp 2, on 2 gloo
ranks: ring and all-gather with packed chat documents, FSDP and LoRA equal plain transformers;
Ulysses is refused in one line (9 heads). The model: tests/real/smollm2.py."""

import functools

import pytest
import torch

from dist_harness import Checks
from document_checks import mesh_for
from smollm2 import SHALLOW, check_real_model, why_missing

WORLD_SIZE = 2
MISSING = why_missing()
checks = Checks()


CASES = [  # (strategy, sharded, LoRA, dtype, decoder layers), grouped by reference (each is built once)
    ("ring", False, False, torch.float32, None),  # all 30
    ("allgather", False, False, torch.float32, SHALLOW),
    ("ring", True, False, torch.float32, SHALLOW),
    ("allgather", True, True, torch.float32, SHALLOW),
    ("ring", False, True, torch.float64, SHALLOW),
]
for _strategy, _sharded, _lora, _dtype, _layers in CASES:
    checks.add(functools.partial(check_real_model, _strategy, 2, _sharded, _lora, _dtype, _layers),
               name=f"{_strategy}_cp2_{'fsdp' if _sharded else 'plain'}{'_lora' if _lora else ''}_{str(_dtype)[6:]}",
               skip=MISSING)


@checks.add(skip=MISSING)
def ulysses_cp2_is_refused_naming_the_heads():
    """9 query heads do not split over 2 ranks: the trainer's check and apply_context_parallel each say
    so in one line, with what works instead."""
    from llama_cp import apply_context_parallel
    from llama_cp.config import TrainConfig
    from llama_cp.model.build import check_strategy_heads
    from smollm2 import load_model

    model = load_model()
    cfg = TrainConfig()
    cfg.parallel.cp, cfg.parallel.cp_strategy = 2, "ulysses"
    with pytest.raises(ValueError) as refused:
        check_strategy_heads(cfg, model.config)
    message = str(refused.value)
    # hybrid is not offered: no Ulysses degree above 1 divides both 9 heads and 2 ranks
    assert "\n" not in message and "9" in message and "--cp_strategy ring" in message, message
    assert "hybrid" not in message, message
    with pytest.raises(ValueError, match=r"num_attention_heads \(9\) divisible by cp \(2\)"):
        apply_context_parallel(model, mesh_for(2, WORLD_SIZE)["cp"], strategy="ulysses", max_seq_len=120)


results = checks.module_fixture(__name__, WORLD_SIZE)


@pytest.mark.parametrize("name", checks.names)
def test_check(results, name):
    checks.assert_passed(results, name)
