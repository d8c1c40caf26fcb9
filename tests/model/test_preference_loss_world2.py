"""Preference losses on 2 gloo ranks: DPO (and SimPO, ORPO) on rows of packed pairs whose documents
cross the cp shards, under ring and all-gather at cp 2 (cp 4: test_families.py's world of 4): the
step's loss and every parameter gradient equal single-process transformers (test_preference_loss.py's
batch and reference), float64 tight; then the Trainer's own DPO step (its data, reference model,
pair count and reductions) under ring, Ulysses and all-gather at cp 2 and dp_shard 2, LoRA and full
fine-tuning, FSDP, float32, against transformers (+ peft) with the formulas written out here."""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dist_harness import Checks, shared_tmpdir
from llama_cp.parallel.mesh import submesh
from preference_checks import BETA, GAMMA, TOLERANCE, check_pairs, reference_losses

WORLD_SIZE = 2
checks = Checks()


@checks.add
def ring_cp2_dpo_simpo_orpo_float64():
    check_pairs("ring", 2, False, torch.float64, kinds=("sigmoid", "simpo", "orpo"))


@checks.add
def allgather_cp2_dpo_float64():
    check_pairs("allgather", 2, False, torch.float64)



# ---------------------------------------------------------------- the trainer's DPO step
def write_pair_file(path: str, count: int = 24) -> str:
    """String pairs of varied lengths (the embedded tokenizer's ids are bytes): rows of 64 tokens hold
    two or three pairs, and at cp 2 the zigzag chunks cut through sequences."""
    import json

    with open(path, "w") as f:
        for i in range(count):
            f.write(json.dumps({"prompt": f"Q{i}: " + "a" * (i % 5), "chosen": " yes" + "!" * (i % 3),
                                "rejected": " no" + "?" * (i % 4)}) + "\n")
    return path


def trainer_for(root: str, said: list | None = None, **flags):
    """A Trainer set up (model, optimizer, data, reference) on the pair file in ``root``; ``said``
    collects its messages."""
    from llama_cp import TrainConfig, Trainer

    base = dict(objective="dpo", dataset=os.path.join(root, "pairs.jsonl"), context_length=64, batch_size=2,
                gradient_accumulation_steps=2, dtype="float32", eval_fraction=0, loss_chunk_size=7, dpo_beta=BETA,
                simpo_gamma=GAMMA, output_dir=os.path.join(root, "run"), data_cache_dir=os.path.join(root, "cache"),
                report_to="none", lora_r=4, lora_alpha=8, lora_target_modules="q_proj,v_proj,down_proj")
    trainer = Trainer(TrainConfig.from_flags(**{**base, **flags}))
    if said is not None:
        trainer._say = said.append
    trainer.setup()
    return trainer


def hand_logps(model, batch) -> torch.Tensor:
    """(2P,) each sequence's completion log-probability, by hand: plain transformers on the whole rows,
    log_softmax, the labels' terms summed per sequence_ids (batch_sequences' numbering)."""
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    logps = torch.log_softmax(logits.double(), dim=-1)
    scored = batch["sequence_ids"] >= 0
    terms = logps[scored].gather(1, batch["labels"][scored][:, None])[:, 0]
    return torch.zeros(batch["sequence_lengths"].numel(), dtype=terms.dtype).index_add(0, batch["sequence_ids"][scored],
                                                                                      terms)


def check_trainer_step(**flags):
    """One Trainer DPO step (gradient accumulation 2, batch 2) against plain transformers (+ peft) in
    one process on every dp rank's rows: the step's loss, TRL's reward margin and every trainable
    parameter's gradient. The reference model: the base model (LoRA: adapters off) or the initial
    weights (full fine-tune), computed here by hand."""
    from peft import LoraConfig, get_peft_model
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )
    from transformers import LlamaForCausalLM

    from llama_cp.modules.causal_lm import embedded_llama_config

    kind = flags.get("dpo_loss", "sigmoid")
    with shared_tmpdir() as root:
        if dist.get_rank() == 0:
            write_pair_file(os.path.join(root, "pairs.jsonl"))
        dist.barrier()
        trainer = trainer_for(root, **flags)
        lora = trainer.cfg.peft.use_peft
        if lora:  # random B: every adapter has a gradient, and the policy is not its reference
            g = torch.Generator().manual_seed(2)
            b = {n: torch.randn(p.shape, generator=g) * 0.1 for n, p in trainer.model.named_parameters() if "lora_B" in n}
            set_model_state_dict(trainer.model, b, options=StateDictOptions(full_state_dict=True, strict=False))
        state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False))
        if trainer.eval_batches is not None:  # before any step the policy is its reference, on every eval row
            evaluated = trainer.evaluate()
            assert evaluated["eval_loss"] == pytest.approx(math.log(2), abs=1e-6), evaluated
            assert evaluated["eval_rewards/margins"] == 0 and evaluated["eval_rewards/accuracies"] == 0, evaluated
        recorded = []
        to_device = trainer._to_device
        trainer._to_device = lambda batch: recorded.append(batch) or to_device(batch)
        trainer._iterator = iter(trainer.loader)
        micro = trainer._next_micro_batches()
        total, metrics = trainer.objective.forward_backward(micro)
        # the reference: every dp rank's rows (cp ranks of a dp rank hold the same)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (submesh(trainer.mesh, "dp").get_local_rank(), recorded))
        batches = [b for _, rows in sorted(dict(everyone).items()) for b in rows]
        base = LlamaForCausalLM(embedded_llama_config(attn_implementation="sdpa")).double()
        plain = {n.replace("base_model.model.", "").replace(".base_layer", ""): v for n, v in state.items()
                 if "lora_" not in n}
        base.load_state_dict(plain)
        if lora:
            policy = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM",
                                    target_modules=["q_proj", "v_proj", "down_proj"]))
            policy.load_state_dict({n: v.double() for n, v in state.items()}, strict=True)
        else:
            policy = copy.deepcopy(base)
        losses, margins, pairs = [], [], 0
        for batch in batches:
            chosen, rejected = hand_logps(policy, batch).view(-1, 2).unbind(1)
            lengths = batch["sequence_lengths"].double().view(-1, 2)
            if kind == "sigmoid":
                with torch.no_grad():
                    ref_chosen, ref_rejected = hand_logps(base, batch).view(-1, 2).unbind(1)
            else:
                ref_chosen = ref_rejected = None
            pair_losses = reference_losses(kind, chosen, rejected, ref_chosen, ref_rejected, lengths[:, 0], lengths[:, 1])
            losses.append(pair_losses)
            if kind == "sigmoid":
                margins.append(BETA * ((chosen - ref_chosen) - (rejected - ref_rejected)).detach())
            pairs += len(pair_losses)
        loss = torch.cat(losses).sum() / pairs
        loss.backward()
        assert pairs == sum(int(b["pair_count"].sum()) for b in batches) > 2 * len(batches)  # several pairs a row
        torch.testing.assert_close(total.item(), loss.item(), **TOLERANCE[torch.float32])
        if margins:
            torch.testing.assert_close(metrics["rewards/margins"], torch.cat(margins).mean().item(),
                                       **TOLERANCE[torch.float32])
        compared = 0
        reference = dict(policy.named_parameters())
        for name, param in trainer.model.named_parameters():
            if not param.requires_grad:
                continue
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            want = reference[name if lora else name.replace("base_model.model.", "")].grad
            torch.testing.assert_close(grad.double(), want, **TOLERANCE[torch.float32], msg=lambda m, name=name: f"{name}: {m}")
            compared += 1
        assert compared == (3 * 4 * 2 if lora else len(reference)), compared
        if kind == "sigmoid" and not lora:  # Note [Reference log-probabilities computed once]
            stored = list(Path(root, "cache").glob("*/reference/*-train.npz"))
            assert len(stored) == 1, stored
            said = []
            trainer_for(root, said, **flags, output_dir=os.path.join(root, "again"))
            assert any(f"read from {stored[0]}" in line for line in said), said


@checks.add
def trainer_lora_dpo_cp2_ring_is_transformers_peft_with_adapters_off_as_reference():
    check_trainer_step(use_peft=True, cp=2, cp_strategy="ring")


@checks.add
def trainer_full_dpo_ulysses_cp2_stores_and_reads_the_reference():
    check_trainer_step(cp=2, cp_strategy="ulysses")


@checks.add
def trainer_full_simpo_allgather_cp2():
    check_trainer_step(cp=2, cp_strategy="allgather", dpo_loss="simpo")


@checks.add
def trainer_full_dpo_dp_shard2_gathers_the_reference_over_dp():
    """Also the eval rows' reference: each dp rank evaluates its own share of them."""
    check_trainer_step(dp_shard=2, eval_fraction=0.4, num_eval_samples=4)


@checks.add
def trainer_lora_dpo_in_bf16_keeps_the_adapters_trainable():
    """Note [Switching adapters off under FSDP2]: the reference pass of a bf16 (mixed-precision) LoRA
    step leaves every adapter trainable, and the step's backward gives their float32 gradients
    (peft's disable_adapter toggled requires_grad, and the backward failed on a bf16 gradient)."""
    with shared_tmpdir() as root:
        if dist.get_rank() == 0:
            write_pair_file(os.path.join(root, "pairs.jsonl"))
        dist.barrier()
        trainer = trainer_for(root, use_peft=True, cp=2, dtype="bfloat16")
        trainable = [name for name, param in trainer.model.named_parameters() if param.requires_grad]
        trainer._iterator = iter(trainer.loader)
        total, metrics = trainer.objective.forward_backward(trainer._next_micro_batches())
        assert math.isfinite(total.item()) and metrics["rewards/margins"] == pytest.approx(0, abs=0.05)
        assert [name for name, param in trainer.model.named_parameters() if param.requires_grad] == trainable
        grads = [param.grad for param in trainer.model.parameters() if param.requires_grad]
        assert len(grads) == 3 * 4 * 2 and all(g is not None and g.dtype == torch.float32 for g in grads)
        assert all(bool(torch.isfinite(g.full_tensor()).all()) for g in grads)


@checks.add
def trainer_lora_orpo_ring_cp2():
    check_trainer_step(use_peft=True, cp=2, dpo_loss="orpo")


results = checks.module_fixture(__name__, WORLD_SIZE)


@pytest.mark.parametrize("name", checks.names)
def test_check(results, name):
    checks.assert_passed(results, name)
