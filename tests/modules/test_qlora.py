"""QLoRA (--quantization 4bit) on 2 CPU ranks (gloo): FSDP2 + CP against the single-process
bitsandbytes + peft model.

The reference is what a transformers user gets: ``from_pretrained`` with a
``BitsAndBytesConfig`` (NF4, bf16 quant storage, fp32 compute) and peft's LoRA on top. Our
path quantizes the same full-precision weights itself (llama_cp.modules.quantize), so the NF4 codes
and block maxima must be bit-identical, and loss and LoRA gradients equal to 1e-5.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import distribute_tensor

from dist_harness import Checks, shared_tmpdir
from fsdp_checks import FP32_CLOSE, SEQ_LEN, full_grad, full_param, global_batch, reference_loss, sharded_step, tiny_model

from llama_cp.modules.quantize import installed_qlora_refusal

# Where QLoRA is refused (Note [QLoRA's version floor]; tests/test_config.py tests the refusal),
# none of these can run.
pytestmark = pytest.mark.skipif(installed_qlora_refusal() is not None, reason=str(installed_qlora_refusal()))

WORLD_SIZE = 2
LORA = dict(lora_r=4, lora_alpha=8, lora_target_modules="q_proj,v_proj,down_proj")
checks = Checks()


def save_tiny_model(path: str) -> None:
    if dist.get_rank() == 0:
        tiny_model().save_pretrained(path)
    dist.barrier()


def bnb_model(path: str):
    """The single-process transformers + bitsandbytes 4-bit model of the checkpoint at ``path``."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_quant_storage=torch.bfloat16,
        bnb_4bit_compute_dtype=torch.float32,
    )
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization, dtype=torch.float32,
                                                 device_map="cpu", attn_implementation="sdpa")
    # train mode: in eval mode without gradients, bitsandbytes on an AVX512-BF16 CPU repacks the
    # weights for a bf16 kernel, which is not the fp32 computation compared here
    return model.train()


def bnb_lora_reference(path: str):
    """bitsandbytes 4-bit + peft LoRA, every adapter weight set from one seed (the same on every
    rank), lora_B non-zero so that every adapter weight gets a gradient."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(bnb_model(path), LoraConfig(
        r=LORA["lora_r"], lora_alpha=LORA["lora_alpha"], target_modules=LORA["lora_target_modules"].split(","),
        task_type="CAUSAL_LM",
    ))
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return model


def qlora_config(**flags):
    from llama_cp.config import TrainConfig

    return TrainConfig.from_flags(use_peft=True, quantization="4bit", context_length=SEQ_LEN, loss_chunk_size=7,
                                  **{**LORA, **flags})


def build_qlora(cfg, model):
    from llama_cp.model.build import parallelize_model
    from llama_cp.parallel.mesh import ParallelDims

    p = cfg.parallel
    mesh = ParallelDims(dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, cp=p.cp).build_mesh("cpu")
    return parallelize_model(model, cfg, mesh), mesh


def copy_trainable(model, reference) -> None:
    """The reference's adapter values into the sharded model (same peft parameter names)."""
    want = dict(reference.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.copy_(distribute_tensor(want[name].detach(), param.device_mesh, param.placements))


def assert_codes_equal(model, reference) -> None:
    """Every NF4 layer's gathered codes and block maxima are bitsandbytes' own, bit for bit."""
    from llama_cp.modules.quantize import quantized_linears

    layers = quantized_linears(model)
    assert len(layers) == 2 * 7, sorted(layers)  # q, k, v, o, gate, up, down per decoder layer
    for name, layer in layers.items():
        if not hasattr(reference, "peft_config"):  # a plain model: its names without peft's wrappers
            name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        ref = reference.get_submodule(name)
        torch.testing.assert_close(full_param(layer.weight).flatten(), ref.weight.data.view(torch.uint8).flatten(),
                                   rtol=0, atol=0, msg=lambda m: f"{name} codes: {m}")
        torch.testing.assert_close(full_param(layer.absmax).view(torch.float32), ref.weight.quant_state.absmax,
                                   rtol=0, atol=0, msg=lambda m: f"{name} absmax: {m}")


def assert_lora_grads_equal(model, reference) -> None:
    want = {name: p for name, p in reference.named_parameters() if p.requires_grad}
    got = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert got.keys() == want.keys() and all("lora_" in name for name in got), sorted(got.keys() ^ want.keys())
    for name, param in got.items():
        torch.testing.assert_close(full_grad(param), want[name].grad, **FP32_CLOSE, msg=lambda m: f"{name}: {m}")
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    assert not frozen, frozen


def check_one_step(export: bool = False, **flags) -> None:
    """Loss and every LoRA gradient of one step equal the bitsandbytes + peft model's; with
    ``export``, an AdamW step on both, then the exported adapter loads into a fresh single-process
    bitsandbytes model and gives the reference's logits."""
    with shared_tmpdir() as path:
        save_tiny_model(path)
        reference = bnb_lora_reference(path)
        model, mesh = build_qlora(qlora_config(**flags), tiny_model())
        copy_trainable(model, reference)
        assert_codes_equal(model, reference)
        assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
        batch = global_batch()
        ref_loss = reference_loss(reference, batch)
        ref_loss.backward()
        loss = sharded_step(model, batch, mesh)
        torch.testing.assert_close(loss, ref_loss.detach(), **FP32_CLOSE)
        assert_lora_grads_equal(model, reference)
        if export:
            check_export(model, reference, os.path.join(path, "final"))


def check_export(model, reference, final: str) -> None:
    from peft import PeftModel

    from llama_cp.train.export import export_pretrained

    for m in (model, reference):
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
        opt.step()
    export_pretrained(model, final)
    if dist.get_rank() == 0:
        assert sorted(os.listdir(final)) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
        reloaded = PeftModel.from_pretrained(bnb_model(os.path.dirname(final)), final).train()  # see bnb_model
        input_ids = global_batch()["input_ids"]
        with torch.no_grad():
            want = reference(input_ids=input_ids).logits
            got = reloaded(input_ids=input_ids).logits
            with reloaded.disable_adapter():
                base = reloaded(input_ids=input_ids).logits
        torch.testing.assert_close(got, want, **FP32_CLOSE)
        assert (got - base).abs().max() > 1e-3, "the adapter did not change the model"


for _name, _flags in (
    ("cp2_ring", dict(cp=2, cp_strategy="ring")),
    ("cp2_ulysses", dict(cp=2, cp_strategy="ulysses")),
    ("dp_shard2", dict(dp_shard=2, cp=1)),
    ("cp2_ring_activation_checkpointing", dict(cp=2, activation_checkpointing=True)),
):
    checks.add(functools.partial(check_one_step, **_flags), name=f"one_step_{_name}")
checks.add(functools.partial(check_one_step, export=True, cp=2), name="adapter_export_reloads_into_bnb_peft")


@checks.add
def meta_build_loads_and_quantizes_the_checkpoint():
    """The path of real checkpoints: built on the meta device, sharded, then rank 0 quantizes the
    safetensors as they are loaded; the codes and logits are bitsandbytes' own."""
    from llama_cp.fsdp_wrap import load_full_weights
    from llama_cp.modules.causal_lm import build_causal_lm
    from llama_cp.parallel.sharding import shard_batch, unshard
    from fsdp_checks import tiny_config

    with shared_tmpdir() as path:
        save_tiny_model(path)
        reference = bnb_model(path)
        model, mesh = build_qlora(qlora_config(cp=2), build_causal_lm(tiny_config(), device="meta"))
        load_full_weights(model, path, device="cpu")
        assert_codes_equal(model, reference)
        batch = global_batch()
        local = shard_batch(batch, mesh["cp"])
        with torch.no_grad():
            logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
            want = reference(input_ids=batch["input_ids"]).logits  # lora_B starts at zero: the base model
        torch.testing.assert_close(unshard(logits, mesh["cp"]), want, **FP32_CLOSE)


@checks.add
def trainer_trains_exports_and_resumes():
    """`--use_peft --quantization 4bit --cp 2` through Trainer.fit on the embedded model: the loss
    goes down, final/ holds the adapter, and a resume from the step-4 checkpoint (adapters and
    optimizer only; the NF4 base is rebuilt) repeats steps 5-8."""
    import json

    from llama_cp import Trainer, TrainConfig
    from llama_cp.modules.quantize import quantized_linears
    from llama_cp.train.checkpoint_files import checkpoint_dir

    def losses(output_dir):
        with open(os.path.join(output_dir, "metrics.jsonl")) as f:
            return [json.loads(line)["loss"] for line in f]

    with shared_tmpdir() as path:
        flags = dict(
            use_peft=True, quantization="4bit", cp=2, context_length=256, num_passkey_samples=16, num_eval_samples=2,
            max_steps=8, log_every=1, warmup_steps=1, lr=1e-2, save_every=4, output_dir=os.path.join(path, "run"),
        )
        cfg = TrainConfig.from_flags(**flags)
        trainer = Trainer(cfg)
        trainer.fit()
        assert len(quantized_linears(trainer.model)) == 4 * 7
        first = losses(cfg.output_dir)
        assert len(first) == 8 and sum(first[-3:]) < sum(first[:3]), first
        assert os.path.exists(os.path.join(cfg.output_dir, "final", "adapter_model.safetensors"))
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(checkpoint_dir(cfg.output_dir, 8))  # as if the run had stopped after step 4
        dist.barrier()
        Trainer(TrainConfig.from_flags(**flags, resume="true")).fit()
        torch.testing.assert_close(torch.tensor(losses(cfg.output_dir)), torch.tensor(first), rtol=1e-6, atol=1e-7)


results = checks.module_fixture(__name__, WORLD_SIZE)


@pytest.mark.parametrize("name", checks.names)
def test_check(results, name):
    checks.assert_passed(results, name)


def test_quantization_needs_use_peft():
    from llama_cp.config import TrainConfig

    with pytest.raises(ValueError, match="--quantization 4bit freezes the base weights.*add --use_peft"):
        TrainConfig.from_flags(quantization="4bit")


def test_quantize_after_peft_is_refused():
    from peft import LoraConfig, get_peft_model

    from llama_cp.modules.quantize import quantize_model

    with pytest.raises(ValueError, match="before adding LoRA adapters"):
        quantize_model(get_peft_model(tiny_model(), LoraConfig(target_modules=["q_proj"])))


def test_fake_tensors_see_what_a_real_nf4_layer_allocates():
    """The planner's premise for NF4 layers: under fake tensors (bitsandbytes' fake kernels) the
    forward and backward of an NF4Linear allocate exactly what they allocate for real, the
    dequantized [out, in] weight included."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from llama_cp.modules.quantize import NF4Linear, _NF4Linear
    from llama_cp.plan.memory import track_peak_memory

    def peak(fake: bool) -> int:
        with FakeTensorMode() if fake else contextlib.nullcontext():
            layer = NF4Linear(256, 96) if fake else NF4Linear.from_linear(torch.nn.Linear(256, 96, bias=False))
            x = torch.ones(3, 256, requires_grad=True)
            # the autograd function itself: MemTracker's module hooks expect trainable parameters
            with track_peak_memory() as result:
                _NF4Linear.apply(x, layer.weight, layer.absmax, None, (96, 256)).sum().backward()
        return result["Total"]

    real, fake = peak(False), peak(True)
    assert real == fake, (real, fake)
    assert real >= 96 * 256 * 4, real  # the fp32 dequantized weight is in the peak


def test_a_prequantized_checkpoint_is_refused():
    from llama_cp.fsdp_wrap import _checkpoint_key
    from llama_cp.modules.quantize import quantize_checkpoint, quantize_model

    model = quantize_model(tiny_model())
    checkpoint = tiny_model().state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    checkpoint[name] = torch.zeros(checkpoint[name].numel() // 2, 1, dtype=torch.uint8)  # packed 4-bit codes
    with pytest.raises(ValueError, match="point --model_name at the full-precision checkpoint"):
        quantize_checkpoint(model, checkpoint, _checkpoint_key)


def test_biased_linears_match_bitsandbytes(tmp_path):
    """Linear layers with a bias (Qwen2's q/k/v): one process, loss and LoRA gradients equal the
    bitsandbytes + peft model's."""
    from peft import LoraConfig, get_peft_model

    from llama_cp.modules.quantize import quantize_model

    biased = dict(attention_bias=True, mlp_bias=True)
    tiny_model(**biased).save_pretrained(tmp_path)
    lora = LoraConfig(r=4, target_modules=["q_proj", "down_proj"])
    reference = get_peft_model(bnb_model(str(tmp_path)), lora)
    model = get_peft_model(quantize_model(tiny_model(**biased)), lora)
    want = dict(reference.named_parameters())
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                value = torch.randn(param.shape, generator=generator) * 0.02
                param.copy_(value)
                want[name].copy_(value)
    ref_loss, loss = reference_loss(reference, global_batch()), reference_loss(model, global_batch())
    ref_loss.backward()
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, **FP32_CLOSE)
    for name, param in model.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(param.grad, want[name].grad, **FP32_CLOSE, msg=lambda m: f"{name}: {m}")
