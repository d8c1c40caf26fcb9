"""A local HF model directory for the GPU checks (benchmarks/*_gpu_check.sh): a Llama of 8 layers,
hidden 1024, 16 / 4 heads, 110M parameters, random weights (seed 0) in bf16, and the byte
tokenizer. python3 benchmarks/local_model.py /tmp/model"""

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from llama_cp.data.tokenizer import byte_tokenizer

if __name__ == "__main__":
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=4, head_dim=64, max_position_embeddings=65536,
                         rope_theta=500000.0, bos_token_id=257, eos_token_id=258)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(sys.argv[1])
    byte_tokenizer().save_pretrained(sys.argv[1])
