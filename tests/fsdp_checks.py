"""FSDP2 + CP checks shared by the world-4 and world-2 test modules.

Every check builds a single-process reference on each rank (same seed, same
global batch) and compares the sharded run with it.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import LlamaConfig, LlamaForCausalLM

from llama_cp import ParallelDims, apply_context_parallel, shard_batch
from llama_cp.fsdp_wrap import shard_model
from llama_cp.model.loss import causal_lm_loss_sum, count_valid_tokens, enable_chunked_loss, router_loss_share
from llama_cp.optim.step import forward_backward
from llama_cp.parallel.sharding import SEQ_INDEX, unshard

VOCAB, SEQ_LEN, GLOBAL_BATCH = 96, 32, 4
FP32_CLOSE = dict(atol=1e-5, rtol=1e-5)


def tiny_config(**overrides) -> LlamaConfig:
    return LlamaConfig(**{
        **dict(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
            attn_implementation="sdpa",
        ),
        **overrides,
    })


#: The shapes of :func:`tiny_config` that every family's config takes.
_TINY_SHAPES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "tie_word_embeddings")


def tiny_config_as(model_type: str, shapes: dict | None = None, **fields):
    """:func:`tiny_config` (with ``shapes`` overrides) as a config of ``model_type``, plus its ``fields``."""
    from transformers import AutoConfig

    base = tiny_config(**(shapes or {}))
    shapes = {key: getattr(base, key) for key in _TINY_SHAPES}
    return AutoConfig.for_model(model_type, **shapes, attn_implementation=base._attn_implementation, **fields)


def tiny_model(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config(**overrides))


def global_batch(step: int = 0, batch_size: int = GLOBAL_BATCH) -> dict[str, torch.Tensor]:
    """input_ids and pre-shifted labels; sample i ignores its first 3 + 5 i labels (unequal counts)."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1), generator=g)
    labels = tokens[:, 1:].clone()
    for i in range(batch_size):
        labels[i, : 3 + 5 * i] = -100
    return {"input_ids": tokens[:, :-1], "labels": labels}


def reference_loss(model, batch) -> torch.Tensor:
    """Single process: mean CE over all valid tokens of the global batch, from full logits."""
    logits = model(input_ids=batch["input_ids"]).logits
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


def build(dims: ParallelDims, model, strategy="ring", **shard_options):
    mesh = dims.build_mesh("cpu")
    apply_context_parallel(model, mesh["cp"], strategy=strategy)
    enable_chunked_loss(model, chunk_size=7)  # several chunks with a ragged last one
    shard_model(model, mesh, **shard_options)
    return model, mesh


def local_batches(batch, mesh, micro_batches: int = 1, shard=shard_batch):
    """This rank's rows (by dp rank), split into micro-batches, each sharded over cp by ``shard``."""
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    rows = {k: v.chunk(dp)[dp_rank] for k, v in batch.items()}
    micro = [{k: v.chunk(micro_batches)[i] for k, v in rows.items()} for i in range(micro_batches)]
    return [shard(m, mesh["cp"]) for m in micro]


def sharded_step(model, batch, mesh, micro_batches: int = 1, offload: bool = False) -> torch.Tensor:
    """Forward+backward of one optimizer step; returns the global mean loss (all-reduced)."""
    micro = local_batches(batch, mesh, micro_batches)
    total = forward_backward(model, micro, count_valid_tokens(m["labels"] for m in micro), offload=offload)
    dist.all_reduce(total)
    return total


def full_grad(param) -> torch.Tensor:
    grad = param.grad
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def full_param(param) -> torch.Tensor:
    return param.full_tensor() if isinstance(param, DTensor) else param.detach()


def assert_grads_equal(model, reference, **tol):
    for (name, param), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        if ref.grad is None:
            assert param.grad is None, f"{name} has a gradient but should be frozen"
            continue
        torch.testing.assert_close(full_grad(param), ref.grad, **(tol or FP32_CLOSE), msg=lambda m: f"{name}: {m}")


def step_both(
    dims_kwargs: dict, strategy: str = "ring", micro_batches: int = 1, offload: bool = False, **shard_options
):
    """One forward+backward of the same global batch on a single-process reference and on a
    sharded copy of it. Returns (model, reference, loss, reference loss)."""
    reference = tiny_model()
    model, mesh = build(ParallelDims(**dims_kwargs), copy.deepcopy(reference), strategy, **shard_options)
    batch = global_batch()
    ref_loss = reference_loss(reference, batch)
    ref_loss.backward()
    loss = sharded_step(model, batch, mesh, micro_batches=micro_batches, offload=offload)
    return model, reference, loss, ref_loss.detach()


def check_one_step(dims_kwargs: dict, strategy: str = "ring", offload: bool = False, **shard_options):
    """Loss and every parameter gradient of one step equal the single-process values."""
    model, reference, loss, ref_loss = step_both(dims_kwargs, strategy, offload=offload, **shard_options)
    torch.testing.assert_close(loss, ref_loss, **FP32_CLOSE)
    assert_grads_equal(model, reference)


def check_cp_against_reference(model, reference, data, ref_logits, ref_loss, mesh, *, strategy: str, sharded: bool,
                               tol: dict, max_seq_len: int, shard=None, block_size: int = 0,
                               ulysses_degree: int = 0, param_dtype: torch.dtype | None = None) -> None:
    """Make ``model`` (a copy of ``reference``, whose gradients of ``ref_loss`` are computed)
    context-parallel over ``mesh`` (and FSDP-sharded when ``sharded``), then check its logits,
    chunked loss and every gradient of the trainable parameters against the reference's;
    frozen parameters must get no gradient. ``shard(batch, cp_mesh)`` makes the local batch;
    default: ``shard_batch`` with the strategy's layout (allgather: "documents"); ``block_size``:
    the attention's tiles; ``param_dtype``: FSDP's compute dtype (None: the model's)."""
    if shard is None:
        layout = "documents" if strategy == "allgather" else "zigzag"
        shard = functools.partial(shard_batch, layout=layout)
    cp_mesh = mesh["cp"]  # slicing a mesh makes a new sub-mesh each time: once here
    apply_context_parallel(model, cp_mesh, strategy=strategy, max_seq_len=max_seq_len, block_size=block_size,
                           ulysses_degree=ulysses_degree)
    enable_chunked_loss(model, chunk_size=7)  # several chunks with a ragged last one
    if sharded:
        shard_model(model, mesh, param_dtype=param_dtype, reduce_dtype=None)
        dp_mesh = mesh["dp"]
        dp, dp_rank = dp_mesh.size(), dp_mesh.get_local_rank()
        # this dp rank's rows (as local_batches takes them), sharded over cp
        local = shard({k: v.chunk(dp)[dp_rank] for k, v in data.items()}, cp_mesh)
        per_rank = data["input_ids"].shape[0] // dp
        rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        loss_group = None  # every rank: dp and cp
    else:
        local, rows, loss_group = shard(data, cp_mesh), slice(None), cp_mesh.get_group()

    seq_index = local.get(SEQ_INDEX)
    with torch.no_grad():
        extra = {} if seq_index is None else {SEQ_INDEX: seq_index}
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"], **extra).logits
    torch.testing.assert_close(unshard(logits, cp_mesh, seq_index=seq_index), ref_logits[rows].detach(), **tol)

    loss = causal_lm_loss_sum(model, local) / count_valid_tokens([local["labels"]], group=loss_group)
    router = router_loss_share(model, group=loss_group)  # MoE: this rank's share of the router's loss
    if router is not None:
        loss = loss + router
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=loss_group)
    torch.testing.assert_close(total, ref_loss.detach(), **tol)
    trainable = []
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters(), strict=True):
        if ref_param.grad is None:
            assert param.grad is None, f"{name} has a gradient but should be frozen"
            continue
        assert param.grad is not None, f"{name} has no gradient"
        trainable.append((name, param.grad, ref_param.grad))
    if sharded:
        # FSDP: each rank compares the shard of every gradient it holds with the same slice of
        # the reference's; together the ranks compare every element (no gathers needed)
        for name, grad, ref_grad in trainable:
            if isinstance(grad, DTensor):
                shape, offset = compute_local_shape_and_global_offset(grad.shape, grad.device_mesh, grad.placements)
                assert tuple(grad.shape) == tuple(ref_grad.shape), (name, grad.shape, ref_grad.shape)
                ref_grad = ref_grad[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
                grad = grad.to_local()
            torch.testing.assert_close(grad, ref_grad, **tol, msg=lambda m, name=name: f"{name}: {m}")
    else:
        # each cp rank holds its tokens' share of every gradient: sum the shares, all in one all-reduce
        dtypes = {grad.dtype for _, grad, _ in trainable}
        assert len(dtypes) == 1, dtypes
        summed = torch.cat([grad.reshape(-1) for _, grad, _ in trainable])
        dist.all_reduce(summed, group=loss_group)
        for (name, grad, ref_grad), flat in zip(trainable, summed.split([g.numel() for _, g, _ in trainable])):
            torch.testing.assert_close(flat.view(grad.shape), ref_grad, **tol, msg=lambda m, name=name: f"{name}: {m}")
    compared = len(trainable)
    assert compared == sum(p.requires_grad for p in reference.parameters()) > 0, compared
