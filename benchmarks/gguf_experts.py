"""GGUF export of an expert model at a real model's shapes: seconds and the writer's peak host memory.
python benchmarks/gguf_experts.py --workdir DIR [--layers 2] [--types q8_0,f16]

Builds Qwen3-30B-A3B's shapes (hidden 2048, 128 experts of 768, 151,936 tokens of vocabulary) cut to
--layers decoder layers, in bfloat16 with random weights, saves it as transformers does (each expert's
projections apart), then writes each type in a fresh process, as --export_gguf does. The writer holds
one tensor at a time (Note [Writing a GGUF one tensor at a time] in llama_cp/train/gguf_export.py), a
layer's stacked experts of one projection for the experts, so its peak should be the largest tensor in
float32 plus its bfloat16 source, whatever the number of layers."""

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build(directory: str, layers: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from gguf_files import small_tokenizer  # a byte-level BPE; the vocabulary rows past it are padding

    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.set_default_dtype(torch.bfloat16)
    model = AutoModelForCausalLM.from_config(config)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, {layers} layers -> {directory}")
    model.save_pretrained(directory)
    small_tokenizer().save_pretrained(directory)


def write(directory: str, out: str, outtype: str) -> None:
    from llama_cp.train.gguf_export import write_gguf

    start = time.perf_counter()
    write_gguf(directory, out, outtype)
    # VmHWM: this process's own peak (getrusage's maxrss would count the parent's pages from before the exec)
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    print(f"{outtype}: {time.perf_counter() - start:.1f} s, peak RSS {peak / 2**30:.2f} GiB, "
          f"file {os.path.getsize(out) / 2**30:.2f} GiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--types", default="q8_0,f16")
    parser.add_argument("--write", nargs=2, metavar=("DIR", "TYPE"), help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.write:
        directory, outtype = args.write
        write(directory, os.path.join(args.workdir, f"model-{outtype}.gguf"), outtype)
        return
    directory = os.path.join(args.workdir, "hf")
    if not os.path.isdir(directory):
        build(directory, args.layers)
    for outtype in args.types.split(","):
        target = os.path.join(args.workdir, f"model-{outtype}.gguf")
        if os.path.exists(target):
            os.remove(target)
        subprocess.run([sys.executable, __file__, "--workdir", args.workdir, "--write", directory, outtype], check=True,
                       env={**os.environ, "PYTHONPATH": ROOT})


if __name__ == "__main__":
    main()
