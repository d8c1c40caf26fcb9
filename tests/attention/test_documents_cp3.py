"""Packed documents at cp 3 (a world of 3 CPU ranks): see ``test_documents.py``."""

import functools

import pytest
import torch

from dist_harness import Checks
from document_checks import check_documents, check_ring_skips, mesh_for

WORLD_SIZE = 3
checks = Checks()

for _strategy in ("ring", "ulysses"):
    for _mode in ("plain", "fsdp", "lora"):
        for _dtype in (torch.float32, torch.float64):
            checks.add(
                functools.partial(
                    lambda s, m, d: check_documents(s, mesh_for(3, WORLD_SIZE), m != "plain", d, m == "lora"),
                    _strategy, _mode, _dtype,
                ),
                name=f"{_strategy}_cp3_{_mode}_{str(_dtype)[6:]}",
            )
for _dtype in (torch.float32, torch.float64):
    checks.add(
        functools.partial(lambda d: check_documents("allgather", mesh_for(3, WORLD_SIZE), False, d), _dtype),
        name=f"allgather_cp3_plain_{str(_dtype)[6:]}",
    )
for _u in (1, 3):  # cp 3 = 3 x 1 or 1 x 3
    checks.add(functools.partial(lambda u: check_documents("hybrid", mesh_for(3, WORLD_SIZE), False, torch.float64,
                                                           ulysses_degree=u), _u),
               name=f"hybrid_cp3_u{_u}_plain_float64")
for _dtype in (torch.float32, torch.float64):
    checks.add(functools.partial(check_ring_skips, 3, WORLD_SIZE, _dtype),
               name=f"ring_skips_blocks_no_query_sees_cp3_{str(_dtype)[6:]}")

results = checks.module_fixture(__name__, WORLD_SIZE)


@pytest.mark.parametrize("name", checks.names)
def test_check(results, name):
    checks.assert_passed(results, name)
