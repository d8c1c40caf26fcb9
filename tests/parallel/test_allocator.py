"""The CUDA caching allocator's expandable segments (Note [Expandable segments] in
llama_cp/parallel/mesh.py): on by default where the run trains on CUDA, set before the first
allocation, and never over a user's own PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF. The CUDA
calls are replaced by recorders with the same signatures; the setting string itself goes through
the real torch binding."""

import pytest
import torch

import llama_cp.parallel.mesh as mesh


@pytest.fixture
def cuda_calls(monkeypatch):
    """init_distributed on a CUDA machine of one rank, its CUDA and process-group calls recorded in order."""
    calls = []
    for name in mesh.ALLOCATOR_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(mesh, "machine_device_type", lambda: "cuda")
    monkeypatch.setattr(mesh.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(mesh.dist, "init_process_group", lambda backend, timeout=None: calls.append(("group", backend)))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", lambda env: calls.append(("allocator", env)))
    return calls


def test_a_cuda_run_turns_on_expandable_segments_before_its_first_allocation(cuda_calls):
    assert mesh.init_distributed() == "cuda"
    assert cuda_calls == [("allocator", "expandable_segments:True"), ("set_device", 0), ("group", "nccl")]


@pytest.mark.parametrize("variable", mesh.ALLOCATOR_VARIABLES)
@pytest.mark.parametrize("value", ["expandable_segments:False", "backend:cudaMallocAsync", ""])
def test_a_users_allocator_setting_is_kept(cuda_calls, monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    assert mesh.init_distributed() == "cuda"
    assert cuda_calls == [("set_device", 0), ("group", "nccl")]


def test_this_torch_accepts_the_setting():
    """The binding exists on every admitted torch (2.10 to 2.13) and parses the string; where torch
    has the getter (2.13; not 2.10 or 2.11), it reads it back. On a CPU build nothing allocates through it."""
    torch._C._accelerator_setAllocatorSettings("expandable_segments:True")
    if hasattr(torch._C, "_accelerator_getAllocatorSettings"):
        assert "expandable_segments:True" in torch._C._accelerator_getAllocatorSettings()
