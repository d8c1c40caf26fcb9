"""llama-cp: long-context fine-tuning of HF Llama models with context parallelism on FSDP2."""

from llama_cp.cp_attention import ATTENTION_NAME, ContextParallelAttention, apply_context_parallel
from llama_cp.mesh import ParallelDims
from llama_cp.sharding import shard_batch, unshard

__all__ = [
    "ATTENTION_NAME",
    "ContextParallelAttention",
    "ParallelDims",
    "apply_context_parallel",
    "shard_batch",
    "unshard",
]

__version__ = "0.1.0"
