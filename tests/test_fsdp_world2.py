"""FSDP2 with world 2 as dp_shard=2 (no CP): one step equals the single-process step."""

import functools

import pytest

from dist_harness import Checks
from fsdp_checks import check_one_step

WORLD_SIZE = 2
checks = Checks()
checks.add(functools.partial(check_one_step, dict(dp_shard=2, cp=1)), name="one_step_dp_shard2")
checks.add(functools.partial(check_one_step, dict(dp_shard=1, cp=2), "ulysses"), name="one_step_cp2_ulysses")
checks.add(functools.partial(check_one_step, dict(dp_shard=1, cp=2), offload=True), name="one_step_cp2_activation_offload")


@checks.add
def cpu_offload_on_a_cpu_mesh_equals_one_process():
    """FSDP2's CPU offload policy on a CPU mesh (its copies stay on the host; once refused here,
    now what the --offload_params tests run on): one dp_shard 2 step equals the single process."""
    check_one_step({"dp_shard": 2}, cpu_offload=True)


results = checks.module_fixture(__name__, WORLD_SIZE)


@pytest.mark.parametrize("name", checks.names)
def test_check(results, name):
    checks.assert_passed(results, name)
