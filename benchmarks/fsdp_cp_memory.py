"""Per-rank memory of one training step: FSDP only vs FSDP + CP, small Llama, CPU.

    python benchmarks/fsdp_cp_memory.py                  # L = 4096 and 8192
    python benchmarks/fsdp_cp_memory.py --seq_lens 2048

Two gloo ranks (one thread each). Both layouts shard parameters, gradients and
AdamW state over the same 2 ranks; they differ in what each rank does with a
sequence of L tokens:

- FSDP only   (dp_shard=2, cp=1): each rank runs its own whole sequence,
- FSDP + CP   (dp_shard=1, cp=2): the two ranks split one sequence (ring).

A step = chunked-loss forward + backward + AdamW step, fp32, no activation
checkpointing; the second step is tracked (the optimizer state exists by
then). "sharded params" and "AdamW state" are the local shard sizes; the
other columns are tracked tensor by tensor (torch's MemTracker, deterministic
on CPU) at the peak of the total, where gathered (unsharded) parameters count
as parameters. Reported as the maximum over ranks.
"""

from __future__ import annotations


import fire
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaForCausalLM

from llama_cp import (
    ParallelDims, apply_context_parallel, count_valid_tokens, enable_chunked_loss, optimizer_step, shard_batch,
    shard_model,
)
from llama_cp.modules.causal_lm import embedded_llama_config
from llama_cp.parallel.mesh import end_distributed, free_port
from llama_cp.plan.memory import track_peak_memory

WORLD_SIZE = 2
MiB = 1 << 20
LAYOUTS = (("FSDP only", dict(dp_shard=2, cp=1)), ("FSDP + CP", dict(dp_shard=1, cp=2)))


def _max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _step(model, optimizer, batch):
    optimizer_step(model, optimizer, [batch], count_valid_tokens([batch["labels"]]), max_grad_norm=0.0)


def _worker(rank: int, port: int, seq_lens: list[int], activation_checkpointing: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    config = embedded_llama_config()
    rows = []
    for seq_len in seq_lens:
        tokens = torch.randint(0, config.vocab_size, (1, seq_len + 1), generator=torch.Generator().manual_seed(0))
        full = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
        for name, degrees in LAYOUTS:
            mesh = ParallelDims(**degrees).build_mesh("cpu")
            torch.manual_seed(0)
            model = LlamaForCausalLM(config)
            apply_context_parallel(model, mesh["cp"], strategy="ring")
            enable_chunked_loss(model, chunk_size=1024)
            shard_model(model, mesh, activation_checkpointing=activation_checkpointing)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            batch = shard_batch(full, mesh["cp"])
            _step(model, optimizer, batch)  # creates the optimizer state
            with track_peak_memory(model, optimizer) as peak:
                _step(model, optimizer, batch)
            sharded = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
            optim = sum(
                s.to_local().numel() * s.element_size() for st in optimizer.state.values() for k, s in st.items() if k != "step"
            )
            acts = peak["Activation"] + peak["Temp"]
            params, grads, total = peak["Parameter"], peak["Gradient"], peak["Total"]
            rows.append((seq_len, name, *_max_over_ranks([sharded, optim, params, grads, acts, total])))
    if rank == 0:
        print("| seq_len | layout | sharded params | AdamW state | params at peak | grads at peak | activations + temp at peak | peak total |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|")
        for seq_len, name, *values in rows:
            print(f"| {seq_len} | {name} | " + " | ".join(f"{v / MiB:.1f} MiB" for v in values) + " |")
    end_distributed()  # Note [Leaving a gloo job] in llama_cp/parallel/mesh.py


def main(seq_lens: str | int | tuple = "4096,8192", activation_checkpointing: bool = False) -> None:
    if isinstance(seq_lens, str):
        seq_lens = seq_lens.split(",")
    lengths = [int(x) for x in ([seq_lens] if isinstance(seq_lens, int) else seq_lens)]
    port = free_port()
    mp.start_processes(_worker, args=(port, lengths, activation_checkpointing), nprocs=WORLD_SIZE, start_method="spawn")


if __name__ == "__main__":
    fire.Fire(main)
