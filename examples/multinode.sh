#!/usr/bin/env bash
# Two nodes x 8 GPUs: run this on every node (NODE_RANK 0 and 1, MASTER_ADDR = node 0's address).
# The context is split 16 ways (cp=16); HSDP would instead replicate across nodes (--dp_replicate 2).
set -euo pipefail
torchrun \
    --nnodes 2 --nproc_per_node 8 --node_rank "${NODE_RANK}" \
    --rdzv_backend c10d --rdzv_endpoint "${MASTER_ADDR}:29500" \
    -m recipes.finetune_longctx --config configs/llama3_8b_lora_128k.yaml \
    --cp 16 --context_length 262144 "$@"
