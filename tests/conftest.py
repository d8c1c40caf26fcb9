"""Test tiers. Every test gets one marker by where it runs:

- ``unit``: one process, no process group; seconds.
- ``multirank``: a module of checks run by several gloo ranks in one process group
  (``dist_harness.Checks``); tens of seconds per module.
- ``e2e``: the recipes as users run them (subprocesses, torchrun, notebooks); tens of
  seconds per test.

``multirank`` and ``e2e`` tests, and unit tests marked ``slow`` in their module, are
also ``slow``, except the few multi-rank checks of ``QUICK_CHECKS``. ``python -m pytest -m
"not slow"`` is the quick answer (under a minute on 2 cores); ``python -m pytest`` runs
everything (the README's command, and CI's).
A ``multirank`` module's ranks run only the checks whose tests are selected (node ids,
``-k``: :func:`pytest_collection_finish`), so a few checks cost a few checks' time.
"""

import atexit
import os
import shutil
import sys
import tempfile

import pytest

# Spawned ranks import the test modules by name, so tests/ must be importable, and the repository
# (the ``tests`` package) from the start: the fork server takes sys.path as it is when it starts.
sys.path.insert(0, os.path.dirname(__file__))
_REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPOSITORY not in map(os.path.abspath, sys.path):
    sys.path.insert(1, _REPOSITORY)

# The prepared-data cache (llama_cp/data/prepared.py, under datasets' cache by default) of the runs the
# tests start goes to a folder of this session, removed at exit, not to the user's cache.
_DATASETS_CACHE = tempfile.mkdtemp(prefix="llama_cp_tests_datasets_")
os.environ["HF_DATASETS_CACHE"] = _DATASETS_CACHE
atexit.register(shutil.rmtree, _DATASETS_CACHE, ignore_errors=True)
# GGUF files converted by the tests (tests/real: Note [GGUF in] in llama_cp/modules/gguf.py) likewise: once per session.
_MODEL_CACHE = tempfile.mkdtemp(prefix="llama_cp_tests_models_")
os.environ["LLAMA_CP_CACHE"] = _MODEL_CACHE
atexit.register(shutil.rmtree, _MODEL_CACHE, ignore_errors=True)

#: Modules whose tests run the recipes end to end.
E2E = {"test_recipe", "test_reliability", "test_notebook"}
#: Single-process modules that plan many configurations (tens of seconds).
SLOW_UNIT = {"test_memory_regression"}
#: Multi-rank checks the quick tier runs too, so that a wrong strategy or loss normalisation fails
#: the quick answer: one packed-documents exactness case per strategy, and one FSDP step over
#: dp_shard 2 x cp 2 (the loss divided by the global token count, gradients summed by FSDP).
QUICK_CHECKS = {
    "test_documents": {"ring_cp2_plain_float32", "ulysses_cp2_plain_float32", "allgather_cp2_plain_float32",
                       "hybrid_cp4_u2_plain_float32"},
    "test_fsdp": {"one_step_dp_shard2_cp2_ring"},
}


def _tier(module) -> str:
    name = module.__name__.rsplit(".", 1)[-1]
    if name in E2E:
        return "e2e"
    if getattr(module, "checks", None) is not None:  # a dist_harness.Checks module: one process group
        return "multirank"
    return "unit"


def pytest_collection(session):
    """Start the ranks' fork server (Note [Ranks forked from a preloaded server] in tests/dist_harness.py)
    as collection starts: its imports (~5 s of one core) then run beside the collection's, on the other
    core, instead of before the first multi-rank module's ranks. A run that selects no multi-rank test
    leaves it idle; it ends with this process.

    The server, and every rank forked from it, writes to the standard output and error it is started
    with. Here, outside any test's capture, that would be the terminal (each rank's warnings in the
    middle of pytest's dots), so it is started with both on /dev/null: a check's failure reaches pytest
    as its traceback (dist_harness's results files), not as output. LLAMA_CP_RANKS_OUTPUT=1 keeps the
    terminal, to see what the ranks print."""
    if session.config.option.collectonly:
        return None
    from multiprocessing import forkserver

    import dist_harness  # noqa: F401  its import sets what the server preloads

    quiet = os.environ.get("LLAMA_CP_RANKS_OUTPUT") != "1"
    kept = [os.dup(1), os.dup(2)] if quiet else []
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        if quiet:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            os.close(devnull)
        forkserver.ensure_running()
    finally:
        for fd, saved in zip((1, 2), kept):
            os.dup2(saved, fd)
            os.close(saved)
    return None  # collection goes on as usual


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = _tier(item.module)
        item.add_marker(getattr(pytest.mark, tier))
        if os.path.basename(os.path.dirname(str(item.path))) == "real":  # the pretrained model: slow, whatever tier
            item.add_marker(pytest.mark.real)
            item.add_marker(pytest.mark.slow)
        module = item.module.__name__.rsplit(".", 1)[-1]
        quick = getattr(getattr(item, "callspec", None), "params", {}).get("name") in QUICK_CHECKS.get(module, ())
        if (tier != "unit" or module in SLOW_UNIT) and not quick:
            item.add_marker(pytest.mark.slow)


def pytest_collection_finish(session):
    """Tell each dist_harness.Checks module which of its checks' tests survived selection (node
    ids, -k, -m, --lf), so that its ranks run those only (a module with none starts no ranks)."""
    selected: dict[int, tuple] = {}  # id(checks) -> (checks, names)
    for item in session.items:
        checks = getattr(item.module, "checks", None)
        params = getattr(getattr(item, "callspec", None), "params", {})
        if checks is not None and "name" in params:
            selected.setdefault(id(checks), (checks, set()))[1].add(params["name"])
    for checks, names in selected.values():
        checks.select(names)
