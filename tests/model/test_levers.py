"""The long-context levers in one process: tiled MLP / norms against the untiled modules,
checkpoint-input offload against plain checkpointing (bit-identical), the automatic loss
chunk, and the config errors. The sharded (FSDP2 + CP) checks are in test_levers_world2.py,
the memory checks in tests/plan/."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_checks import global_batch, tiny_model
from llama_cp.attention import kernels
from llama_cp.config import TrainConfig
from llama_cp.fsdp_wrap import apply_activation_checkpointing, apply_checkpoint_offload
from llama_cp.model.loss import auto_loss_chunk_size, causal_lm_loss_sum, enable_chunked_loss
from llama_cp.modules.causal_lm import decoder_layers
from llama_cp.modules.tiling import apply_tiled_mlp, apply_tiled_norms, norm_modules

FP32 = dict(atol=1e-5, rtol=1e-5)
FP64 = dict(atol=1e-10, rtol=1e-10)
MLP_AND_ATTENTION = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]


def lora(model, targets=MLP_AND_ATTENTION):
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM"))
    for name, param in model.named_parameters():  # B starts at zero: give every adapter a gradient path
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    return model


def loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = causal_lm_loss_sum(model, batch) / int((batch["labels"] != -100).sum())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


class LargestIntermediate(TorchDispatchMode):
    """The most rows of any activation (not parameter-shaped: weight gradients) whose last
    dimension is the MLP's intermediate size."""

    def __init__(self, model):
        super().__init__()
        self.width, self.rows = model.config.intermediate_size, 0
        self.weights = {tuple(p.shape) for p in model.parameters()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (isinstance(out, torch.Tensor) and out.dim() and out.shape[-1] == self.width
                and tuple(out.shape) not in self.weights and tuple(out.shape[::-1]) not in self.weights):
            self.rows = max(self.rows, out.numel() // self.width)
        return out


@pytest.mark.slow
@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32), (torch.float64, FP64)])
@pytest.mark.parametrize("tuning", ["full", "lora"])
def test_tiled_mlp_and_norms_give_the_untiled_gradients(dtype, tol, tuning):
    reference = tiny_model().to(dtype)
    if tuning == "lora":
        reference = lora(reference)
    tiled = copy.deepcopy(reference)
    for model in (reference, tiled):
        enable_chunked_loss(model, chunk_size=7)
    apply_tiled_mlp(decoder_layers(tiled), tile_size=5)  # ragged: 32 tokens per row, 4 rows
    apply_tiled_norms(tiled, decoder_layers(tiled), tile_size=3)
    batch = global_batch()
    ref_loss, ref_grads = loss_and_grads(reference, batch)
    with LargestIntermediate(tiled) as largest:
        loss, grads = loss_and_grads(tiled, batch)
    assert largest.rows == 5  # the MLP's intermediates exist one tile at a time
    torch.testing.assert_close(loss, ref_loss, **tol)
    assert grads.keys() == ref_grads.keys() and grads
    if tuning == "lora":
        assert any("mlp" in name for name in grads)  # adapters on the MLP projections are trained through tiles
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], **tol, msg=lambda m: f"{name}: {m}")
    # eval (no grad) goes through the tiles too
    with torch.no_grad():
        torch.testing.assert_close(
            tiled(input_ids=batch["input_ids"]).logits, reference(input_ids=batch["input_ids"]).logits, **tol
        )


def test_tiled_norms_cover_every_decoder_norm_and_the_final_one():
    model = tiny_model()
    norms = norm_modules(model, decoder_layers(model))
    assert len(norms) == 2 * len(decoder_layers(model)) + 1 and norms[-1] is model.model.norm


def test_tiling_refuses_dropout_in_the_tiled_module():
    model = get_peft_model(tiny_model(), LoraConfig(r=4, lora_dropout=0.1, target_modules=["up_proj"],
                                                    task_type="CAUSAL_LM"))
    with pytest.raises(ValueError, match="--mlp_tile_size.*--lora_dropout 0"):
        apply_tiled_mlp(decoder_layers(model), tile_size=8)


@pytest.mark.parametrize("tuning", ["full", "lora"])
def test_offloaded_checkpoints_give_bit_identical_gradients(tuning):
    reference = tiny_model(num_hidden_layers=3)
    if tuning == "lora":
        reference = lora(reference, ["q_proj", "o_proj"])
    offloaded = copy.deepcopy(reference)
    for model in (reference, offloaded):
        enable_chunked_loss(model, chunk_size=7)
        apply_activation_checkpointing(model)
        model.train()
    offloader = apply_checkpoint_offload(offloaded)
    batch = global_batch()
    packed = []
    pack = offloader.pack
    # (transformers 4.x also hands each layer an empty tensor, which has no bytes to offload)
    offloader.pack = lambda tensor: (tensor.numel() and packed.append(tensor.shape)) or pack(tensor)
    ref_loss, ref_grads = loss_and_grads(reference, batch)
    loss, grads = loss_and_grads(offloaded, batch)
    assert torch.equal(loss, ref_loss) and grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, ref_grads[name]), name
    # exactly one tensor per layer went to host memory: the layer's input, (batch, seq, hidden)
    hidden = reference.config.hidden_size
    assert packed == [torch.Size([*batch["input_ids"].shape, hidden])] * 3, packed
    assert offloader.peak_host_bytes == 3 * batch["input_ids"].numel() * hidden * 4
    assert offloader.host_bytes == 0  # all brought back and released by the end of backward


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offloading_an_empty_tensor_brings_it_back(dtype):
    from llama_cp.modules.offload import CheckpointOffloader

    offloader = CheckpointOffloader()
    for tensor in (torch.empty(0, 3, dtype=dtype), torch.arange(6, dtype=dtype).view(2, 3)):
        back = offloader.unpack(offloader.pack(tensor))
        assert back.dtype == dtype and torch.equal(back, tensor)
    assert offloader.host_bytes == 0


def test_auto_loss_chunk_bounds_the_fp32_logits():
    assert auto_loss_chunk_size(128256) == 512  # Llama 3: 250 MiB of fp32 logits, not 2 GiB at 4096
    assert auto_loss_chunk_size(32000) == 2048
    assert auto_loss_chunk_size(1024) == 4096  # small vocabularies keep the old 4096
    for vocab in (1024, 32000, 128256, 152064, 256000):
        assert auto_loss_chunk_size(vocab) * vocab * 4 <= 256 << 20
    model = enable_chunked_loss(tiny_model(), chunk_size=TrainConfig().model.loss_chunk_size)
    assert TrainConfig().model.loss_chunk_size == 0 and model.lm_head.loss_chunk_size == 4096


def test_lever_flags_are_checked():
    with pytest.raises(ValueError, match="--offload_checkpoints.*add --activation_checkpointing"):
        TrainConfig.from_flags(offload_checkpoints=True)
    with pytest.raises(ValueError, match="--frozen_dtype bfloat16.*--use_peft"):
        TrainConfig.from_flags(frozen_dtype="bfloat16")
    with pytest.raises(ValueError, match="--mlp_tile_size must be >= 0"):
        TrainConfig.from_flags(mlp_tile_size=-1)
    with pytest.raises(ValueError, match="--attention_block_size must be >= 0, got -1"):
        TrainConfig.from_flags(attention_block_size=-1)
    with pytest.raises(ValueError, match="--frozen_dtype must be one of"):
        TrainConfig.from_flags(frozen_dtype="int8")


def packed(batch):
    """``batch`` with position_ids restarting: rows of 2 to 4 packed documents."""
    position_ids = torch.arange(batch["input_ids"].shape[1]).repeat(batch["input_ids"].shape[0], 1)
    for row, cuts in enumerate(([7], [1, 20], [12, 13, 30], [16])):
        for cut in cuts:
            position_ids[row, cut:] -= int(position_ids[row, cut])
    return {**batch, "position_ids": position_ids}


@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32), (torch.float64, FP64)])
@pytest.mark.parametrize("documents", [False, True])
def test_tiled_attention_gives_the_untiled_loss_and_gradients(dtype, tol, documents):
    """--attention_block_size 5 (ragged: 32 tokens per row) against 0: same loss and gradients
    (Note [Tiled attention]), for one causal sequence and packed documents."""
    from llama_cp.cp_attention import apply_context_parallel

    reference = tiny_model().to(dtype)
    tiled = copy.deepcopy(reference)
    for model, block_size in ((reference, 0), (tiled, 5)):
        apply_context_parallel(model, None, block_size=block_size)
        enable_chunked_loss(model, chunk_size=7)
    batch = packed(global_batch()) if documents else global_batch()
    ref_loss, ref_grads = loss_and_grads(reference, batch)
    calls = []
    original = kernels.attention_forward
    kernels.attention_forward = lambda q, k, *args, **kw: calls.append((q.shape[2], k.shape[2])) or original(
        q, k, *args, **kw)
    try:
        loss, grads = loss_and_grads(tiled, batch)
    finally:
        kernels.attention_forward = original
    assert max(max(c) for c in calls) == 5  # every kernel call is one tile
    torch.testing.assert_close(loss, ref_loss, **tol)
    assert grads.keys() == ref_grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], **tol, msg=lambda m: f"{name}: {m}")


def test_tiled_attention_cuts_the_measured_peak():
    """Measured on CPU with torch's MemTracker, forward + backward of a 2-layer model at 512
    tokens with the math kernel (whose per-call workspace is the (Sq, Sk) float32 score
    matrices; torch's CPU flash kernel keeps its own workspace out of sight): blocks of 64
    tokens lower the peak by at least the four (512, 512) matrices that one untiled backward
    call holds at once (scores, probabilities, their gradient and the score gradient being
    formed), less those of one 64 x 64 tile. Measured: 22,879,144 B untiled, 2,724,648 B tiled."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from llama_cp.cp_attention import apply_context_parallel

    batch_rows, heads, tokens, block = 1, 4, 512, 64

    def peak(block_size):
        model = tiny_model(num_attention_heads=heads, num_key_value_heads=1)
        apply_context_parallel(model, None, backend="math", block_size=block_size)
        enable_chunked_loss(model, chunk_size=128)
        ids = torch.randint(0, 96, (batch_rows, tokens), generator=torch.Generator().manual_seed(0))
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            causal_lm_loss_sum(model, {"input_ids": ids, "labels": ids}).backward()
        return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]

    untiled, tiled = peak(0), peak(block)
    per_matrix = batch_rows * heads * tokens * tokens * 4
    per_tile = batch_rows * heads * block * block * 4
    print(f"attention peak: untiled {untiled} B, block {block}: {tiled} B")
    assert untiled - tiled >= 4 * (per_matrix - per_tile), (untiled, tiled)
