"""A small long-context training demo on the embedded Llama (no download).

    python -m recipes.cp_demo                                           # one process
    torchrun --standalone --nproc_per_node 2 -m recipes.cp_demo --cp 2 --context_length 8192

The whole stack on a toy task: context-parallel attention, the chunked loss
and FSDP2 over the dp_shard x cp mesh. Every sample is one fixed random block
of 128 tokens repeated to fill the context; the loss falls as the model
learns it. The fine-tuning recipe proper will be ``recipes/finetune_longctx.py``.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import fire
import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import LlamaForCausalLM

from llama_cp import (
    ParallelDims, apply_context_parallel, causal_lm_loss_sum, count_valid_tokens, enable_chunked_loss,
    shard_batch, shard_model,
)
from llama_cp.memory import track_peak_memory
from llama_cp.mesh import init_distributed
from llama_cp.models import embedded_llama_config


def make_sample(context_length: int, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    """One repeated-block sample; labels are pre-shifted (labels[t] = input_ids[t+1])."""
    g = torch.Generator().manual_seed(seed)
    block = torch.randint(0, vocab_size, (128,), generator=g)
    tokens = block.repeat(context_length // 128 + 2)[: context_length + 1]
    return {"input_ids": tokens[:-1].unsqueeze(0), "labels": tokens[1:].unsqueeze(0)}


def main(
    context_length: int = 4096,
    cp: int | None = None,
    cp_strategy: str = "ring",
    steps: int = 30,
    lr: float = 2e-3,
    seed: int = 0,
) -> None:
    device_type = init_distributed()
    dims = ParallelDims(cp=cp or dist.get_world_size())
    mesh = dims.build_mesh(device_type)
    rank = dist.get_rank()
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    config = embedded_llama_config()

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(device)
    apply_context_parallel(model, mesh["cp"], strategy=cp_strategy)
    enable_chunked_loss(model)
    shard_model(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    progress = tqdm(range(steps), disable=rank != 0, desc=f"cp={dims.cp} {cp_strategy} L={context_length}")
    first_loss = peak = None
    for step in progress:
        sample = make_sample(context_length, config.vocab_size, seed=seed)
        batch = {k: v.to(device) for k, v in shard_batch(sample, mesh["cp"]).items()}
        start = time.perf_counter()
        tracking = track_peak_memory(model, optimizer, device_type=device_type) if step == 0 else nullcontext()
        with tracking as memory:
            loss = causal_lm_loss_sum(model, batch) / count_valid_tokens([batch["labels"]])
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        tokens_per_s = context_length / dims.cp / (time.perf_counter() - start)
        if step == 0:
            peak, first_loss = memory["Total"], loss.item()
        progress.set_postfix(loss=f"{loss.item():.3f}", tok_s_rank=f"{tokens_per_s:.0f}")
    if rank == 0:
        print(
            f"loss {first_loss:.3f} -> {loss.item():.3f}; {tokens_per_s:.0f} tokens/s per rank; "
            f"peak tracked memory of rank 0 (step 0) {peak / 2**20:.1f} MiB"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    fire.Fire(main)
