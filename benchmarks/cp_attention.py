"""Per-rank peak memory and step time of context-parallel attention, small Llama, CPU.

    python benchmarks/cp_attention.py                       # 2 gloo ranks, L = 2048, 4096, 8192
    python benchmarks/cp_attention.py --seq_lens 1024,2048 --steps 3

Spawns two ranks (one thread each, for a 2-core machine) and runs, for every
sequence length, one forward+backward step of the embedded Llama
(``llama_cp.modules.causal_lm.EMBEDDED_LLAMA``) with a cross-entropy loss:

- cp=1: each rank holds the whole sequence (the two ranks are data parallel),
- cp=2 ring and cp=2 ulysses: each rank holds half of it.

Memory is tracked tensor by tensor (torch's MemTracker, not RSS), from the
start of the forward to the end of the backward, and reported as the maximum
over ranks. "activations" is the peak of activation + temporary bytes.
"""

from __future__ import annotations

import os
import time

import fire
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from llama_cp import ParallelDims, apply_context_parallel, shard_batch
from llama_cp.modules.causal_lm import embedded_llama_config
from llama_cp.parallel.mesh import end_distributed, free_port
from llama_cp.plan.memory import track_peak_memory

WORLD_SIZE = 2
MiB = 1 << 20


def _step(model, batch):
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
    loss.backward()
    model.zero_grad(set_to_none=True)


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _worker(rank: int, port: int, seq_lens: list[int], steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    meshes = {cp: ParallelDims(cp=cp).build_mesh("cpu")["cp"] for cp in (1, 2)}
    config = embedded_llama_config()
    rows = []
    for seq_len in seq_lens:
        g = torch.Generator().manual_seed(seq_len)
        input_ids = torch.randint(0, config.vocab_size, (1, seq_len), generator=g)
        full = {"input_ids": input_ids, "labels": torch.roll(input_ids, -1, 1)}
        for cp, strategy in ((1, "-"), (2, "ring"), (2, "ulysses")):
            torch.manual_seed(0)
            model = LlamaForCausalLM(config)
            apply_context_parallel(model, meshes[cp], strategy="ring" if cp == 1 else strategy)
            batch = shard_batch(full, meshes[cp])
            _step(model, batch)  # warm-up
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                _step(model, batch)
            step_s = _max_over_ranks((time.perf_counter() - start) / steps)
            with track_peak_memory(model) as peak:
                _step(model, batch)
            activations = _max_over_ranks(peak["Activation"] + peak["Temp"])
            total = _max_over_ranks(peak["Total"])
            rows.append((seq_len, cp, strategy, step_s, seq_len / cp / step_s, total / MiB, activations / MiB))
    if rank == 0:
        print("| seq_len | cp | strategy | step (s) | tokens/s per rank | peak per rank (MiB) | activations per rank (MiB) | activations / cp=1 |")
        print("|---:|---:|---|---:|---:|---:|---:|---:|")
        baseline = {}
        for seq_len, cp, strategy, step_s, tps, total, act in rows:
            baseline.setdefault(seq_len, act)
            print(
                f"| {seq_len} | {cp} | {strategy} | {step_s:.2f} | {tps:.0f} | {total:.1f} | {act:.1f} "
                f"| {act / baseline[seq_len]:.3f} |"
            )
    end_distributed()  # Note [Leaving a gloo job] in llama_cp/parallel/mesh.py


def main(seq_lens: str | int | tuple = "2048,4096,8192", steps: int = 2) -> None:
    # fire turns "1024" into an int and "1024,2048" into a tuple
    lengths = [int(x) for x in (seq_lens.split(",") if isinstance(seq_lens, str) else [seq_lens] if isinstance(seq_lens, int) else seq_lens)]
    port = free_port()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_worker, args=(port, lengths, steps), nprocs=WORLD_SIZE, start_method="spawn")


if __name__ == "__main__":
    fire.Fire(main)
