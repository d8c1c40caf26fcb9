"""The optimizer's param groups (Note [Which parameters decay]) and the schedule's weight decay
per group; ``ShardLocalOptimizer`` (``--optimizer adamw8bit``) alone, on plain tensors: what
bitsandbytes is given. The FSDP2 case (LoRA A with fewer rows than ranks) is checked in
test_fsdp.py, the groups through a sharded resume in tests/train/test_checkpoint.py."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from fsdp_checks import tiny_model
from llama_cp.config import OptimConfig
from llama_cp.optim.optimizers import DECAYS, ShardLocalOptimizer, build_optimizer
from llama_cp.optim.schedule import start_schedule

from probes import bnb_cpu_optimizer_problem


def _bnb():
    bnb = pytest.importorskip("bitsandbytes")
    if bnb_cpu_optimizer_problem():
        pytest.skip(bnb_cpu_optimizer_problem())
    return bnb


def _groups(model, optimizer) -> list[tuple[bool, float, set[str]]]:
    """(decays, weight_decay, the names of its parameters) of every param group, a name as its last
    two parts without .weight and peft's .default: self_attn.q_proj, q_proj.bias, q_proj.lora_A."""
    names = {id(p): ".".join(n.removesuffix(".weight").removesuffix(".default").split(".")[-2:])
             for n, p in model.named_parameters()}
    return [(g[DECAYS], g["weight_decay"], {names[id(p)] for p in g["params"]}) for g in optimizer.param_groups]


def test_norms_biases_and_embeddings_do_not_decay():
    model = tiny_model(num_hidden_layers=1, attention_bias=True)
    optimizer = build_optimizer("adamw", model, lr=0.1, weight_decay=0.5)
    projections = {f"{part}.{name}_proj" for part, names in (("self_attn", "qkvo"), ("mlp", ("gate", "up", "down")))
                   for name in names}
    biases = {f"{name}_proj.bias" for name in "qkvo"}
    assert _groups(model, optimizer) == [
        (True, 0.5, projections | {"lm_head"}),
        (False, 0.0, {"model.embed_tokens", "0.input_layernorm", "0.post_attention_layernorm", "model.norm"} | biases),
    ]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # zero gradients: the step is the decay alone, p *= 1 - lr * weight_decay
    for name, param in model.named_parameters():
        decays = param.ndim == 2 and "embed_tokens" not in name
        torch.testing.assert_close(param, before[name] * (0.95 if decays else 1.0), msg=lambda m: f"{name}: {m}")

    tied = tiny_model(num_hidden_layers=1, tie_word_embeddings=True)  # lm_head is the embedding: no decay
    assert "lm_head" not in _groups(tied, build_optimizer("adamw", tied, lr=0.1, weight_decay=0.5))[0][2]


def test_lora_dora_and_copies_decay_as_what_they_are():
    """A and B decay; DoRA's magnitudes (one per row) and the copies of the embedding and the norms
    do not; the copy of an untied lm_head does; frozen weights are in no group."""
    model = get_peft_model(tiny_model(num_hidden_layers=1), LoraConfig(
        r=2, target_modules=["q_proj", "down_proj"], use_dora=True, task_type="CAUSAL_LM",
        modules_to_save=["embed_tokens", "norm", "lm_head"]))
    optimizer = build_optimizer("adamw", model, lr=0.1, weight_decay=0.5)
    adapters = {f"{layer}.{kind}" for layer in ("q_proj", "down_proj") for kind in ("lora_A", "lora_B")}
    copies = {f"{name}.modules_to_save" for name in ("embed_tokens", "input_layernorm", "post_attention_layernorm", "norm")}
    assert _groups(model, optimizer) == [
        (True, 0.5, adapters | {"lm_head.modules_to_save"}),
        (False, 0.0, {"q_proj.lora_magnitude_vector", "down_proj.lora_magnitude_vector"} | copies),
    ]
    assert sum(len(g["params"]) for g in optimizer.param_groups) == sum(p.requires_grad for p in model.parameters())


def test_a_restarted_schedule_writes_weight_decay_into_the_decaying_group_only():
    """--weight_decay changed on resume (Note [Changing settings on resume]) reaches the decaying
    group; the norms and embeddings stay at 0."""
    model = tiny_model(num_hidden_layers=1)
    optimizer = build_optimizer("adamw", model, lr=0.1, weight_decay=0.0)
    start_schedule(optimizer, OptimConfig(lr=0.1, weight_decay=0.25, warmup_steps=0), total_steps=10, step=3)
    assert [(g[DECAYS], g["weight_decay"]) for g in optimizer.param_groups] == [(True, 0.25), (False, 0.0)]


def test_shard_local_optimizer_steps_each_group_with_its_options():
    """adamw8bit on the trainer's two groups: each group's shards stepped with its own weight decay,
    as bitsandbytes steps the same groups; a group whose shards are all empty here is left out."""
    bnb = _bnb()
    matrix, gain = nn.Parameter(torch.linspace(-1, 1, 16).reshape(2, 8)), nn.Parameter(torch.linspace(1, 2, 8))
    empty = nn.Parameter(torch.zeros(0, 8))
    references = [nn.Parameter(p.detach().clone()) for p in (matrix, gain)]
    groups = [{"params": [matrix], "weight_decay": 0.5, DECAYS: True},
              {"params": [gain], "weight_decay": 0.0, DECAYS: False},
              {"params": [empty], "weight_decay": 0.5, DECAYS: True}]
    optimizer = ShardLocalOptimizer(groups, bnb.optim.AdamW8bit, lr=0.1)
    ref_optimizer = bnb.optim.AdamW8bit([{"params": [references[0]], "weight_decay": 0.5},
                                         {"params": [references[1]], "weight_decay": 0.0}], lr=0.1)
    assert [(g[DECAYS], g["weight_decay"], [p.shape for p in g["params"]]) for g in optimizer.param_groups] == [
        (True, 0.5, [(2, 8)]), (False, 0.0, [(8,)])]
    for step in range(2):
        for param, reference in zip((matrix, gain), references, strict=True):
            param.grad = reference.grad = torch.full(param.shape, 0.5 - step)
        empty.grad = torch.zeros(0, 8)
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
    for param, reference in zip((matrix, gain), references, strict=True):
        torch.testing.assert_close(param, reference, rtol=0, atol=0)


def test_empty_shards_never_reach_bitsandbytes():
    bnb = _bnb()
    empty, rows = nn.Parameter(torch.zeros(0, 8)), nn.Parameter(torch.linspace(-1, 1, 16).reshape(2, 8))
    reference = nn.Parameter(rows.detach().clone())
    optimizer = ShardLocalOptimizer([empty, rows], bnb.optim.AdamW8bit, lr=0.1, weight_decay=0.1)
    ref_optimizer = bnb.optim.AdamW8bit([reference], lr=0.1, weight_decay=0.1)
    assert [p.shape for group in optimizer.param_groups for p in group["params"]] == [(2, 8)]
    updated = []
    inner_update = optimizer.inner.update_step
    optimizer.inner.update_step = lambda group, p, *index: (updated.append(p.shape), inner_update(group, p, *index))
    for step in range(2):
        empty.grad = torch.zeros(0, 8)
        rows.grad = reference.grad = torch.full((2, 8), 0.5 - step)
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        assert empty.grad is None and rows.grad is None
    assert updated == [(2, 8), (2, 8)]
    torch.testing.assert_close(rows, reference, rtol=0, atol=0)


def test_a_rank_that_owns_no_element_keeps_a_schedule_and_an_empty_state():
    bnb = _bnb()
    empty = nn.Parameter(torch.zeros(0, 8))
    optimizer = ShardLocalOptimizer([empty], bnb.optim.AdamW8bit, lr=0.1, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))
    empty.grad = torch.zeros(0, 8)
    optimizer.step()
    scheduler.step()
    assert optimizer.inner is None and optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    again = ShardLocalOptimizer([nn.Parameter(torch.zeros(0, 8))], bnb.optim.AdamW8bit, lr=0.1, weight_decay=0.0)
    again.load_state_dict(optimizer.state_dict())
    assert again.param_groups[0]["lr"] == pytest.approx(0.05) and not again.state


def test_the_trainer_steps_host_shards_with_fused_adamw():
    """--offload_params: the trainer's AdamW is torch's fused one (one vectorised kernel on the
    host's shards), foreach otherwise (Note [AdamW's implementation, pinned])."""
    from types import SimpleNamespace

    from llama_cp.config import TrainConfig
    from llama_cp.train.trainer import Trainer

    for offload, fused, foreach in [(False, None, True), (True, True, None)]:
        trainer = SimpleNamespace(cfg=TrainConfig.from_flags(offload_params=offload), model=tiny_model(num_hidden_layers=1))
        optimizer = Trainer._build_optimizer(trainer)
        assert (optimizer.defaults["fused"], optimizer.defaults["foreach"]) == (fused, foreach), offload
