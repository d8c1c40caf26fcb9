"""Tiled local attention (``--attention_block_size``, Note [Tiled attention] in
``llama_cp/attention/documents.py``): time and tracked peak memory of one causal forward+backward of
the local attention, untiled against tiled, in one CPU process.

    python benchmarks/attention_blocks.py                                  # sdpa_cpu, L = 4096
    python benchmarks/attention_blocks.py --backend math --seq_len 2048 --block_sizes 0,1024,512

Shapes are one row of a small GQA model: 8 query heads, 2 KV heads, head size 64, fp32.
Memory is torch's MemTracker peak of the tensors allocated in the call (inputs excluded);
time is the median of ``--repeats`` runs after one warm-up. torch's CPU flash kernel keeps its
workspace in per-thread buffers the tracker does not see, so with ``sdpa_cpu`` the memory
column shows what llama-cp itself allocates (accumulators, tiles); the math kernel's (Sq, Sk)
score matrices show the per-call workspace that tiling bounds.
"""

from __future__ import annotations

import statistics
import time

import fire
import torch

from llama_cp.attention.local import local_attention
from llama_cp.plan.memory import track_peak_memory

MiB = 1 << 20


def measure(q, k, v, dout, *, backend: str, block_size: int, repeats: int) -> tuple[float, int]:
    """(median seconds, tracked peak bytes) of forward+backward."""

    def step():
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        out = local_attention(*inputs, causal=True, scale=q.shape[-1] ** -0.5, backend=backend,
                              block_size=block_size)
        out.backward(dout)

    step()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    with track_peak_memory() as peak:
        step()
    return statistics.median(times), peak["Total"]


def main(backend: str = "sdpa_cpu", seq_len: int = 4096, block_sizes: str = "0,2048,1024,512",
         repeats: int = 3, threads: int = 2) -> None:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, seq_len, 64, generator=g)
    k, v = (torch.randn(1, 2, seq_len, 64, generator=g) for _ in range(2))
    dout = torch.randn(q.shape, generator=g)
    sizes = list(block_sizes) if isinstance(block_sizes, tuple) else [int(s) for s in str(block_sizes).split(",")]
    print(f"backend {backend}, L = {seq_len}, 8 heads / 2 KV heads of 64, fp32, {threads} threads")
    print(f"{'block':>7} {'fwd+bwd s':>10} {'vs untiled':>10} {'peak MiB':>9}")
    base = None
    for size in sizes:
        seconds, peak = measure(q, k, v, dout, backend=backend, block_size=size, repeats=repeats)
        base = base or seconds
        print(f"{size or 'off':>7} {seconds:10.3f} {seconds / base:10.2f} {peak / MiB:9.1f}")


if __name__ == "__main__":
    fire.Fire(main)
