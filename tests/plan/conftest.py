"""Shared by the planner tests."""

import gc

import pytest


@pytest.fixture(scope="module", autouse=True)
def _frozen_import_heap():
    """Each simulation calls ``gc.collect()`` twice (``measure_step_memory``: no garbage of earlier
    steps in the tracked peak), and a full collection walks every object of the process: ~0.3 s
    per call once torch, transformers and peft are imported, over a third of a simulation. The
    objects alive before a module's tests (imports, after a full collection: none of them garbage,
    none of them a tensor of any simulation) are moved out of the collector's reach for the
    module; everything the simulations create is collected exactly as before. (peft and the Llama
    model are imported by the first simulation otherwise, and would stay in the walk.)"""
    import peft  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401

    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
