"""Memory of a training step, measured: one rank's tensor bytes by category at the peak of each
phase of a step (torch's tensor-level ``FSDPMemTracker``, which counts every tensor's bytes by
category and is deterministic on CPU).

- :func:`track_peak_memory`: the peak bytes per category of any block of code;
- :func:`measure_step_memory`: the peak of each phase of one real ``Trainer`` optimizer step of a
  sharded model, as a :class:`MemoryBreakdown`; :func:`step_peak` picks the step's peak.

The planner runs the same measurement on a whole job's step simulated under fake tensors
(``llama_cp.plan.simulate``), and searches the longest context that fits (``llama_cp.plan.fit``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker

from llama_cp.model.loss import causal_lm_loss_sum
from llama_cp.model.preference import adapters_off_logps
from llama_cp.optim.step import apply_gradients, forward_backward, preference_forward_backward

GiB = 1 << 30

CATEGORIES = ("Parameter", "Buffer", "Gradient", "Activation", "Temp", "Optstate", "Other")


@contextlib.contextmanager
def track_peak_memory(
    *tracked: nn.Module | torch.optim.Optimizer, device_type: str = "cpu"
) -> Iterator[dict[str, int]]:
    """Track every tensor allocated inside the block; afterwards the yielded dict holds the
    bytes per category (``CATEGORIES``) on ``device_type`` at the block's peak, and their
    ``"Total"``.

    Pass the model (and optimizer) so their parameters, gradients and states are
    attributed to the right category even when allocated before the block.
    """
    peak: dict[str, int] = {}
    tracker = MemTracker()
    if tracked:
        tracker.track_external(*tracked)
    with tracker:
        yield peak
    snapshot = tracker.get_tracker_snapshot("peak")
    peak.update({category: 0 for category in (*CATEGORIES, "Total")})
    for device, device_stats in snapshot.items():
        if device.type == device_type:
            for key, nbytes in device_stats.items():
                peak[key if isinstance(key, str) else key.value] = nbytes


# ----------------------------------------------------------------------------- breakdown

#: FSDPMemTracker's categories grouped into ours.
_GROUPS = {
    "parameters": ("Sharded Param", "Unsharded Param", "Buffer"),
    "gradients": ("Sharded Grad", "Unsharded Grad"),
    "optimizer": ("OptState",),
    "activations": ("Activation", "Inputs"),
    "temporary": ("Temp",),
    "communication": ("All Gather", "Reduce Scatter"),
}


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes of one rank at the peak of a training step, by category.

    ``parameters``: sharded parameters + gathered (unsharded) parameters alive at
    the peak + buffers; ``gradients``: sharded and unsharded gradients;
    ``optimizer``: optimizer state, and in the optimizer phase what the step allocates too (the
    foreach AdamW's sqrt(exp_avg_sq), 4 bytes per trainable parameter of the larger param group: Note [AdamW's
    implementation, pinned] in llama_cp/optim/optimizers.py); ``activations``: tensors saved for backward
    (and the batch); ``temporary``: short-lived tensors of backward;
    ``communication``: FSDP all-gather / reduce-scatter buffers. ``total`` is
    their sum, the tracked peak. ``host``: bytes kept in host memory instead
    (``--offload_checkpoints``), at their own peak; not part of ``total``.
    """

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    temporary: int
    communication: int
    total: int
    host: int = 0
    tracked: dict[str, int] = dataclasses.field(default_factory=dict, compare=False)
    """FSDPMemTracker's own categories ("Sharded Param", "Unsharded Param", ...) at the peak."""
    sqrt_groups: tuple[int, ...] = dataclasses.field(default=(), compare=False)
    """The optimizer phase's foreach AdamW sqrt(exp_avg_sq) bytes of each param group, of which
    ``optimizer`` holds the largest (Note [Counting the AdamW step]); () where not counted."""

    @classmethod
    def from_snapshot(cls, snapshot: dict, host: int = 0) -> "MemoryBreakdown":
        """From one device's ``FSDPMemTracker.get_tracker_snapshot("peak")`` entry (and the
        peak bytes offloaded to host memory)."""
        by_name = {str(getattr(k, "value", k)): v for k, v in snapshot.items()}
        values = {name: sum(by_name.get(k, 0) for k in keys) for name, keys in _GROUPS.items()}
        return cls(**values, total=by_name.get("Total", sum(values.values())), host=host, tracked=by_name)

    def extrapolate(self, other: "MemoryBreakdown", steps: int) -> "MemoryBreakdown":
        """``self + steps * (other - self)``, field by field (Note [Planning from a few layers] in
        llama_cp/plan/simulate.py)."""
        def line(a: int, b: int) -> int:
            return a + steps * (b - a)

        values = {name: line(getattr(self, name), getattr(other, name)) for name in self.to_dict()}
        keys = self.tracked.keys() | other.tracked.keys()
        tracked = {k: line(self.tracked.get(k, 0), other.tracked.get(k, 0)) for k in keys}
        groups = ()
        if self.sqrt_groups and len(self.sqrt_groups) == len(other.sqrt_groups):
            # each group's sqrt list grows with the layers, their maximum need not: the group that
            # is the larger at 3 and 4 layers (a tied embedding) may not be in the whole model
            groups = tuple(line(a, b) for a, b in zip(self.sqrt_groups, other.sqrt_groups))
            change = max(groups) - line(max(self.sqrt_groups), max(other.sqrt_groups))
            values["optimizer"] += change
            values["total"] += change
            tracked.update({k: tracked[k] + change for k in ("OptState", "Total") if k in tracked})
        return MemoryBreakdown(**values, host=line(self.host, other.host), tracked=tracked, sqrt_groups=groups)

    def to_dict(self) -> dict[str, int]:
        """The device categories and the total (``host``, ``tracked`` and ``sqrt_groups`` left out)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("host", "tracked", "sqrt_groups")}


# ----------------------------------------------------------------------------- measuring



def create_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, *, max_grad_norm: float) -> None:
    """Run the optimizer phase of a step once on zero gradients, without a forward/backward:
    the optimizer allocates its state as its first step would, and DTensor's sharding
    propagation for clipping and the step is cached, so that its first-call bookkeeping
    (which runs under a fake mode of its own) is not mistaken for memory of a tracked step."""

    for param in model.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    apply_gradients(model, optimizer, max_grad_norm=max_grad_norm)


# Note [No collection in a tracked phase]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch's MemTracker and FSDPMemTracker (torch/distributed/_tools/mem_tracker.py, read at torch
# 2.13: _update_and_maybe_create_winfos, track_external) count only the storages they register:
# those allocated under their dispatch mode, and the model's parameters, gradients and optimizer
# state. Garbage left by earlier work is in no tracked peak, so no collection is needed before a
# phase. What could move a peak is Python's cyclic collector running inside the phase: the
# points where it runs depend on how many objects the process allocated before (the same plan in
# a fresh CLI process and in a long notebook), and a collection there frees cyclic garbage of the
# step earlier than at the step's end. So the collector is off while a phase is tracked (restored
# after, also on an error): a plan is the same in any process, and cyclic garbage counts until
# the phase ends, an upper bound. Until 28 Nov 2026 each phase started with gc.collect() instead,
# which walks every object of the process (0.22 s once torch, transformers and peft are imported;
# more in a forked process, whose walk copies the pages it touches), twice a simulation. Measured
# on the 2-core machine, every category of every phase the same to the byte either way: 12 plans
# of tests/plan/memory_matrix.py in one process 15.1 -> 11.7 s, its 48 in two forked processes
# 37.0 -> 23.9 s, `plan_memory --model_name llama3-8b --cp 8 --use_peft --find_max_context` 75 -> 71 s.


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """Python's cyclic garbage collector off inside the block, back as it was after (Note [No
    collection in a tracked phase])."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def measure_step_memory(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list[dict[str, torch.Tensor]],
    num_tokens: int, *, max_grad_norm: float, preference: dict | None = None,
) -> dict[str, MemoryBreakdown]:
    """Peak memory of this rank in each phase of one ``Trainer`` optimizer step of a model
    built by ``parallelize_model`` (its optimizer state already allocated), and of an eval
    forward of one micro-batch: ``{"forward_backward": ..., "optimizer": ..., "eval": ...}``
    (Note [Planning from a few layers] in llama_cp/plan/simulate.py). :func:`step_peak` picks the step's peak.

    The micro-batches run one ``forward_backward`` call each (the same arithmetic as one call
    on all of them), so that the tracker's per-module statistics can be reset in between:
    FSDPMemTracker refuses a second forward of the root module otherwise, and its peak
    spans the whole block either way.

    ``preference``: a DPO step (``preference_forward_backward``'s keywords kind, beta, gamma,
    cp_group and num_pairs; the batches of ``batch_sequences``); with kind "sigmoid" and no
    ``reference_logps`` in a batch the adapters-off reference pass runs first, tracked as a
    forward of its own."""

    device = micro_batches[0]["input_ids"].device
    offloader = getattr(model, "checkpoint_offloader", None)

    def host_peak() -> int:
        return offloader.peak_host_bytes if offloader is not None else 0

    phases = {}
    tracker = FSDPMemTracker(model, optimizer)
    tracker.track_inputs(tuple(micro_batches))
    with no_collection(), tracker:  # Note [No collection in a tracked phase]
        # One tracker for every forward: torch's FSDPMemTracker does not restore the hooks of a
        # multi-module FSDP group ([norm, lm_head]) on exit, so a second tracker of forwards on
        # the same model fails. Eval first: the head group, not resharded after a forward, then
        # stays gathered into the training forward, as it does in a step that follows an eval.
        with torch.no_grad():
            causal_lm_loss_sum(model, micro_batches[0], return_correct=True)  # Trainer.evaluate's forward
        phases["eval"] = MemoryBreakdown.from_snapshot(tracker.get_tracker_snapshot("peak").get(device, {}))
        if offloader is not None:
            offloader.reset_peak()
        for batch in micro_batches:
            tracker.reset_mod_stats()  # the next root forward is a new iteration for the tracker
            if preference is None:
                forward_backward(model, [batch], num_tokens)
                continue
            options = dict(preference)
            num_pairs = options.pop("num_pairs")
            if options["kind"] == "sigmoid" and "reference_logps" not in batch:  # LoRA: the base is the reference
                batch = {**batch, "reference_logps": adapters_off_logps(model, batch, options["cp_group"])}
                tracker.reset_mod_stats()
            preference_forward_backward(model, [batch], num_pairs, **options)
    # the block's peak, which covers the eval too (eval's own peak is rarely the higher)
    phases["forward_backward"] = MemoryBreakdown.from_snapshot(
        tracker.get_tracker_snapshot("peak").get(device, {}), host=host_peak()
    )
    tracker = FSDPMemTracker(model, optimizer)  # picks up the sharded gradients and the state
    with no_collection(), tracker:
        apply_gradients(model, optimizer, max_grad_norm=max_grad_norm)
    tracked = MemoryBreakdown.from_snapshot(tracker.get_tracker_snapshot("peak").get(device, {}))
    counted = adamw_step_bytes(optimizer)
    if counted is not None:  # Note [Counting the AdamW step]
        state, groups = counted
        optimizer_bytes = state + max(groups, default=0)
        total = tracked.total - tracked.optimizer + optimizer_bytes
        tracked = dataclasses.replace(tracked, optimizer=optimizer_bytes, total=total, sqrt_groups=tuple(groups),
                                      tracked={**tracked.tracked, "OptState": optimizer_bytes, "Total": total})
    phases["optimizer"] = tracked
    return phases


# Note [Counting the AdamW step]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# What torch's AdamW holds at its step's peak is known exactly, and the planner counts it
# instead of reading it off FSDPMemTracker: its state (exp_avg, exp_avg_sq and a step counter per
# trainable parameter, each of its parameter's local shard; with foreach on a GPU the counters are
# host tensors, 4 bytes each, counted all the same), and with foreach (the trainer's
# implementation on the GPU: Note [AdamW's implementation, pinned] in llama_cp/optim/optimizers.py)
# the new fp32 list _foreach_sqrt(exp_avg_sq) of one parameter group at a time (torch/optim/adamw.py,
# _multi_tensor_adam; the other foreach ops of the step work in place), so the largest group's
# exp_avg_sq bytes; fused: nothing more. Why count: on torch 2.10 and 2.11 the tracker, run on a
# sharded model's fake step, holds three more copies of that sqrt list (the 2-layer embedded
# Llama: 41.6 MB of "OptState" for 15.3 MB of state and 6.6 MB of sqrt; torch 2.13: 21.9 MB), and
# the fused step counts temporaries of its own. Those are the tracker's: on an H200 with torch
# 2.11 a full fine-tune of a 4-layer Llama-3-8B at 32K tokens peaked at 36.65 GiB
# (torch.cuda.max_memory_allocated), the forward/backward's 36.59 GiB planned, while the tracked
# optimizer phase said 49.48 GiB (docs/gpu_report/h200_2026-11-27.md). On torch 2.13 the tracker
# agrees with this count to the byte (tests/plan/test_plan_cli.py). Each group's sqrt bytes are kept
# (``MemoryBreakdown.sqrt_groups``) so that the plan from 3 and 4 layers extrapolates each group and
# takes the largest of the whole model's: with tied embeddings the group that does not decay can be
# the larger at 4 layers and the smaller at 16 (Llama-3.2-1B's optimizer phase, full fine-tuning,
# was planned 2.64 GiB low from the larger group at 3 and 4 layers).


def adamw_step_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, list[int]] | None:
    """What torch's AdamW holds on this rank at the peak of its step (Note [Counting the AdamW
    step]): the bytes of its state, and of each param group's foreach sqrt(exp_avg_sq) list (none
    when fused), of which the step holds the largest; None for another optimizer (bitsandbytes' is
    not planned)."""
    if type(optimizer) is not torch.optim.AdamW:
        return None

    def nbytes(t: torch.Tensor) -> int:
        local = t.to_local() if hasattr(t, "to_local") else t
        return local.numel() * local.element_size()

    state = sum(nbytes(t) for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    if any(group.get("fused") for group in optimizer.param_groups):
        return state, []
    return state, [sum(nbytes(optimizer.state[p]["exp_avg_sq"]) for p in group["params"] if p in optimizer.state)
                   for group in optimizer.param_groups]


def step_peak(phases: dict[str, MemoryBreakdown]) -> MemoryBreakdown:
    """The phase with the highest total: the step's peak (its ``host``: the largest of any phase)."""
    peak = max(phases.values(), key=lambda breakdown: breakdown.total)
    return dataclasses.replace(peak, host=max(breakdown.host for breakdown in phases.values()))

