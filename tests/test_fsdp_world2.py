"""FSDP2 with world 2 as dp_shard=2 (no CP): one step equals the single-process step."""

import functools

import pytest

from dist_harness import Checks
from fsdp_checks import check_one_step

WORLD_SIZE = 2
checks = Checks()
checks.add(functools.partial(check_one_step, dict(dp_shard=2, cp=1)), name="one_step_dp_shard2")
checks.add(functools.partial(check_one_step, dict(dp_shard=1, cp=2), "ulysses"), name="one_step_cp2_ulysses")

results = checks.module_fixture(__name__, WORLD_SIZE)


@pytest.mark.parametrize("name", checks.names)
def test_check(results, name):
    checks.assert_passed(results, name)
