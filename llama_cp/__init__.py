"""llama-cp: long-context fine-tuning of HF Llama models with context parallelism on FSDP2.

What a training loop of your own needs (README, "The building blocks"):

- processes and the mesh: :func:`init_distributed`, :func:`end_distributed`, :class:`ParallelDims`, :func:`launch`;
- the model: :func:`build_causal_lm` (:func:`embedded_llama_config`: the built-in small Llama), :func:`parallelize_model` (all of the below from a
  :class:`TrainConfig`), or piece by piece :func:`apply_context_parallel`,
  :func:`enable_chunked_loss`, :func:`shard_model`, :func:`load_full_weights`;
- the data: :func:`build_rows`, :class:`DistributedRowLoader`, :func:`shard_batch` (and
  :func:`unshard`, its inverse, for your own eval or generation);
- a step: :func:`forward_backward`, :func:`optimizer_step`, :func:`causal_lm_loss_sum`,
  :func:`count_valid_tokens`, :func:`build_optimizer`;
- state: :func:`save_checkpoint`, :func:`load_checkpoint`, :func:`resumable_checkpoint`,
  :func:`export_pretrained`;
- or all of it: :class:`Trainer`.
"""

# Note [A lazy package face]
# ==========================
# ``import llama_cp`` imports nothing but this file; each name below is imported from its module
# the first time it is read (PEP 562). A process that needs one layer (a gloo rank building a
# model, the planner, a CLI that fails on a flag) pays only for that layer's imports, not for
# datasets, tqdm, DCP and the trainer: about 1 s of every process start on 2 cores.
# ``from llama_cp import X`` and ``llama_cp.X`` work as eager imports would; type checkers read
# the imports under TYPE_CHECKING.

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llama_cp.config import TrainConfig
    from llama_cp.cp_attention import apply_context_parallel
    from llama_cp.data.loader import DistributedRowLoader, build_rows
    from llama_cp.fsdp_wrap import activation_offload, gather_full_state_dict, load_full_weights, shard_model
    from llama_cp.model.build import build_model, parallelize_model
    from llama_cp.model.cross_entropy import linear_cross_entropy
    from llama_cp.model.loss import causal_lm_loss_sum, count_valid_tokens, enable_chunked_loss
    from llama_cp.modules.causal_lm import build_causal_lm, embedded_llama_config
    from llama_cp.optim.optimizers import build_optimizer
    from llama_cp.optim.step import forward_backward, optimizer_step
    from llama_cp.parallel.mesh import ParallelDims, end_distributed, init_distributed
    from llama_cp.parallel.sharding import shard_batch, unshard
    from llama_cp.train.checkpoint import load_checkpoint, save_checkpoint
    from llama_cp.train.checkpoint_files import resumable_checkpoint
    from llama_cp.train.export import export_pretrained
    from llama_cp.train.launcher import launch
    from llama_cp.train.trainer import Trainer

#: Each public name -> the module that defines it.
_MODULES = {
    "DistributedRowLoader": "llama_cp.data.loader",
    "ParallelDims": "llama_cp.parallel.mesh",
    "TrainConfig": "llama_cp.config",
    "Trainer": "llama_cp.train.trainer",
    "activation_offload": "llama_cp.fsdp_wrap",
    "apply_context_parallel": "llama_cp.cp_attention",
    "build_causal_lm": "llama_cp.modules.causal_lm",
    "build_model": "llama_cp.model.build",
    "build_optimizer": "llama_cp.optim.optimizers",
    "build_rows": "llama_cp.data.loader",
    "causal_lm_loss_sum": "llama_cp.model.loss",
    "count_valid_tokens": "llama_cp.model.loss",
    "embedded_llama_config": "llama_cp.modules.causal_lm",
    "enable_chunked_loss": "llama_cp.model.loss",
    "end_distributed": "llama_cp.parallel.mesh",
    "export_pretrained": "llama_cp.train.export",
    "forward_backward": "llama_cp.optim.step",
    "gather_full_state_dict": "llama_cp.fsdp_wrap",
    "init_distributed": "llama_cp.parallel.mesh",
    "launch": "llama_cp.train.launcher",
    "linear_cross_entropy": "llama_cp.model.cross_entropy",
    "load_checkpoint": "llama_cp.train.checkpoint",
    "load_full_weights": "llama_cp.fsdp_wrap",
    "optimizer_step": "llama_cp.optim.step",
    "parallelize_model": "llama_cp.model.build",
    "resumable_checkpoint": "llama_cp.train.checkpoint_files",
    "save_checkpoint": "llama_cp.train.checkpoint",
    "shard_batch": "llama_cp.parallel.sharding",
    "shard_model": "llama_cp.fsdp_wrap",
    "unshard": "llama_cp.parallel.sharding",
}

__all__ = sorted(_MODULES)


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(f"module 'llama_cp' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULES[name]), name)
    globals()[name] = value  # read once: later reads are plain attribute lookups
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__version__ = "0.1.0"
