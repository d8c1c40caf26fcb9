"""The long-context levers on 2 gloo ranks, FSDP2 + CP (cp=2, ring): bf16 frozen LoRA weights
against a single-process reference rounded the same way, tiled MLP / norms and checkpoint
offload through the trainer's ``parallelize_model``, offload bit-identical to no offload, and
frozen weights loaded from a checkpoint in their storage dtype."""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

from dist_harness import Checks, shared_tmpdir
from fsdp_checks import FP32_CLOSE, global_batch, reference_loss, sharded_step, tiny_model
from llama_cp import ParallelDims
from llama_cp.config import TrainConfig
from llama_cp.model.build import parallelize_model

WORLD_SIZE = 2
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
checks = Checks()


def lora_config(**flags) -> TrainConfig:
    return TrainConfig.from_flags(
        cp=2, use_peft=True, lora_r=4, lora_alpha=8, lora_target_modules=",".join(TARGETS), context_length=32,
        dtype="float32", loss_chunk_size=7, **flags,
    )


def lora_reference(cfg: TrainConfig):
    """The single-process peft model parallelize_model builds (same seed -> same A), with
    random B so that every adapter has a gradient."""
    torch.manual_seed(1)
    model = get_peft_model(tiny_model(), LoraConfig(
        r=cfg.peft.lora_r, lora_alpha=cfg.peft.lora_alpha, target_modules=list(TARGETS), task_type="CAUSAL_LM",
    ))
    g = torch.Generator().manual_seed(2)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(std=0.1, generator=g)
    return model


def round_frozen(model, dtype=torch.bfloat16):
    for param in model.parameters():
        if not param.requires_grad:
            param.data = param.data.to(dtype).to(param.dtype)
    return model


def sharded_like(reference, cfg: TrainConfig):
    """parallelize_model on the reference's base weights, then the reference's adapters loaded in."""
    mesh = ParallelDims(cp=cfg.parallel.cp).build_mesh("cpu")
    torch.manual_seed(1)
    model = parallelize_model(tiny_model(), cfg, mesh)
    adapters = {n: p.detach() for n, p in reference.named_parameters() if p.requires_grad}
    set_model_state_dict(model, adapters, options=StateDictOptions(full_state_dict=True, strict=False))
    return model, mesh


def compare_lora_grads(model, reference):
    compared = 0
    for (name, param), (ref_name, ref) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert name == ref_name
        if not ref.requires_grad:
            assert param.grad is None, name
            continue
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        torch.testing.assert_close(grad, ref.grad, **FP32_CLOSE, msg=lambda m: f"{name}: {m}")
        compared += 1
    assert compared == 2 * 7 * 2, compared  # A and B of 7 projections in 2 layers


def run_and_compare(cfg: TrainConfig, *, rounded: bool):
    reference = lora_reference(cfg)
    model, mesh = sharded_like(reference, cfg)
    if rounded:
        round_frozen(reference)
    batch = global_batch()
    reference_loss(reference, batch).backward()
    sharded_step(model, batch, mesh)
    compare_lora_grads(model, reference)
    return model


@checks.add
def frozen_bf16_gives_the_gradients_of_a_bf16_rounded_reference():
    model = run_and_compare(lora_config(frozen_dtype="bfloat16"), rounded=True)
    for name, param in model.named_parameters():  # the storage: frozen bf16, adapters fp32
        assert param.to_local().dtype == (torch.float32 if param.requires_grad else torch.bfloat16), name


@checks.add
def frozen_auto_stays_float32_when_computing_in_float32():
    model = run_and_compare(lora_config(), rounded=False)
    assert all(p.dtype == torch.float32 for p in model.parameters())


@checks.add
def tiled_mlp_norms_attention_and_offload_through_parallelize_model():
    cfg = lora_config(frozen_dtype="bfloat16", mlp_tile_size=5, norm_tile_size=3, activation_checkpointing=True,
                      offload_checkpoints=True, attention_block_size=5)
    model = run_and_compare(cfg, rounded=True)
    assert model.checkpoint_offloader.peak_host_bytes > 0
    # 16 local tokens per rank: every ring step in tiles of 5 (Note [Tiled attention])
    assert {m.cp_attention.block_size for m in model.modules() if hasattr(m, "cp_attention")} == {5}


@checks.add
def offloaded_checkpoints_are_bit_identical_under_fsdp_and_cp():
    grads = []
    for offload in (False, True):
        cfg = TrainConfig.from_flags(cp=2, context_length=32, dtype="float32", loss_chunk_size=7,
                                     activation_checkpointing=True, offload_checkpoints=offload)
        mesh = ParallelDims(cp=2).build_mesh("cpu")
        model = parallelize_model(tiny_model(), cfg, mesh)
        sharded_step(model, global_batch(), mesh)
        grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name


@checks.add
def frozen_weights_load_from_a_checkpoint_in_their_storage_dtype():
    from llama_cp.fsdp_wrap import load_full_weights
    from llama_cp.modules.causal_lm import build_causal_lm

    source = tiny_model()
    with shared_tmpdir(prefix="levers-") as path:
        if dist.get_rank() == 0:
            source.save_pretrained(path)
        dist.barrier()
        model = build_causal_lm(source.config, device="meta")
        model = parallelize_model(model, lora_config(frozen_dtype="bfloat16"), ParallelDims(cp=2).build_mesh("cpu"))
        load_full_weights(model, path, device="cpu")
        expected = dict(source.named_parameters())
        checked = 0
        for name, param in model.named_parameters():
            if param.requires_grad:
                continue
            key = name.removeprefix("base_model.model.").replace(".base_layer", "")
            assert param.to_local().dtype == torch.bfloat16, name
            assert torch.equal(param.full_tensor(), expected[key].detach().to(torch.bfloat16)), name
            checked += 1
        assert checked == len(expected)



@checks.add
def lora_adapters_load_as_peft_makes_them():
    """A LoRA model loaded from a checkpoint (load_full_weights) starts where peft starts one: every
    B zero and every A Kaiming-uniform (a = sqrt(5)): within +-1/sqrt(fan_in), with that uniform
    law's spread, as peft's own A of the same model is. Swapped initialisations give the same
    logits (B @ A = 0 either way), so this is the check that sees them."""
    from llama_cp.fsdp_wrap import load_full_weights
    from llama_cp.modules.causal_lm import build_causal_lm

    source = tiny_model()
    cfg = lora_config()
    with shared_tmpdir(prefix="lora-init-") as path:
        if dist.get_rank() == 0:
            source.save_pretrained(path)
        dist.barrier()
        model = parallelize_model(build_causal_lm(source.config, device="meta"), cfg, ParallelDims(cp=2).build_mesh("cpu"))
        load_full_weights(model, path, device="cpu")
    ours = {name: p.full_tensor() for name, p in model.named_parameters() if p.requires_grad}
    peft_model = lora_reference(cfg)  # its A as peft made it (its B it randomises for gradients)
    peft_a = {name: p.detach() for name, p in peft_model.named_parameters() if ".lora_A." in name}
    assert {n for n in ours if ".lora_A." in n} == set(peft_a) and len(ours) == 2 * len(peft_a)
    for name, value in ours.items():
        if ".lora_B." in name:
            assert not value.any(), name
            continue
        bound = 1 / value.shape[1] ** 0.5  # kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        for a in (value, peft_a[name]):
            assert a.abs().max() <= bound and 0.8 < a.std().item() / (bound / 3**0.5) < 1.2, (name, a.std(), bound)

results = checks.module_fixture(__name__, WORLD_SIZE)


@pytest.mark.parametrize("name", checks.names)
def test_check(results, name):
    checks.assert_passed(results, name)
