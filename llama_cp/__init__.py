"""llama-cp: long-context fine-tuning of HF Llama models with context parallelism on FSDP2."""

from llama_cp.cp_attention import ATTENTION_NAME, ContextParallelAttention, apply_context_parallel
from llama_cp.fsdp_wrap import activation_offload, export_pretrained, gather_full_state_dict, load_full_weights, shard_model
from llama_cp.loss import causal_lm_loss_sum, count_valid_tokens, enable_chunked_loss, linear_cross_entropy
from llama_cp.config import TrainConfig
from llama_cp.mesh import ParallelDims
from llama_cp.trainer import Trainer
from llama_cp.sharding import shard_batch, unshard

__all__ = [
    "ATTENTION_NAME",
    "ContextParallelAttention",
    "ParallelDims",
    "TrainConfig",
    "Trainer",
    "activation_offload",
    "apply_context_parallel",
    "causal_lm_loss_sum",
    "count_valid_tokens",
    "enable_chunked_loss",
    "export_pretrained",
    "gather_full_state_dict",
    "linear_cross_entropy",
    "load_full_weights",
    "shard_batch",
    "shard_model",
    "unshard",
]

__version__ = "0.1.0"
