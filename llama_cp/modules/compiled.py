"""``--compile``: the decoder's per-token modules (its norms, dense MLPs and the attention layers
around their kernel) and the training loss's chunks run through ``torch.compile``, so that their
elementwise chains become fused kernels.

Note [Compiled per-token modules]
=================================

A 64K LoRA step of Llama-3-8B's shapes on an H200 spends about 200 ms of its 2.2 s in
elementwise kernels of the decoder layers (docs/benchmarks.md, runs 4 to 6): an RMSNorm
is seven passes over its tokens (cast to float32, square, mean, rsqrt, multiply, cast
back, scale), SwiGLU three (silu, multiply, and their backward), and RoPE about five
for each of q and k (two products, the half rotation's negation and concatenation, the
sum), each pass a kernel that reads and writes the whole local sequence; the forward runs
twice under activation checkpointing. Inductor fuses each chain into one or two kernels.

What is compiled, and what is not:

- The norms that :func:`llama_cp.modules.tiling.norm_modules` finds (each decoder layer's
  RMSNorm / LayerNorm children and the final norm) and each decoder layer's ``mlp`` whose
  parameters all belong to ``nn.Linear`` layers or to peft (the dense MLPs, with LoRA or
  DoRA). The norms ``--lora_modules_to_save`` copies are peft's wrappers and stay eager.
  An MoE's ``mlp`` (a router, experts held as fused parameters or a ModuleList chosen per
  token) is left eager: its data-dependent dispatch would break the graph.
- The attention layers (the modules ``apply_context_parallel`` bound: ``cp_attention`` and
  an ``o_proj``), all but their kernel: the family's own forward (q/k/v projections, q/k
  norms, RoPE, the output projection) is compiled, and the attention function llama-cp
  registers (``cp_attention_forward``) is ``torch.compiler.disable``d, so dynamo breaks the
  graph at its call, runs it eager and compiles the rest of the forward as a second graph.
  The function must stay eager: the kernel calls of a block depend on where documents
  start and which rank holds which rows (``llama_cp.attention.documents``), values read on
  the host, and the ring and Ulysses communicate; each call is one kernel already
  (flash-attn or cuDNN). Its document layout passes through as an argument without
  guards: a new layout each step compiles nothing new. Gemma 4's layers that store their keys and
  values for later layers, or reuse an earlier layer's, stay eager (``shares_keys_and_values``):
  compiled, the recompute under activation checkpointing took another graph than the forward
  and torch refused it.
- The chunks of the training loss (the softmax, loss and logit gradient of each chunk of tokens;
  the head's GEMMs stay eager): Note [A compiled loss chunk] in ``llama_cp/model/cross_entropy.py``.
- Each module's own ``forward`` is what is compiled (``torch.compile`` of the bound method,
  set as the instance's ``forward``): the same code as eager, whatever the family's norm,
  MLP or attention computes, so the result equals eager up to the order inductor sums in
  (tests: float32 training trajectories to 1e-5, LoRA on every Linear layer; the attention
  layers of five families whose attention code differs most, forward and backward,
  tests/modules/test_compiled.py). One exception:
  dropout inside a compiled module (``--lora_dropout`` on adapters) draws its masks from
  inductor's random numbers, so other masks than eager's, of the same distribution
  (activation checkpointing's recompute draws the same masks as its forward, compiled as
  eager).
- Modules share graphs: dynamo guards on the code, not the instance (2 graphs for 12 norms and
  12 MLPs in one pass, torch 2.13; an attention layer's two graphs are shared by the layers of
  one family, but for attributes its forward reads that differ between layers: gpt-oss's
  windowed and full layers, a ``sliding_window`` of 128 or None, compile apart). A training
  run compiles a few variants of each forward
  (grad mode, whether the input needs a gradient, FSDP2's renamed class of the final norm, a
  new sequence length, which then turns dynamic); past dynamo's recompile limit (8 a
  function) a new variant runs eager, which costs time only.
- Tiling (``--mlp_tile_size``, ``--norm_tile_size``) wraps the compiled forward: the tiles
  run it, forward and in backward's recompute.
- The memory planner runs the modules eager (a fake tensor takes the eager forward): a
  compiled module saves for its backward at most what eager saves (the partitioner keeps
  the inputs and recomputes the elementwise chain), so the plan is an upper bound. By how
  much is a GPU measurement (docs/benchmarks.md).
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from llama_cp.modules.tiling import copied_norms, norm_modules


def _dense(mlp: nn.Module) -> bool:
    """Whether ``mlp`` is a dense MLP, not an MoE: every parameter belongs to an ``nn.Linear`` or to
    peft (its LoRA layers, DoRA's magnitudes; transformers 5's fused experts are parameters of their
    own module) and no experts are held in a list (transformers 4's, each a Linear MLP)."""
    modules = list(mlp.modules())
    return not any(isinstance(m, nn.ModuleList) for m in modules) and all(
        isinstance(owner, nn.Linear) or type(owner).__module__.startswith("peft.")
        for owner in modules if list(owner.parameters(recurse=False)))


def compile_forward(module: nn.Module) -> None:
    """Replace ``module.forward`` with ``torch.compile`` of it; a fake tensor (the memory planner's)
    takes the eager forward (Note [Compiled per-token modules])."""
    eager = module.forward
    compiled = torch.compile(eager)

    def forward(self, hidden_states, *args, **kwargs):
        if isinstance(hidden_states, FakeTensor):
            return eager(hidden_states, *args, **kwargs)
        return compiled(hidden_states, *args, **kwargs)

    module.forward = types.MethodType(forward, module)
    module._llama_cp_compiled = True


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """The attention layers ``apply_context_parallel`` bound (the decoder, also bound, has no ``o_proj``)."""
    return [m for m in model.modules() if getattr(m, "cp_attention", None) is not None and hasattr(m, "o_proj")]


def shares_keys_and_values(attention: nn.Module) -> bool:
    """Whether a Gemma 4 attention layer stores its keys and values for later layers or reuses an earlier
    layer's (transformers 5.24 Gemma4TextAttention): its forward writes or reads a dict the whole model
    shares, whose contents differ between the forward and activation checkpointing's recompute, so a
    compiled forward would take another graph there (torch.utils.checkpoint refuses the recompute)."""
    return bool(getattr(attention, "is_kv_shared_layer", False) or getattr(attention, "store_full_length_kv", False))


def loss_heads(model: nn.Module) -> list[nn.Module]:
    """The head's Linear layers ``llama_cp.model.loss.enable_chunked_loss`` gave the chunked loss."""
    return [m for m in model.modules() if hasattr(m, "loss_chunk_size")]


def compile_per_token_modules(model: nn.Module, layers: list[nn.Module]) -> None:
    """``--compile``: compile the decoder's norms, dense MLPs and attention layers but their kernel
    (Note [Compiled per-token modules]), and the chunks of the loss (Note [A compiled loss chunk] in
    llama_cp/model/cross_entropy.py)."""
    mlps = [layer.mlp for layer in layers if isinstance(getattr(layer, "mlp", None), nn.Module) and _dense(layer.mlp)]
    attention = [m for m in attention_layers(model) if not shares_keys_and_values(m)]
    for module in norm_modules(model, layers) + mlps + attention:
        compile_forward(module)
    for head in loss_heads(model):
        head.loss_compiled = True


def compiled_summary(model: nn.Module, layers: list[nn.Module]) -> str:
    """The line a ``--compile`` run says: what runs compiled and what stays eager."""
    compiled = {id(m) for m in model.modules() if getattr(m, "_llama_cp_compiled", False)}
    norms = sum(id(m) in compiled for m in norm_modules(model, layers))
    mlps = sum(id(getattr(layer, "mlp", None)) in compiled for layer in layers)
    attention_modules = attention_layers(model)
    attention = sum(id(m) in compiled for m in attention_modules)
    eager = len(layers) - mlps  # an MoE's mlp (transformers 4's Mixtral: block_sparse_moe)
    sharing = sum(map(shares_keys_and_values, attention_modules))
    copied = len(copied_norms(model))  # --lora_modules_to_save's: left eager
    loss = any(getattr(m, "loss_compiled", False) for m in loss_heads(model))
    parts = [f"{norms} norms", f"{mlps} MLPs", f"{attention} attention layers", *(["the loss's chunks"] * loss)]
    return (f"--compile: {', '.join(parts[:-1])} and {parts[-1]} run through torch.compile; the attention kernels"
            + (f", {eager} MoE MLPs" if eager else "")
            + (f", {copied} norms of --lora_modules_to_save" if copied else "")
            + (f", {sharing} attention layers that share keys and values across layers" if sharing else "")
            + " stay eager; the first steps compile")
