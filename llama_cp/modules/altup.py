"""Gemma 3n's AltUp coefficients, which transformers clamps in place while training, kept clamped where FSDP2
holds them: Note [AltUp's clamp under FSDP2].

    clamp_sharded_altup(model)   # after fully_shard: a pre-forward hook on the root clamps the shards
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.tensor import DTensor

# Note [AltUp's clamp under FSDP2]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# In training, Gemma 3n's AltUp clamps its prediction coefficients to +-altup_coef_clip in place before it uses
# them: ``self.prediction_coefs.weight.data.clamp_(...)`` in Gemma3nTextAltUp.predict (transformers 5.24
# models/gemma3n/modeling_gemma3n.py; 4.56.2 and 5.0.0 clamp correction_coefs in place too, in correct; 5.24
# clamps those functionally, ``weight.clamp(...)``, and leaves the parameter as it is). Single-process, that
# writes the parameter: the step after it starts from the clamped value. Under FSDP2 the forward sees the
# all-gathered copy, so the clamp lands there and the sharded parameter keeps its unclamped values; the backward
# gathers the parameter again (reshard_after_forward) and computes with the unclamped coefficients, and the
# optimizer steps the unclamped shard. On tests/modules/test_gemma3n.py's model (two coefficients of each layer
# at +-2, the clamp at 0.05) every FSDP run's embedding gradient was up to 1.0e-3 off while the plain CP runs
# were exact; with each layer checkpointed (its recompute clamps its own gather) the gradients agreed, and the
# shards still held the unclamped coefficients, 1.95 off, for the optimizer to step.
#
# So after fully_shard a pre-forward hook on the root (run before any layer gathers its parameters) clamps each
# rank's shard of the coefficients transformers clamps in place, as transformers does, in training only: the
# forward, the backward's gather and the optimizer then all see what single-process transformers holds. Which
# coefficients transformers clamps in place is read from the installed AltUp itself (``_clamped_in_place``: a
# copy run once with coefficients beyond the clamp), not from a version number.


def _clamped_in_place(altup: nn.Module) -> tuple[str, ...]:
    """The names of ``altup``'s coefficient Linears whose weights its predict and correct clamp in place in
    training: a copy with a one-wide hidden state, its coefficients set beyond the clamp, run once."""
    config = copy.copy(altup.config)
    config.hidden_size = 1
    probe = type(altup)(config).train()
    names = ("prediction_coefs", "correction_coefs")
    with torch.no_grad():
        for name in names:
            getattr(probe, name).weight.fill_(2 * config.altup_coef_clip)
        before = {name: getattr(probe, name).weight.clone() for name in names}
        hidden = torch.ones(config.altup_num_inputs, 1, 1, 1)
        probe.correct(probe.predict(hidden), hidden[0])
        # changed, not "at most the clamp": a clamp of 0.05 leaves float32's 0.05000000075
        return tuple(name for name in names if not torch.equal(getattr(probe, name).weight, before[name]))


def clamp_sharded_altup(model: nn.Module) -> None:
    """Note [AltUp's clamp under FSDP2]: ``model`` (after fully_shard) clamps the shards of the AltUp
    coefficients transformers clamps in place, before each training forward. No AltUp, or no clamp: nothing."""
    modules = [m for m in model.modules() if type(m).__name__.endswith("AltUp")
               and getattr(getattr(m, "config", None), "altup_coef_clip", None) is not None]
    if not modules:
        return
    names = _clamped_in_place(modules[0])

    def clamp(root, args):
        with torch.no_grad():
            for altup in modules:
                if not altup.training:
                    continue
                bound = altup.config.altup_coef_clip
                for name in names:
                    weight = getattr(altup, name).weight  # the sharded parameter between forwards
                    (weight.to_local() if isinstance(weight, DTensor) else weight).clamp_(-bound, bound)

    model.register_forward_pre_hook(clamp, prepend=True)
