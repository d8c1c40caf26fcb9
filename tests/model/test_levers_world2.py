"""The long-context levers on 2 gloo ranks, FSDP2 + CP (cp=2, ring): bf16 frozen LoRA weights
against a single-process reference rounded the same way, tiled MLP / norms and checkpoint
offload through the trainer's ``parallelize_model``, offload bit-identical to no offload,
frozen weights loaded from a checkpoint in their storage dtype, and the LoRA options
(all-linear, rsLoRA, modules_to_save, DoRA) against a single-process transformers + peft model."""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from dist_harness import Checks, shared_tmpdir
from fsdp_checks import FP32_CLOSE, full_param, global_batch, reference_loss, sharded_step, tiny_model
from llama_cp import ParallelDims
from llama_cp.config import TrainConfig
from llama_cp.model.build import parallelize_model

WORLD_SIZE = 2
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
checks = Checks()


def lora_config(**flags) -> TrainConfig:
    return TrainConfig.from_flags(**{
        **dict(cp=2, use_peft=True, lora_r=4, lora_alpha=8, lora_target_modules=",".join(TARGETS), context_length=32,
               dtype="float32", loss_chunk_size=7),
        **flags,
    })


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


def compare_lora_grads(model, reference, expected: int = 2 * 7 * 2):
    """Every trainable parameter's gradient (``expected`` of them; default: A and B of 7 projections
    in 2 layers) equals the reference's, and frozen ones have none."""
    compared = 0
    for (name, param), (ref_name, ref) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert name == ref_name
        if not ref.requires_grad:
            assert param.grad is None, name
            continue
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        torch.testing.assert_close(grad, ref.grad, **FP32_CLOSE, msg=lambda m: f"{name}: {m}")
        compared += 1
    assert compared == expected, compared


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



def loaded_from_checkpoint(source, cfg: TrainConfig):
    """``source`` saved as a checkpoint directory, then built on the meta device by parallelize_model
    (cp 2) and loaded by the sharded loader, as the trainer loads a --model_name."""
    from llama_cp.fsdp_wrap import load_full_weights
    from llama_cp.modules.causal_lm import build_causal_lm

    with shared_tmpdir(prefix="checkpoint-") as path:
        if dist.get_rank() == 0:
            source.save_pretrained(path)
        dist.barrier()
        model = parallelize_model(build_causal_lm(source.config, device="meta"), cfg, ParallelDims(cp=2).build_mesh("cpu"))
        load_full_weights(model, path, device="cpu")
    return model


@checks.add
def lora_adapters_load_as_peft_makes_them():
    """A LoRA model loaded from a checkpoint (load_full_weights) starts where peft starts one: every
    B zero and every A Kaiming-uniform (a = sqrt(5)): within +-1/sqrt(fan_in), with that uniform
    law's spread, as peft's own A of the same model is. Swapped initialisations give the same
    logits (B @ A = 0 either way), so this is the check that sees them."""
    cfg = lora_config()
    model = loaded_from_checkpoint(tiny_model(), cfg)
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

@checks.add
def dora_magnitudes_load_as_peft_makes_them():
    """--use_dora on a checkpoint directory: the loader starts each magnitude as peft does on the
    loaded model, the row norms of its base weight (it was refused: the sharded loader knew no
    magnitude)."""
    model = loaded_from_checkpoint(tiny_model(), lora_config(use_dora=True))
    ours = {name: p.full_tensor() for name, p in model.named_parameters() if ".lora_magnitude_vector." in name}
    reference = get_peft_model(tiny_model(), LoraConfig(r=4, lora_alpha=8, target_modules=list(TARGETS), use_dora=True,
                                                        task_type="CAUSAL_LM"))
    want = {name: p.detach() for name, p in reference.named_parameters() if ".lora_magnitude_vector." in name}
    assert set(ours) == set(want) and len(want) == 2 * len(TARGETS)
    for name, value in want.items():
        torch.testing.assert_close(ours[name], value, rtol=0, atol=0, msg=name)


def check_against_peft(cfg: TrainConfig, lora: LoraConfig, expected: int):
    """The model parallelize_model makes of ``cfg`` (FSDP2 over the 2 ranks, ring CP, the chunked loss)
    against the single-process transformers + peft model of ``lora``: the same trainable parameters
    by name, the same loss and gradients. Every trainable tensor but A is moved off its start (B off
    zero, modules_to_save copies off their originals, DoRA's magnitudes off the weights' norms), so
    using the wrong one shows."""
    torch.manual_seed(1)  # the seed sharded_like builds with: the same A
    reference = get_peft_model(tiny_model(), lora)
    g = torch.Generator().manual_seed(2)
    for name, param in reference.named_parameters():
        if param.requires_grad and ".lora_A." not in name:
            param.data.add_(torch.randn(param.shape, generator=g), alpha=0.1)
    model, mesh = sharded_like(reference, cfg)
    batch = global_batch()
    ref_loss = reference_loss(reference, batch)
    ref_loss.backward()
    torch.testing.assert_close(sharded_step(model, batch, mesh), ref_loss.detach(), **FP32_CLOSE)
    compare_lora_grads(model, reference, expected)


@checks.add
def all_linear_rslora_and_modules_to_save_match_peft():
    """--lora_target_modules all-linear (7 projections a layer, not lm_head), --use_rslora (scale
    8 / sqrt(4), not 8 / 4) and --lora_modules_to_save embed_tokens,norm (the embedding and the 5
    norms trained in full, their copies sharded by FSDP2 and fed by both cp ranks' tokens)."""
    cfg = lora_config(lora_target_modules="all-linear", use_rslora=True, lora_modules_to_save="embed_tokens,norm")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_rslora=True,
                      modules_to_save=["embed_tokens", "norm"], task_type="CAUSAL_LM")
    check_against_peft(cfg, lora, expected=2 * 7 * 2 + 1 + 5)


@checks.add
def dora_matches_peft_with_activation_checkpointing():
    """--use_dora: each layer's weight norm from its all-gathered base weight and adapters (the same
    on both cp ranks), the magnitudes sharded by FSDP2 and trained; through the recompute too."""
    cfg = lora_config(use_dora=True, activation_checkpointing=True)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=list(TARGETS), use_dora=True, task_type="CAUSAL_LM")
    check_against_peft(cfg, lora, expected=2 * 7 * 3)


@checks.add
def norm_tiles_refuse_trainable_norm_copies():
    """--norm_tile_size finds the norms by class; peft's wrapper around a trainable copy is none."""
    cfg = lora_config(lora_modules_to_save="norm", norm_tile_size=3)
    with pytest.raises(ValueError, match=r"^--norm_tile_size with --lora_modules_to_save norm: the LlamaRMSNorms are "
                                         r"then peft's wrappers around trainable copies, which the tiling does not "):
        parallelize_model(tiny_model(), cfg, ParallelDims(cp=2).build_mesh("cpu"))


@checks.add
def offloaded_parameters_give_the_plain_steps_exactly():
    """--offload_params (FSDP2's CPU offload policy) through parallelize_model: two AdamW steps with
    clipping give the losses and parameters of the same steps without it, bit for bit (on a CPU
    mesh the policy's copies stay on the host; the GPU run: docs/benchmarks.md), with foreach and
    with fused AdamW, the implementation the trainer takes for host shards (Note [AdamW's
    implementation, pinned]); fused and foreach differ by rounding only."""
    from llama_cp.optim.optimizers import build_optimizer
    from llama_cp.optim.step import apply_gradients

    runs = {}
    for offload, on_host in [(False, False), (True, False), (False, True), (True, True)]:
        cfg = TrainConfig.from_flags(cp=2, context_length=32, dtype="float32", loss_chunk_size=7,
                                     offload_params=offload)
        mesh = ParallelDims(cp=2).build_mesh("cpu")
        torch.manual_seed(1)
        model = parallelize_model(tiny_model(), cfg, mesh)
        offloaded = {fsdp_param.offload_to_cpu for module in model.modules() if isinstance(module, FSDPModule)
                     for group in [module._get_fsdp_state()._fsdp_param_group] if group is not None
                     for fsdp_param in group.fsdp_params}
        assert offloaded == {offload}, offloaded
        optimizer = build_optimizer("adamw", model, lr=1e-2, weight_decay=0.0, on_host=on_host)
        assert optimizer.defaults["fused"] is (True if on_host else None), optimizer.defaults
        losses = []
        for step in range(2):
            losses.append(sharded_step(model, global_batch(step), mesh).item())
            apply_gradients(model, optimizer, max_grad_norm=0.5)
        runs[offload, on_host] = (losses, [full_param(param) for param in model.parameters()])
    for on_host in (False, True):
        (plain_losses, plain_params), (losses, params) = runs[False, on_host], runs[True, on_host]
        assert losses == plain_losses, on_host
        assert all(torch.equal(a, b) for a, b in zip(params, plain_params, strict=True)), on_host
    (foreach_losses, foreach_params), (fused_losses, fused_params) = runs[True, False], runs[True, True]
    assert fused_losses[0] == foreach_losses[0]  # no step yet
    for a, b in zip(fused_params, foreach_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


results = checks.module_fixture(__name__, WORLD_SIZE)


@pytest.mark.parametrize("name", checks.names)
def test_check(results, name):
    checks.assert_passed(results, name)
