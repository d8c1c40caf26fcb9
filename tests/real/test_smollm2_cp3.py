"""SmolLM2-135M-Instruct (real weights, real tokenizer and chat template) at cp 3, on 3 gloo
ranks: ring and all-gather with packed chat documents, FSDP and LoRA equal plain transformers
(a zigzag chunk of 20 tokens cuts the conversations at other places than cp 2's 30). The model:
tests/real/smollm2.py."""

import functools

import pytest
import torch

from dist_harness import Checks
from smollm2 import SHALLOW, check_real_model, why_missing

WORLD_SIZE = 3
MISSING = why_missing()
checks = Checks()


CASES = [  # (strategy, sharded, LoRA, decoder layers), grouped by reference (each is built once)
    ("allgather", False, False, None),  # all 30
    ("ring", True, False, SHALLOW),
    ("ring", False, True, SHALLOW),
    ("allgather", True, True, SHALLOW),
]
for _strategy, _sharded, _lora, _layers in CASES:
    checks.add(functools.partial(check_real_model, _strategy, 3, _sharded, _lora, torch.float32, _layers),
               name=f"{_strategy}_cp3_{'fsdp' if _sharded else 'plain'}{'_lora' if _lora else ''}_float32",
               skip=MISSING)

results = checks.module_fixture(__name__, WORLD_SIZE)


@pytest.mark.parametrize("name", checks.names)
def test_check(results, name):
    checks.assert_passed(results, name)
