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

from llama_cp.config import TrainConfig
from llama_cp.cp_attention import apply_context_parallel
from llama_cp.data.loader import DistributedRowLoader, build_rows
from llama_cp.fsdp_wrap import activation_offload, gather_full_state_dict, load_full_weights, shard_model
from llama_cp.model.build import build_model, parallelize_model
from llama_cp.model.loss import causal_lm_loss_sum, count_valid_tokens, enable_chunked_loss, linear_cross_entropy
from llama_cp.modules.causal_lm import build_causal_lm, embedded_llama_config
from llama_cp.optim.optimizers import build_optimizer
from llama_cp.optim.step import forward_backward, optimizer_step
from llama_cp.parallel.mesh import ParallelDims, end_distributed, init_distributed
from llama_cp.parallel.sharding import shard_batch, unshard
from llama_cp.train.checkpoint import load_checkpoint, resumable_checkpoint, save_checkpoint
from llama_cp.train.export import export_pretrained
from llama_cp.train.launcher import launch
from llama_cp.train.trainer import Trainer

__all__ = [
    "DistributedRowLoader",
    "ParallelDims",
    "TrainConfig",
    "Trainer",
    "activation_offload",
    "apply_context_parallel",
    "build_causal_lm",
    "build_model",
    "build_optimizer",
    "build_rows",
    "causal_lm_loss_sum",
    "count_valid_tokens",
    "embedded_llama_config",
    "enable_chunked_loss",
    "end_distributed",
    "export_pretrained",
    "forward_backward",
    "gather_full_state_dict",
    "init_distributed",
    "launch",
    "linear_cross_entropy",
    "load_checkpoint",
    "load_full_weights",
    "optimizer_step",
    "parallelize_model",
    "resumable_checkpoint",
    "save_checkpoint",
    "shard_batch",
    "shard_model",
    "unshard",
]

__version__ = "0.1.0"
