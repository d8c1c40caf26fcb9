"""A whole job's training step, simulated in one CPU process: the planner.

:func:`simulate_step_phases` runs **the same code** as the trainer (``Trainer``'s model build and
``optimizer_step``) for one rank of an N-rank job under ``FakeTensorMode`` with torch's ``fake``
process-group backend: tensors carry shapes, dtypes and devices but no storage, collectives do
nothing, so one CPU process simulates a rank of an 8-GPU Llama-3-8B job in seconds. The step is
measured as a real one is (``llama_cp.plan.memory.measure_step_memory``), and
:func:`plan_step_memory` plans a deep model from a few of its layers.

Note [Planning from a few layers]
=================================

Where decoder layers are alike (Note [Layers of different kinds] for where they are
not), and FSDP shards each layer's parameters on its own, within one phase of a step
every category of that phase's peak is an affine function of the number of layers n:

- forward+backward: the peak sits at the loss or in backward, where all n
  layers' saved activations, the sharded state of all n layers and a constant
  set of root/head tensors are alive together;
- optimizer (clipping + step): all n layers' sharded gradients and states and
  the foreach temporaries, which are proportional to them.

    bytes_phase(n) = bytes_phase(2) + (n - 2) * (bytes_phase(3) - bytes_phase(2))

The step's peak is the larger of the two phases, and which one wins can change
with n (many layers of small activations: the optimizer), so the phases are
tracked apart (``llama_cp.plan.memory.measure_step_memory``), extrapolated apart
and compared after.
:func:`plan_step_memory` simulates 3 and 4 layers of such a model; ``tests/plan`` checks
the extrapolation against full simulations. Not 2 and 3: the line holds from the first
n whose backward has a middle layer (one with a decoder layer on either side). With 2
layers the backward never has the previous layer's reduce-scatter buffer alive while a
middle layer recomputes, so where a middle layer's backward is the peak (long contexts
with the MLP/norm tiles or checkpoint offload) the 2-to-3 slope took that one buffer for a
per-layer cost: Llama-3-8B at 4M tokens on 8 GPUs was overstated by 30 x 0.81 GiB
(tests/plan/test_memory_regression.py::test_layer_extrapolation_is_exact).

Note [Layers of different kinds]
================================

Not every model's decoder layers are alike. DeepSeek-V3's first three are dense and the
rest routed experts; Llama 4 and ERNIE 4.5 interleave dense and expert layers; Gemma 4's full
layers have heads of 512 against the windowed layers' 256, and its last layers reuse earlier
layers' keys and values (no k/v projections). A 3- and 4-layer simulation of those would
extrapolate the wrong layer (Gemma 4's first 4 layers are all windowed), and a Gemma 4 config
cut to 3 layers is not even valid (transformers checks that every layer type reusing keys and
values has one storing them). :func:`layer_kinds` sorts the layers into kinds by what
``llama_cp.model.flops.model_flops`` counts for each (its linear layers, its attention per
pair), which is where the shapes that set a layer's memory show: a dense layer against an
expert one, a head size, a missing projection; and by whether it applies RoPE where the config
lists that per layer (``no_rope_layers``: Llama 4 normalises q and k in float32 on its RoPE layers
only). Layers alike in those are one kind here, a window included, windows being planned as
full. When the layers from some index P on are all of one kind, the extrapolation starts at
n = max(3, P + 2): the n- and (n + 1)-layer simulations hold the P different first layers and differ by one layer of the
repeated kind. Where the kinds repeat with a period p from P on (Llama 4's dense and expert layers
in turn, Gemma 4's five windowed layers to one full one), the simulations are of n and n + p
layers, n at least P + 2p and a whole number of periods short of the model, and the line steps a
period at a time. Not from P or P + 1: the first repeated layers sit beside one of another kind,
whose buffers (the gathered parameters prefetched in backward, the gradients reduce-scattered)
are alive with theirs at the backward's peak. A DeepSeek-V3 of 4 dense layers (64 tokens, cp 2)
grew by 125,372 bytes from 4 to 5 layers and 127,580 from 5 to 6, then 127,444 a layer, as its
1-dense-layer form does from 3 layers on. From P + 2 the plan equals the whole simulation
(tests/plan/test_families_plan.py, periods too). Otherwise (Gemma 4's small models, whose last
layers reuse keys and values) the model is simulated whole: exact, at the cost of a simulation
of every layer (seconds per layer: 22 s for a 30-layer Gemma 4 at 32K tokens on 2 cores, 53 s
for a 48-layer Llama-4-Maverick-shaped model at 32K, cp 8; by their periods, 12 and 18 layers and
8 and 12, the Maverick's in 22 s, its plan the same bytes).

Note [Planning --offload_params]
================================

With FSDP2's CPU offload policy the float32 parameter shards, their gradient shards and
AdamW's state live in host memory (read in torch 2.13: ``_fully_shard/_fsdp_param.py``,
``FSDPParam.all_gather_inputs``; ``_fsdp_collectives.py``, ``foreach_reduce``). The
simulation cannot tell host from device (every fake tensor is on the CPU, and ``pin_memory``
has no fake implementation), so the planner simulates the plain step and moves bytes by
category: "Sharded Param", "Sharded Grad" and "OptState" go to ``host``; in the optimizer
phase, which clips and steps CPU tensors (fused AdamW: Note [AdamW's implementation, pinned]
in llama_cp/optim/optimizers.py), everything but the gathered parameters and the buffers
goes there. Two device transients are added to the other
phases, each bounded by the largest FSDP group: the copy-in (each shard is copied to the
device, then cast to the compute dtype: one parameter's float32 shard at a time; with no
cast the group's copies are the all-gather inputs) and the copy-out (``foreach_reduce``'s
output, one group's float32 gradient shards, freed once copied to the host). Checked
against an H200 (110M-parameter Llama, 8192 tokens, docs/benchmarks.md): planned 1.99 and
0.62 GB for the plain and the offloaded step, measured 2.10 and 0.73 GB; the drop, 1.37 GB,
is the same.

The attention kernels are those of the planned GPU, modelled on CPU: Note [GPU attention
kernels' workspace] in ``llama_cp/attention/workspace.py``.

Simulated rank 0 holds the largest FSDP shards (torch pads the last ranks'
shards, never the first), so it is the busiest rank. Not in the tracked
numbers: the CUDA context, NCCL's and cuBLAS's workspaces and the caching
allocator's fragmentation; the planner keeps ``headroom`` of the GPU for them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from llama_cp.attention.kernels import BACKENDS, backend_problem, check_backend
from llama_cp.attention.workspace import MODELLED, ModelledBackend
from llama_cp.config import TrainConfig
from llama_cp.cp_attention import ContextParallelAttention
from llama_cp.model.build import cp_strategy, parallelize_model
from llama_cp.model.flops import model_flops
from llama_cp.modules.causal_lm import compute_dtype
from llama_cp.modules.families import check_family
from llama_cp.modules.layers import attention_head_dims, layer_chunks
from llama_cp.plan.memory import MemoryBreakdown, create_optimizer_state, measure_step_memory, step_peak

# ----------------------------------------------------------------------------- models

#: Model shapes the planner knows by name (the HF configs' fields that matter for memory).
MODEL_PRESETS: dict[str, dict] = {
    "llama3-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=False,
    ),
    "llama3-70b": dict(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=False,
    ),
    "llama2-7b": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, rope_theta=10000.0, tie_word_embeddings=False,
    ),
    "llama3.2-1b": dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
        tie_word_embeddings=True,
    ),
}


def load_model_config(model_name: str):
    """The HF config of ``model_name``: "embedded", a preset of ``MODEL_PRESETS``, a local
    directory with a config.json, or a GGUF file (``llama_cp.modules.gguf``)."""
    from transformers import LlamaConfig

    from llama_cp.modules.causal_lm import embedded_llama_config
    from llama_cp.modules.checkpoints import checkpoint_config
    from llama_cp.modules.gguf import gguf_config, gguf_path

    if model_name == "embedded":
        return embedded_llama_config()
    if model_name in MODEL_PRESETS:
        return LlamaConfig(max_position_embeddings=1 << 24, **MODEL_PRESETS[model_name])
    if os.path.isfile(os.path.join(model_name, "config.json")):
        return checkpoint_config(model_name)  # a vision-language checkpoint's text config
    gguf_file = gguf_path(model_name)
    if gguf_file is not None:
        return gguf_config(gguf_file)  # the metadata alone: planning does not dequantize the file
    raise ValueError(
        f"--model_name {model_name!r} is neither a preset ({', '.join(['embedded', *MODEL_PRESETS])}), "
        "a local directory with a config.json, nor a .gguf file"
    )


# ----------------------------------------------------------------------------- simulating


@contextlib.contextmanager
def _fake_world(world_size: int) -> Iterator[None]:
    """The default process group as torch's ``fake`` backend: this process is rank 0 of
    ``world_size``, and every collective returns at once without moving data."""
    if dist.is_initialized():
        raise RuntimeError(
            "the memory planner simulates a whole job in one process and needs torch.distributed "
            "uninitialised: plan in a separate process (python -m recipes.plan_memory ...)"
        )
    dist.init_process_group("fake", rank=0, world_size=world_size, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def simulate_step_memory(cfg: TrainConfig, world_size: int, *, model_config=None) -> MemoryBreakdown:
    """The step's peak of :func:`simulate_step_phases`."""
    return step_peak(simulate_step_phases(cfg, world_size, model_config=model_config))


def simulate_step_phases(
    cfg: TrainConfig, world_size: int, *, model_config=None, observer=None,
) -> dict[str, MemoryBreakdown]:
    """Peak memory per phase of the busiest rank of a ``world_size``-rank job training ``cfg``, simulated in
    this process with fake tensors (no memory is allocated, no other process is needed).

    Runs the trainer's own path: the HF model built on the meta device (as for real
    checkpoints) -> ``parallelize_model`` (LoRA, CP attention, chunked loss, FSDP2,
    checkpointing) -> materialised as fake tensors -> ``optimizer_step`` on
    ``gradient_accumulation_steps`` cp-sharded micro-batches of ``batch_size`` rows of
    ``context_length`` tokens, tracked by ``FSDPMemTracker``. ``model_config`` (an HF
    config) overrides ``cfg.model.model_name``. ``observer``: a context manager factory
    entered around the tracked step, inside the fake mode (``llama_cp.plan.breakdown``).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from llama_cp.fsdp_wrap import restore_buffers
    from llama_cp.modules.causal_lm import build_causal_lm
    from llama_cp.optim.optimizers import build_optimizer
    from llama_cp.parallel.sharding import shard_batch

    config = model_config if model_config is not None else load_model_config(cfg.model.model_name)
    p, o = cfg.parallel, cfg.optim
    if cfg.model.activation_offload:
        raise ValueError("the planner does not model --activation_offload (saved activations in host memory)")
    offload = cfg.model.offload_params  # simulated without the policy, then split: Note [Planning --offload_params]
    if offload:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, offload_params=False))
    strategy, _ = cp_strategy(cfg, config)
    if p.cp > 1 and strategy == "hybrid":
        raise ValueError(
            f"the planner does not model --cp_strategy hybrid{' (what auto picks here)' if p.cp_strategy == 'auto' else ''}:"
            " plan with --cp_strategy ring and --cp_strategy ulysses at the same --cp; hybrid's attention buffers "
            "lie between them"
        )
    if p.cp > 1 and strategy == "allgather":
        raise ValueError(
            "the planner cannot simulate --cp_strategy allgather: its layout reads which rows each rank holds, "
            "which fake tensors do not have; plan with --cp_strategy ring and add, per rank, the row's K/V of "
            "one layer (bf16) and its dK/dV (fp32) in backward"
        )
    if o.optimizer != "adamw":
        raise ValueError(
            f"the planner cannot simulate --optimizer {o.optimizer}: bitsandbytes reads tensor values, which "
            "fake tensors do not have; plan with --optimizer adamw (its 8 bytes of state per trainable "
            "parameter bound adamw8bit's ~2 from above)"
        )
    if cfg.peft.use_peft and cfg.peft.use_dora:
        # measured (embedded model, cp 2, all-linear, no checkpointing): simulated 4 layers 1.6% above the
        # real run, and the 2- and 3-layer extrapolation 0.15% below it; exact with checkpointing, but not
        # in general, so not planned
        raise ValueError(
            "the planner does not model --use_dora exactly (its simulation of DoRA's weight norms was 1.6% off a "
            "real run): plan without --use_dora and add, per rank, about three matrices of the largest adapted "
            "weight's size in the compute dtype (B @ A, its scaled copy and its sum with the weight, whose row norms "
            "DoRA takes while the layer runs) and 16 bytes per output row of every adapted layer, sharded "
            "(magnitude, gradient, AdamW moments)"
        )
    dims = p.dims(world_size)
    cpu = torch.device("cpu")
    # The planned rows are one document each: plain causal attention, which document masks only
    # skip work of. Finding documents reads position values, which fake tensors do not have.
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, document_mask=False))
    with _fake_world(world_size):
        mesh = dims.build_mesh("cpu")  # outside the fake mode: the mesh reads real rank tensors
        check_family(config)  # the trainer's refusals, before the model is built
        model = build_causal_lm(config, device="meta")  # the trainer's build: float32 sharded state
        model = parallelize_model(  # planned for GPUs: "auto" is bf16; attention: Note [GPU attention kernels' workspace]
            model, cfg, mesh, device_type="cuda", attention_backend=planned_attention_backend(cfg, config),
        )
        plan_windows_as_full(model)  # an upper bound: windows and chunks only skip work
        # meta -> fake: the sharded parameters get fake storage of their real size
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device=cpu)
            restore_buffers(model, cpu)
            optimizer = build_optimizer(o.optimizer, model, lr=o.lr, weight_decay=o.weight_decay,  # the trainer's
                                        on_host=offload)  # groups and implementation
            create_optimizer_state(model, optimizer, max_grad_norm=o.max_grad_norm)
            shape = (cfg.data.batch_size, cfg.data.context_length)
            micro, preference = [], None
            for _ in range(o.gradient_accumulation_steps):
                ids = torch.zeros(shape, dtype=torch.long)
                batch = {"input_ids": ids, "labels": ids.clone()}
                if cfg.objective == "dpo":  # a pair per row (more pairs change only (2P,) vectors)
                    pairs = cfg.data.batch_size
                    batch.update(sequence_ids=ids.clone(), sequence_lengths=torch.ones(2 * pairs, dtype=torch.long))
                    if cfg.dpo_loss == "sigmoid" and not cfg.peft.use_peft:  # precomputed (llama_cp.train.reference)
                        batch["reference_logps"] = torch.zeros(2 * pairs, dtype=torch.float64)
                    preference = dict(kind=cfg.dpo_loss, beta=cfg.dpo_beta, gamma=cfg.simpo_gamma, cp_group=mesh["cp"],
                                      num_pairs=pairs * o.gradient_accumulation_steps * dims.dp)
                micro.append(shard_batch(batch, mesh["cp"]))
            num_tokens = cfg.data.batch_size * cfg.data.context_length * o.gradient_accumulation_steps * dims.dp
            with observer() if observer is not None else contextlib.nullcontext():
                phases = measure_step_memory(model, optimizer, micro, num_tokens, max_grad_norm=o.max_grad_norm,
                                             preference=preference)
    if offload:
        transient = offload_transient_bytes(model, compute_dtype(cfg.model.dtype, "cuda"))
        phases = {name: offloaded(name, breakdown, transient) for name, breakdown in phases.items()}
    return phases


class _FullAttention(ContextParallelAttention):
    """A windowed (or Llama 4's chunked) model's attention as the planner runs it: every layer full
    causal. Which keys a window or chunk lets a block see is read from the batch's layout
    (``DocumentLayout`` in llama_cp/attention/documents.py), whose values fake tensors do not have; a
    window or chunk only skips blocks, tiles and ring transfers, so the plan is an upper bound of the
    run's memory."""

    def __call__(self, q, k, v, *, window: int | None = None, chunk: int | None = None, **kwargs):
        return super().__call__(q, k, v, **kwargs)


def plan_windows_as_full(model: nn.Module) -> None:
    """Give a model with sliding windows or attention chunks :class:`_FullAttention` on every module
    that holds its attention."""
    chunked = any(chunk is not None for chunk in layer_chunks(model.config))
    for module in model.modules():
        attention = module.__dict__.get("cp_attention")
        if isinstance(attention, ContextParallelAttention) and (attention.sliding or chunked):
            fields = {field.name: getattr(attention, field.name) for field in dataclasses.fields(attention)}
            module.cp_attention = _FullAttention(**{**fields, "sliding": False})


def offload_transient_bytes(model: nn.Module, param_dtype: torch.dtype | None) -> int:
    """The device bytes that ``--offload_params`` adds to a step, as an upper bound: the largest
    FSDP group's copy-in (a parameter's float32 shard copied to the device before its cast to
    ``param_dtype``, or every shard of the group where no cast follows) plus the largest group's
    float32 gradient shards (the reduce-scatter output, on the device until copied out)
    (Note [Planning --offload_params])."""
    from torch.distributed.fsdp import FSDPModule

    def local_bytes(param: torch.Tensor, dtype: torch.dtype | None = None) -> int:
        local = param.to_local() if hasattr(param, "to_local") else param
        return local.numel() * (dtype or local.dtype).itemsize

    copy_in = grads_out = 0
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in fsdp_modules:  # a group's parameters: its module's, less those of FSDP modules inside it
        inner = {id(p) for child in module.modules() if child is not module and isinstance(child, FSDPModule)
                 for p in child.parameters()}
        own = [p for p in module.parameters() if id(p) not in inner]
        if not own:
            continue
        cast = [local_bytes(p) for p in own if param_dtype is not None and p.dtype != param_dtype]
        kept = [local_bytes(p) for p in own if param_dtype is None or p.dtype == param_dtype]
        copy_in = max(copy_in, max(cast, default=0) + sum(kept))
        grads_out = max(grads_out, sum(local_bytes(p, torch.float32) for p in own if p.requires_grad))
    return copy_in + grads_out


def offloaded(phase: str, breakdown: MemoryBreakdown, transient: int) -> MemoryBreakdown:
    """``breakdown``, simulated without ``--offload_params``, as the device and host bytes of
    the offloaded step: the sharded parameters, gradients and optimizer state move to ``host``
    (and in the optimizer phase, which runs on the CPU, everything but the gathered parameters
    and the buffers); the forward/backward gains ``transient`` device bytes, counted as
    communication (Note [Planning --offload_params])."""
    tracked = breakdown.tracked
    sharded = tracked.get("Sharded Param", 0)
    if phase == "optimizer":
        device = dict(parameters=breakdown.parameters - sharded, gradients=0, optimizer=0,
                      activations=0, temporary=0, communication=0)
    else:
        device = dict(parameters=breakdown.parameters - sharded,
                      gradients=breakdown.gradients - tracked.get("Sharded Grad", 0), optimizer=0,
                      activations=breakdown.activations, temporary=breakdown.temporary,
                      communication=breakdown.communication + transient)
    total = sum(device.values())
    moved = breakdown.total - (total - (0 if phase == "optimizer" else transient))
    kept = ("Unsharded Param", "Buffer") if phase == "optimizer" else tuple(
        k for k in tracked if k not in ("Sharded Param", "Sharded Grad", "OptState"))
    return MemoryBreakdown(**device, total=total, host=breakdown.host + moved, tracked={
        **{k: v for k, v in tracked.items() if k in kept}, "Total": total, "Host State": moved,
        "Offload Transient": 0 if phase == "optimizer" else transient})


#: The GPU the planner plans for when it picks a backend: an sm80+ one with flash-attn installed.
_PLANNED_GPU = dict(capability=(8, 0), flash_attn_installed=True)


# Note [Planning cuDNN attention]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A named sdpa_cudnn is planned with sdpa_flash's stand-in ("auto" is planned as flash_attn, the GPU the
# planner assumes having flash-attn; on an H100 without it the trainer runs sdpa_cudnn, and the H200's
# plans of "auto" were within 3% of those runs' peaks). Around the kernel both run the same code (KV
# heads expanded, lse in float32, dK/dV summed back: kernel_calls.py), and cuDNN's own allocations are
# not in its meta kernels (the workspace is sized by the cuDNN graph at run time), so they were measured
# instead (docs/benchmarks.md, "One GPU, measured", the H200's second run, torch 2.11, cuDNN 9.19): one
# 64K causal forward and backward (32 heads, 8 KV heads expanded, 128) allocated 4.52 GiB beyond its
# inputs under cuDNN against 5.02 under sdpa_flash, and the eight speed rows (LoRA and full, 16K and 64K,
# Llama-3-8B shapes, 4 layers) peaked at the same bytes under both (e.g. 21.83 and 45.25 GiB at 64K). The
# plan is therefore sdpa_flash's, an upper bound by at most that 0.5 GiB difference per call where an
# attention backward is the peak. Packed documents run the per-piece path under a named sdpa_cudnn (no
# varlen kernel) and sdpa_flash's varlen calls under "auto" (Note [Varlen document calls]); the plan
# keeps sdpa_flash's varlen calls, whose workspace is bounded per block as the per-piece calls' is.
def planned_attention_backend(cfg: TrainConfig, model_config) -> str:
    """The attention backend the plan models: ``--attention_backend``, where "auto" is what
    the trainer picks on an sm80+ GPU with flash-attn installed (flash_attn for bf16/fp16, and
    sdpa_efficient for the calls of a layer whose heads are over 256: ``auto`` of the
    ``ModelledBackend``), and sdpa_cudnn is planned as sdpa_flash (Note [Planning cuDNN attention]);
    a CUDA backend as the ``ModelledBackend`` whose stand-ins the simulation runs.
    A CUDA backend that could not run there, or that the planner cannot model, is refused in
    one line; sdpa_cpu and math are planned as they run on CPU (the planner's own checks)."""
    dtype = compute_dtype(cfg.model.dtype, "cuda") or torch.float32
    # DeepSeek's MLA: the query/key heads', not config.head_dim; Gemma 4: its layers' two sizes
    head_dims = attention_head_dims(model_config)
    choice = cfg.model.attention_backend
    if choice == "sdpa_cudnn":  # Note [Planning cuDNN attention]
        if head_dims[-1] > 128:
            check_backend(choice, "cuda", dtype, head_dims[-1], name=f"--attention_backend {choice}", **_PLANNED_GPU)
        choice = "sdpa_flash"
    if choice == "auto":  # per call, as select_backend: the backend of each head size the model has
        chosen = {next(b for b in BACKENDS if b in MODELLED + ("math",) and
                       backend_problem(b, "cuda", dtype, head_dim, **_PLANNED_GPU) is None) for head_dim in head_dims}
        if len(chosen) == 1:
            choice = chosen.pop()
        elif chosen <= set(MODELLED) and "sdpa_efficient" in chosen and len(chosen) == 2:  # the other a flash
            return ModelledBackend((chosen - {"sdpa_efficient"}).pop(), auto=True)  # kernel: half precision
        else:  # not a pair the planner's stand-ins cover (e.g. math beside a CUDA kernel)
            raise ValueError(f"the planner models one CUDA attention backend per head size, not {sorted(chosen)} "
                             f"for head sizes {head_dims}; set the memory levers by hand")
    if choice in MODELLED:
        check_backend(choice, "cuda", dtype, head_dims[-1],
                      name=f"--attention_backend {cfg.model.attention_backend}", **_PLANNED_GPU)
        _check_modelled(choice, dtype, cfg.model.attention_backend)
        return ModelledBackend(choice)
    return choice


def _check_modelled(backend: str, dtype: torch.dtype, flag: str) -> None:
    if backend == "sdpa_efficient" and dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"--attention_backend {flag}: the planner models sdpa_efficient's workspace for float16/bfloat16, "
            f"not {str(dtype).removeprefix('torch.')}; plan with --dtype bfloat16 or another backend"
        )


#: The fewest layers simulated for the extrapolation (Note [Planning from a few layers]).
_FEW_LAYERS = 3


def layer_kinds(config) -> list[tuple]:
    """Each decoder layer's kind: its linear layers' FLOPs, its attention's share of the FLOPs per pair, and
    whether it applies RoPE where the config lists that per layer (Note [Layers of different kinds])."""
    flops = model_flops(config)
    layers = len(flops.layer_flops)
    no_rope = getattr(config, "no_rope_layers", None)
    no_rope = tuple(no_rope) if isinstance(no_rope, (list, tuple)) and len(no_rope) == layers else (0,) * layers
    return list(zip(flops.layer_flops, flops.pair_shares or (0.0,) * layers, no_rope, strict=True))


def repeated_from(kinds: list, period: int = 1) -> int:
    """The first layer from which the kinds repeat every ``period`` layers to the last; 0 when they all do."""
    first = len(kinds) - period
    while first > 0 and kinds[first - 1] == kinds[first - 1 + period]:
        first -= 1
    return first


def extrapolation(config) -> tuple[int, int] | None:
    """(n, p): plan from simulations of n and n + p layers, p the period of the layers' kinds (1 when
    from some layer on they are alike); None: simulate every layer (Note [Layers of different kinds])."""
    kinds = layer_kinds(config)
    layers, best = len(kinds), None
    for period in range(1, layers // 2 + 1):
        start = max(_FEW_LAYERS, repeated_from(kinds, period) + 2 * period)
        start += (layers - start) % period  # whole periods from n to the last layer
        if start + period < layers and (best is None or 2 * start + period < 2 * best[0] + best[1]):
            best = (start, period)
    return best


def plan_step_memory(cfg: TrainConfig, world_size: int, *, model_config=None) -> MemoryBreakdown:
    """:func:`simulate_step_memory` for the whole model, from simulations of n and n + p layers
    extrapolated phase by phase (Note [Planning from a few layers]): p layers the period of their kinds,
    n at least 3 and two periods past the layers before those that repeat (Note [Layers of different
    kinds]); a model with no more layers than n + p is simulated whole."""
    config = model_config if model_config is not None else load_model_config(cfg.model.model_name)
    check_family(config)  # the trainer's refusal, before the layers are counted by kind
    layers = config.num_hidden_layers
    plan = extrapolation(config)
    if plan is None:
        return simulate_step_memory(cfg, world_size, model_config=config)
    start, period = plan
    few = []
    for n in (start, start + period):
        small = copy.deepcopy(config)
        small.num_hidden_layers = n
        few.append(simulate_step_phases(cfg, world_size, model_config=small))
    steps = (layers - start) // period
    return step_peak({phase: few[0][phase].extrapolate(few[1][phase], steps) for phase in few[0]})
