"""Test tiers. Every test gets one marker by where it runs:

- ``unit``: one process, no process group; seconds.
- ``multirank``: a module of checks run by several gloo ranks in one process group
  (``dist_harness.Checks``); tens of seconds per module.
- ``e2e``: the recipes as users run them (subprocesses, torchrun, notebooks); tens of
  seconds per test.

``multirank`` and ``e2e`` tests, and unit tests marked ``slow`` in their module, are
also ``slow``. ``python -m pytest -m "not slow"`` is the quick answer (under two minutes
on 2 cores); ``python -m pytest`` runs everything (the README's command, and CI's).
"""

import os
import sys

import pytest

# Spawned ranks import the test modules by name, so tests/ must be importable.
sys.path.insert(0, os.path.dirname(__file__))

#: Modules whose tests are multi-rank checks.
MULTIRANK = {
    "test_checkpoint", "test_cp_attention", "test_documents", "test_documents_cp3", "test_families", "test_fsdp",
    "test_fsdp_world2", "test_memory_validation", "test_memory_regression", "test_qlora", "test_levers",
}
#: Modules whose tests run the recipes end to end.
E2E = {"test_recipe", "test_reliability", "test_notebook"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        tier = "multirank" if module in MULTIRANK else "e2e" if module in E2E else "unit"
        item.add_marker(getattr(pytest.mark, tier))
        if tier != "unit":
            item.add_marker(pytest.mark.slow)
