"""FSDP2 with world 2 as dp_shard=2 (no CP): one step equals the single-process step."""

import functools

import pytest

from dist_harness import Checks
from fsdp_checks import build, check_one_step, tiny_model
from llama_cp import ParallelDims

WORLD_SIZE = 2
checks = Checks()
checks.add(functools.partial(check_one_step, dict(dp_shard=2, cp=1)), name="one_step_dp_shard2")
checks.add(functools.partial(check_one_step, dict(dp_shard=1, cp=2), "ulysses"), name="one_step_cp2_ulysses")
checks.add(functools.partial(check_one_step, dict(dp_shard=1, cp=2), offload=True), name="one_step_cp2_activation_offload")


@checks.add
def cpu_offload_on_a_cpu_mesh_is_a_clear_error():
    with pytest.raises(ValueError, match="drop cpu_offload"):
        build(ParallelDims(dp_shard=2), tiny_model(), cpu_offload=True)


results = checks.module_fixture(__name__, WORLD_SIZE)


@pytest.mark.parametrize("name", checks.names)
def test_check(results, name):
    checks.assert_passed(results, name)
