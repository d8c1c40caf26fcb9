"""FSDP2 on the dp_shard x cp mesh, 4 CPU ranks (gloo), against single-process references."""

import copy
import functools
import os

import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.distributed.tensor import DTensor

from dist_harness import Checks, shared_tmpdir
from fsdp_checks import (
    FP32_CLOSE, assert_grads_equal, build, check_one_step, full_grad, full_param, global_batch, reference_loss,
    sharded_step, step_both, tiny_config_as, tiny_model,
)
from llama_cp import ParallelDims
from llama_cp.fsdp_wrap import gather_full_state_dict, load_full_weights, shard_model
from llama_cp.train.export import export_pretrained
from probes import bnb_cpu_optimizer_problem

WORLD_SIZE = 4
checks = Checks()

for _name, _dims, _strategy in (
    ("dp_shard2_cp2_ring", dict(dp_shard=2, cp=2), "ring"),
    ("dp_shard2_cp2_ulysses", dict(dp_shard=2, cp=2), "ulysses"),
    ("cp4_ring", dict(dp_shard=1, cp=4), "ring"),
    ("dp_shard4", dict(dp_shard=4, cp=1), "ring"),
    ("hsdp_replicate2_cp2", dict(dp_replicate=2, dp_shard=1, cp=2), "ring"),
):
    checks.add(functools.partial(check_one_step, _dims, _strategy), name=f"one_step_{_name}")
checks.add(
    functools.partial(check_one_step, dict(dp_shard=2, cp=2), "ring", activation_checkpointing=True),
    name="one_step_dp_shard2_cp2_activation_checkpointing",
)
checks.add(
    functools.partial(check_one_step, dict(dp_shard=2, cp=2), "ring", reshard_after_forward=False),
    name="one_step_dp_shard2_cp2_no_reshard",
)


def lora(model):
    config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]
    )
    model = get_peft_model(model, config)
    torch.manual_seed(7)  # lora_B starts at zero: give it values so every adapter weight gets a gradient
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    return model


def check_five_adamw_steps(use_lora: bool):
    reference = tiny_model()
    if use_lora:
        reference = lora(reference)
    initial = {k: v.clone() for k, v in reference.state_dict().items()}
    model, mesh = build(ParallelDims(dp_shard=2, cp=2), copy.deepcopy(reference))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    losses, ref_losses = [], []
    for step in range(5):
        batch = global_batch(step)
        ref_loss = reference_loss(reference, batch)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(sharded_step(model, batch, mesh).item())
        opt.step()
        opt.zero_grad()
        ref_losses.append(ref_loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-6)
    assert ref_losses[-1] < ref_losses[0]
    for (name, param), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(full_param(param), ref.detach(), atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    if use_lora:
        trained = {n for n, p in reference.named_parameters() if p.requires_grad}
        assert trained and all("lora_" in n or "modules_to_save" in n for n in trained), trained
        for name, value in reference.state_dict().items():
            if "lora_" not in name and "modules_to_save" not in name:
                torch.testing.assert_close(value, initial[name], rtol=0, atol=0, msg=lambda m: f"{name} changed: {m}")


checks.add(functools.partial(check_five_adamw_steps, False), name="five_adamw_steps_full")
checks.add(functools.partial(check_five_adamw_steps, True), name="five_adamw_steps_lora")


@checks.add
def gradient_accumulation_two_micro_steps_equal_one_step():
    model, reference, loss, ref_loss = step_both(dict(dp_shard=1, cp=4), micro_batches=2)
    torch.testing.assert_close(loss, ref_loss, **FP32_CLOSE)
    assert_grads_equal(model, reference)


@checks.add
def per_rank_bytes_are_total_over_dp_shard_x_cp():
    model, mesh = build(ParallelDims(dp_shard=2, cp=2), tiny_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sharded_step(model, global_batch(), mesh)
    opt.step()
    params = list(model.parameters())
    assert all(isinstance(p, DTensor) for p in params)
    total = sum(p.numel() for p in params)
    one_row_each = sum(p.numel() // p.shape[0] for p in params)  # Shard(0) pads each tensor by < 1 row per rank
    local_params = sum(p.to_local().numel() for p in params)
    local_grads = sum(p.grad.to_local().numel() for p in params)
    local_states = sum(
        s.to_local().numel() for state in opt.state.values() for k, s in state.items() if k != "step"
    )
    assert abs(local_params - total / 4) <= one_row_each, (local_params, total)
    assert local_grads == local_params
    assert local_states == 2 * local_params  # exp_avg and exp_avg_sq


@checks.add
def clipping_uses_the_global_norm():
    """The trainer's clipping (llama_cp.optim.step.clip_gradients) on the sharded model: the norm over
    every rank's shards, and the gradients scaled as one process scales them (computed here by
    hand, not by torch's clip_grad_norm_); max_grad_norm 0 reports the norm and clips nothing."""
    from llama_cp.optim.step import clip_gradients

    model, reference, _, _ = step_both(dict(dp_shard=2, cp=2))
    grads = [p.grad for p in reference.parameters() if p.grad is not None]
    ref_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert ref_norm > 0.05, "the test needs a norm above max_norm"
    unclipped = clip_gradients(model, max_grad_norm=0.0)
    torch.testing.assert_close(unclipped, ref_norm, **FP32_CLOSE)
    assert_grads_equal(model, reference)  # nothing clipped at 0
    norm = clip_gradients(model, max_grad_norm=0.05)
    torch.testing.assert_close(norm, ref_norm, **FP32_CLOSE)
    for g in grads:
        g.mul_(0.05 / (ref_norm + 1e-6))
    assert_grads_equal(model, reference)


def _check_save_load_export(original):
    """``original`` saved with save_pretrained loads into a model built on the meta device and
    sharded over dp_shard 2 x cp 2 with the original's values, computes its logits, and exports
    back to a directory from_pretrained reads."""
    from transformers import AutoModelForCausalLM

    with shared_tmpdir() as path:
        if dist.get_rank() == 0:
            original.save_pretrained(path)
        dist.barrier()
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(original.config)
        mesh = ParallelDims(dp_shard=2, cp=2).build_mesh("cpu")
        shard_model(model, mesh)
        load_full_weights(model, path, device="cpu")
        gathered = gather_full_state_dict(model)
        if dist.get_rank() == 0:
            want = original.state_dict()
            assert set(gathered) == set(want)
            for key, value in want.items():
                torch.testing.assert_close(gathered[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
        else:
            assert gathered == {}
        # the loaded, sharded model computes what the original computes
        batch = global_batch()
        torch.testing.assert_close(
            model(input_ids=batch["input_ids"]).logits, original(input_ids=batch["input_ids"]).logits, **FP32_CLOSE
        )
        # and exports back to an HF directory that from_pretrained reads
        export_dir = os.path.join(path, "export")
        export_pretrained(model, export_dir)
        assert not [f for f in os.listdir(path) if f.startswith(".tmp-export-")]
        reloaded = AutoModelForCausalLM.from_pretrained(export_dir)
        for key, value in original.state_dict().items():
            torch.testing.assert_close(reloaded.state_dict()[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")


@checks.add
def load_sharded_from_save_pretrained_and_gather_back():
    _check_save_load_export(tiny_model(seed=3))


@checks.add
def load_an_moe_checkpoint_sharded_and_export_it():
    """A Mixtral checkpoint as save_pretrained writes it (transformers 5: per-expert w1/w2/w3 that
    the model holds fused) loads into the sharded model, as a Llama's does."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(5)
    _check_save_load_export(AutoModelForCausalLM.from_config(
        tiny_config_as("mixtral", num_local_experts=4, num_experts_per_tok=2)))


@functools.partial(checks.add, skip=bnb_cpu_optimizer_problem())
def adamw8bit_with_empty_local_shards_steps_and_resumes():
    """LoRA r=2 over 4 ranks: lora_A has 2 rows, so ranks 2 and 3 own empty shards of it, which
    bitsandbytes is never given. Every LoRA tensor is below bitsandbytes' min_8bit_size (its state
    is 32-bit, element-wise), so the sharded steps equal AdamW8bit on the whole tensors fed the
    same gathered gradients, bit for bit; a fresh run resumed from step 2's checkpoint steps the same."""
    import bitsandbytes as bnb

    from llama_cp.optim.optimizers import build_optimizer
    from llama_cp.train.checkpoint import load_checkpoint, save_checkpoint

    def fresh():
        model = get_peft_model(tiny_model(), LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0,
                                                        target_modules=["q_proj", "v_proj"]))
        torch.manual_seed(7)
        for name, param in model.named_parameters():
            if "lora_B" in name:  # starts at zero: give it values so that lora_A gets gradients
                torch.nn.init.normal_(param, std=0.02)
        model, mesh = build(ParallelDims(dp_shard=4, cp=1), model)
        trained = [p for p in model.parameters() if p.requires_grad]
        return model, mesh, trained, build_optimizer("adamw8bit", trained, lr=1e-2, weight_decay=0.1)

    model, mesh, trained, optimizer = fresh()
    empty = [p for p in trained if p.to_local().numel() == 0]
    assert len(empty) == (4 if dist.get_rank() >= 2 else 0), [p.to_local().shape for p in trained]  # 2 lora_A each
    assert all(p.numel() > 0 for group in optimizer.inner.param_groups for p in group["params"])
    assert all(p.numel() < optimizer.inner.args.min_8bit_size for p in trained)  # 32-bit state throughout
    reference = [nn.Parameter(full_param(p).clone()) for p in trained]
    ref_optimizer = bnb.optim.AdamW8bit(reference, lr=1e-2, weight_decay=0.1)
    with shared_tmpdir() as out:
        for batch_step in range(3):
            sharded_step(model, global_batch(batch_step), mesh)
            for ref, param in zip(reference, trained, strict=True):
                ref.grad = full_grad(param).clone()
            optimizer.step()
            optimizer.zero_grad()
            ref_optimizer.step()
            if batch_step == 1:
                saved = save_checkpoint(out, 2, model, optimizer)
        for ref, param in zip(reference, trained, strict=True):
            torch.testing.assert_close(full_param(param), ref.detach(), rtol=0, atol=0)
        resumed, resumed_mesh, resumed_trained, resumed_optimizer = fresh()
        load_checkpoint(saved, resumed, resumed_optimizer)
        sharded_step(resumed, global_batch(2), resumed_mesh)
        resumed_optimizer.step()
        for got, want in zip(resumed_trained, trained, strict=True):
            torch.testing.assert_close(full_param(got), full_param(want), rtol=0, atol=0)


results = checks.module_fixture(__name__, WORLD_SIZE)


@pytest.mark.parametrize("name", checks.names)
def test_check(results, name):
    checks.assert_passed(results, name)
