"""AdamW on the CPU, as --offload_params runs it: seconds per step and the step's extra host memory
for torch's three implementations (single-tensor loop, foreach, fused), float32, over tensors of
Llama-3-8B's decoder-layer shapes. python benchmarks/cpu_adamw.py [--layers 2] [--threads N]

Prints one row per implementation and how far each one's parameters are from the loop's after the
steps (the same math, in another order of operations)."""

import argparse
import resource
import time

import torch

#: One Llama-3-8B decoder layer's matrices (q, k, v, o, gate, up, down) and its two norms.
LAYER = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336),
         (4096,), (4096,)]


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run(kind: str, layers: int, steps: int) -> tuple[float, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=generator).requires_grad_() for _ in range(layers) for shape in LAYER]
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator) * 1e-3
    options = {"loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}[kind]
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, **options)
    optimizer.step()  # the state is allocated here, not timed
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    return (time.perf_counter() - start) / steps, [p.detach() for p in params]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    numel = args.layers * sum(torch.Size(shape).numel() for shape in LAYER)
    print(f"torch {torch.__version__}, {args.threads} threads, {numel / 1e6:.0f}M float32 parameters "
          f"({args.layers} Llama-3-8B layers), {args.steps} timed steps")
    reference = None
    for kind in ("loop", "foreach", "fused"):
        seconds, params = run(kind, args.layers, args.steps)
        if reference is None:
            reference = params
        diff = max((a - b).abs().max().item() for a, b in zip(params, reference))
        print(f"  {kind:<8} {seconds:7.3f} s/step  {seconds / numel * 1e9:6.2f} ns/parameter  "
              f"{numel * 8 / seconds / 1e9:5.2f} GB/s of state  largest difference from the loop {diff:.1e}")
    print(f"  (peak RSS of the process: {peak_rss_bytes() / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
