"""Document masks: rank imbalance of the zigzag layout on packed rows, and step time of packed
rows of short documents against one-document rows of the same length.

    python benchmarks/document_mask.py balance                     # analytic, seconds
    python benchmarks/document_mask.py speed --seq_lens 8192,16384 # 2 gloo ranks, CPU
    python benchmarks/document_mask.py gathers                     # fake tensors, a minute

``balance`` packs documents drawn from a few length mixes (Note [Packed rows] in
``llama_cp/data/packing.py``: a stream of documents cut into rows, a document continuing
into the next row) and counts, per cp rank, the (query, key) pairs its queries see
(``DocumentLayout.visible_pairs``): the attention work of the rank. It prints the
imbalance max/mean over the ranks (1.00 = balanced), averaged over rows and for the
worst row, and the work of the row relative to one document of the same length; then
the same imbalance for a whole training step of a Llama-3-8B-shaped model, whose dense
layers do the same work on every rank (an estimate from FLOP counts, not a measurement).
Both for the zigzag layout (ring, Ulysses) and for the all-gather strategy's
document-aware sharding (``shard_batch(layout="documents")``, each row on its own).

``calls`` counts the attention kernel calls of one layer's forward + backward on the busiest
cp rank, summed over the ring's steps, as the per-piece path makes them (CPU backends) and as
the varlen path does (flash_attn, sdpa_flash; Note [Varlen document calls] in
``llama_cp/attention/varlen.py``), with the default 16384-token attention blocks and untiled;
``--window N``: under a sliding window of N tokens (a piece the window cuts is a call per part).

``gathers`` plans (fake tensors, flash-attn's stand-in: what the memory planner runs) the peak of
one attention forward + backward over a packed row of the chat mix at cp 1, untiled: a call per
piece, varlen calls in windows of ``UNTILED_ROWS`` query rows (their gathered copies), the whole
row gathered at once, and one document (how the planner plans a row).

``bytes`` prints the bytes each cp rank sends per training step (forward + backward of every
layer) for each strategy on packed rows of each mix, from the formulas of Note [Ring
transfers] in ``llama_cp/attention/ring.py`` for Llama-3-8B shapes (bf16, float32 dK/dV), and
checks them on real gloo runs of the embedded Llama (4 ranks, cp 4, ``wire_bytes()``).

``windows`` prints the ring's bytes per rank per step with a sliding window on every layer
(Mistral 7B v0.1: 4096 tokens) against the same rows without one, from the same formulas
(``tests/attention/test_windows.py`` checks them on gloo ranks).

``strategies`` times one forward+backward step of the embedded Llama (fp32, batch 1, one
thread per rank) with each strategy at cp 2 and cp 4 (a world of cp gloo ranks), on a
one-document row and packed rows of the "chat" and "mixed" mixes.

``speed`` runs one forward+backward step of the embedded Llama with a cross-entropy
loss on one row (batch 1, fp32), at cp 1 (each of the 2 ranks holds the whole row)
and cp 2 (ring, Ulysses and all-gather on document shards), for a one-document row and for a packed row of the
"chat" mix, and prints step times and their ratio.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import time

import fire
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from llama_cp import ParallelDims, apply_context_parallel, shard_batch
from llama_cp.attention.documents import DocumentLayout, tiles
from llama_cp.attention.varlen import segments, varlen_windows
from llama_cp.modules.causal_lm import embedded_llama_config
from llama_cp.parallel.mesh import end_distributed, free_port
from llama_cp.parallel.sharding import document_starts, visible_pairs_per_token
from llama_cp.parallel.sharding import SEQ_INDEX, document_assignment

WORLD_SIZE = 2
#: Llama-3-8B-shaped FLOPs for the step-level estimate: fwd+bwd of the dense layers per token
#: (6 x ~7.5e9 parameters) and of attention per visible (query, key) pair (3 x 4 x d x layers).
LINEAR_FLOPS_PER_TOKEN = 6 * 7.5e9
ATTENTION_FLOPS_PER_PAIR = 3 * 4 * 4096 * 32

#: name -> (description, sampler of one document length given a generator and the row length)
MIXES = {
    "chat": ("log-normal, median 300 tokens, sigma 1.0 (SFT conversations)",
             lambda g, L: _lognormal(g, 300, 1.0, L)),
    "web": ("log-normal, median 1500 tokens, sigma 1.5 (long tail)",
            lambda g, L: _lognormal(g, 1500, 1.5, L)),
    "mixed": ("90% chat-like, 10% of L/2 to L tokens (long documents among short ones)",
              lambda g, L: _lognormal(g, 300, 1.0, L) if torch.rand((), generator=g) < 0.9
              else int(torch.randint(L // 2, L + 1, (), generator=g))),
    "halves": ("documents of L/3 to L tokens (few long documents per row)",
               lambda g, L: int(torch.randint(L // 3, L + 1, (), generator=g))),
}


def _lognormal(g: torch.Generator, median: float, sigma: float, limit: int) -> int:
    value = median * math.exp(sigma * float(torch.randn((), generator=g)))
    return max(1, min(limit, round(value)))


def packed_positions(mix: str, seq_len: int, rows: int, seed: int = 0) -> torch.Tensor:
    """(rows, seq_len) position_ids of a document stream of ``mix`` cut into rows."""
    g = torch.Generator().manual_seed(seed)
    sample = MIXES[mix][1]
    stream: list[torch.Tensor] = []
    total = 0
    while total < rows * seq_len:
        length = sample(g, seq_len)
        stream.append(torch.arange(length))
        total += length
    return torch.cat(stream)[: rows * seq_len].view(rows, seq_len)


def _imbalances(per_row: torch.Tensor, seq_len: int, cp: int) -> list[float]:
    """(rows, cp) visible pairs per rank -> attention imbalance (mean, worst row) and the
    8B step imbalance (mean, worst row), max/mean over the ranks."""
    attention = per_row.max(1).values / per_row.mean(1)
    step = seq_len / cp * LINEAR_FLOPS_PER_TOKEN + per_row * ATTENTION_FLOPS_PER_PAIR
    step = step.max(1).values / step.mean(1)
    return [float(attention.mean()), float(attention.max()), float(step.mean()), float(step.max())]


def _document_sharding_pairs(positions: torch.Tensor, cp: int) -> torch.Tensor:
    """(cp,) visible pairs per rank of one row under shard_batch(layout="documents")."""
    seq_len = positions.shape[-1]
    work = visible_pairs_per_token(document_starts(positions)).double()
    chunks = document_assignment(positions, cp)
    size = seq_len // sum(map(len, chunks))
    return torch.stack([sum(work[j * size : (j + 1) * size].sum() for j in rank) for rank in chunks])


def balance(seq_lens: str | int | tuple = "32768,131072", cps: str | int | tuple = "2,4,8", rows: int = 64) -> None:
    """Print the imbalance table (markdown): the zigzag (ring, Ulysses), and allgather's
    document-aware sharding (Note [Document-aware sharding])."""
    print("| mix | seq_len | cp | docs per row | attention work vs 1 doc | zigzag: attention imbalance mean "
          "| worst row | 8B step imbalance mean | worst row | allgather + document sharding: attention imbalance "
          "mean | worst row | 8B step imbalance mean | worst row |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mix in MIXES:
        for seq_len in _ints(seq_lens):
            positions = packed_positions(mix, seq_len, rows)
            starts = document_starts(positions)
            docs = float((starts == torch.arange(seq_len)).sum(1).float().mean())
            one_doc = seq_len * (seq_len + 1) / 2
            for cp in _ints(cps):
                zigzag = torch.stack([DocumentLayout(starts[r : r + 1], cp_size=cp).visible_pairs()
                                      for r in range(rows)]).double()  # (rows, cp)
                documents = torch.stack([_document_sharding_pairs(positions[r : r + 1], cp) for r in range(rows)])
                work = zigzag.sum(1).mean() / one_doc
                figures = _imbalances(zigzag, seq_len, cp) + _imbalances(documents, seq_len, cp)
                print(f"| {mix} | {seq_len} | {cp} | {docs:.1f} | {work:.3f} | "
                      + " | ".join(f"{x:.3f}" for x in figures) + " |")


def calls(mix: str = "chat", seq_len: int = 131072, cps: str | int | tuple = "1,2,4,8", rows: int = 8,
          block_sizes: str | int | tuple = "16384,0", window: int | None = None) -> None:
    """Print kernel calls per layer pass (forward + backward), per piece vs varlen (markdown);
    ``window``: a sliding window of that many tokens (a windowed piece is a call per part)."""
    print("| mix | seq_len | window | cp | block size | docs per row | calls per piece | varlen calls | fewer |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    starts = document_starts(packed_positions(mix, seq_len, rows))
    docs = float((starts == torch.arange(seq_len)).sum(1).float().mean())
    for cp in _ints(cps):
        for block_size in _ints(block_sizes):
            per_piece, varlen = torch.zeros(rows, cp), torch.zeros(rows, cp)
            for row, rank in itertools.product(range(rows), range(cp)):
                layout = DocumentLayout(starts[row : row + 1], cp_rank=rank, cp_size=cp)
                for source in range(cp):  # the ring's steps: every rank's K/V block once
                    block = tiles(layout.ring_pieces(source, window), block_size)
                    windows = varlen_windows(block)
                    calls_per_piece = sum(len(segments(p)) for p in block)
                    per_piece[row, rank] += 2 * calls_per_piece  # forward and backward
                    varlen[row, rank] += 2 * (calls_per_piece if windows is None else sum(map(len, windows)))
            before, after = (float(counts.max(1).values.mean()) for counts in (per_piece, varlen))  # busiest rank
            print(f"| {mix} | {seq_len} | {window or '-'} | {cp} | {block_size or 'untiled'} | {docs:.1f} "
                  f"| {before:.0f} | {after:.1f} | {before / after:.0f}x |")


#: Llama-3-8B attention shapes for the bytes table
LLAMA3_8B = dict(layers=32, heads=32, kv_heads=8, head_dim=128, itemsize=2)
STRATEGIES = ("ring, every block", "ring", "ulysses", "allgather", "hybrid u=2")


def step_bytes(strategy: str, starts: torch.Tensor, cp: int, *, layers: int, heads: int, kv_heads: int,
               head_dim: int, itemsize: int, acc_itemsize: int = 4, window: int | None = None) -> torch.Tensor:
    """(cp,) bytes each rank sends in one forward + backward of (B, L) rows with document
    ``starts``; "ring, every block" is the neighbour ring without skipping; "hybrid u=2":
    Ulysses over pairs of ranks, the ring of cp / 2 over the pairs; ``window``: every layer's
    sliding window (the ring skips what it does not reach)."""
    batch, seq_len = starts.shape
    shard = batch * (seq_len // cp) * head_dim  # elements of one head of a rank's shard
    if strategy.startswith("hybrid"):
        u = int(strategy.split("=")[1])
        repeat = u // math.gcd(kv_heads, u)
        all_to_all = 2 * (2 * heads + 2 * kv_heads * repeat) * shard * itemsize * (u - 1) // u
        ring = step_bytes("ring", starts, cp // u, layers=1, heads=heads // u, kv_heads=kv_heads * repeat // u,
                          head_dim=head_dim, itemsize=itemsize, acc_itemsize=acc_itemsize, window=window)
        return layers * (all_to_all + ring.repeat_interleave(u))
    kv, dkv = 2 * kv_heads * shard * itemsize, 2 * kv_heads * shard * acc_itemsize
    ranks = torch.arange(cp)
    if strategy == "ulysses":
        repeat = cp // math.gcd(kv_heads, cp)
        per_rank = 2 * (2 * heads + 2 * kv_heads * repeat) * shard * itemsize * (cp - 1) // cp
    elif strategy == "allgather":
        per_rank = (cp - 1) * (2 * kv + dkv)
    else:
        layout = DocumentLayout(starts, cp_size=cp)
        if cp == 1:
            per_rank = 0
        elif strategy == "ring, every block" or layout.ring_dense(window):
            per_rank = 2 * (cp - 1) * kv + cp * dkv
        else:
            sends = torch.tensor([sum(layout.sees(t, r, window) for t in range(cp) if t != r) for r in range(cp)])
            receives = torch.tensor([sum(layout.sees(r, s, window) for s in range(cp) if s != r) for r in range(cp)])
            return layers * (2 * sends * kv + receives * dkv)
    return layers * torch.full_like(ranks, per_rank)


def bytes(seq_len: int = 131072, cps: str | int | tuple = "2,4,8", rows: int = 16, check_seq_len: int = 4096) -> None:
    """Print bytes sent per rank per step (markdown), then check the formulas on 4 gloo ranks."""
    print(f"Llama-3-8B shapes, {seq_len} tokens per row, GiB sent per rank per step (mean over ranks and "
          f"{rows} rows; busiest rank in brackets):\n")
    print("| mix | cp | " + " | ".join(STRATEGIES) + " |")
    print("|---|---:|" + "---:|" * len(STRATEGIES))
    for mix in MIXES:
        starts = document_starts(packed_positions(mix, seq_len, rows))
        for cp in _ints(cps):
            cells = []
            for strategy in STRATEGIES:
                sent = torch.stack([step_bytes(strategy, starts[r : r + 1], cp, **LLAMA3_8B) for r in range(rows)])
                sent = sent.double() / 2**30
                cells.append(f"{float(sent.mean()):.2f} ({float(sent.max(1).values.mean()):.2f})")
            print(f"| {mix} | {cp} | " + " | ".join(cells) + " |")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_bytes_worker, args=(free_port(), check_seq_len), nprocs=4, start_method="spawn")


def _bytes_worker(rank: int, port: int, seq_len: int) -> None:
    from llama_cp.attention.wire import wire_bytes

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    mesh = ParallelDims(cp=4).build_mesh("cpu")["cp"]
    config = embedded_llama_config()
    shapes = dict(layers=config.num_hidden_layers, heads=config.num_attention_heads,
                  kv_heads=config.num_key_value_heads, itemsize=4,
                  head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    lines = []
    for mix in MIXES:
        positions = packed_positions(mix, seq_len, 1, seed=1)
        input_ids = torch.randint(0, config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
        full = {"input_ids": input_ids, "labels": torch.roll(input_ids, -1, 1), "position_ids": positions}
        for strategy in STRATEGIES[1:]:
            torch.manual_seed(0)
            name, _, u = strategy.partition(" u=")
            model = apply_context_parallel(LlamaForCausalLM(config), mesh, strategy=name, ulysses_degree=int(u or 0))
            batch = shard_batch(full, mesh, layout="documents" if strategy == "allgather" else "zigzag")
            with wire_bytes() as meter:
                _step(model, batch)
            measured = torch.tensor([sum(meter.sent.values())], dtype=torch.float64)
            every = [torch.zeros_like(measured) for _ in range(4)]
            dist.all_gather(every, measured)
            formula = step_bytes(strategy, document_starts(positions), 4, **shapes)
            lines.append(f"| {mix} | {strategy} | {' / '.join(str(int(x)) for x in torch.cat(every))} | "
                         f"{' / '.join(str(int(x)) for x in formula)} |")
    if rank == 0:
        print(f"\nChecked on 4 gloo ranks (cp 4, the embedded Llama in fp32, {seq_len} tokens), bytes per rank "
              "(ranks 0 / 1 / 2 / 3):\n")
        print("| mix | strategy | measured | formula |")
        print("|---|---|---|---|")
        print("\n".join(lines))
    end_distributed()  # Note [Leaving a gloo job] in llama_cp/parallel/mesh.py


#: Mistral 7B v0.1: Llama-3-8B's attention shapes, every layer a 4096-token sliding window.
MISTRAL_7B = dict(LLAMA3_8B)


def windows(seq_len: int = 131072, window: int = 4096, cps: str | int | tuple = "2,4,8,16", rows: int = 4) -> None:
    """Print the ring's bytes per rank per step with a sliding window on every layer (Mistral 7B
    v0.1 shapes), against the same rows without it (Note [Sliding windows under CP])."""
    print(f"Mistral 7B v0.1 shapes (32 layers, 8 KV heads of 128, bf16), {seq_len} tokens per row, GiB sent per "
          f"rank per step by the ring, without and with a {window}-token window on every layer (mean over ranks "
          f"and {rows} rows; busiest rank in brackets):\n")
    print("| rows | cp | no window | window |")
    print("|---|---:|---:|---:|")
    for mix in ("one document", *MIXES):
        starts = (torch.zeros(rows, seq_len, dtype=torch.long) if mix == "one document"
                  else document_starts(packed_positions(mix, seq_len, rows)))
        for cp in _ints(cps):
            cells = []
            for w in (None, window):
                sent = torch.stack([step_bytes("ring", starts[r : r + 1], cp, **MISTRAL_7B, window=w)
                                    for r in range(rows)]).double() / 2**30
                cells.append(f"{float(sent.mean()):.2f} ({float(sent.max(1).values.mean()):.2f})")
            print(f"| {mix} | {cp} | " + " | ".join(cells) + " |")


def strategies(seq_len: int = 8192, cps: str | int | tuple = "2,4", steps: int = 2) -> None:
    """Print step times per strategy (markdown), a world of cp gloo ranks per cp."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"{seq_len} tokens per row, embedded Llama, fp32, seconds per step (slowest rank):\n")
    print("| cp | strategy | 1 document | chat mix | mixed mix |")
    print("|---:|---|---:|---:|---:|")
    for cp in _ints(cps):
        mp.start_processes(_strategies_worker, args=(cp, free_port(), seq_len, steps), nprocs=cp, start_method="spawn")


def _strategies_worker(rank: int, cp: int, port: int, seq_len: int, steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cp)
    mesh = ParallelDims(cp=cp).build_mesh("cpu")["cp"]
    config = embedded_llama_config()
    input_ids = torch.randint(0, config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
    layouts = {"1 document": torch.arange(seq_len)[None], "chat": packed_positions("chat", seq_len, 1),
               "mixed": packed_positions("mixed", seq_len, 1, seed=1)}
    choices = [("ring", 0), ("ulysses", 0), ("allgather", 0)] + ([("hybrid", 2)] if cp > 2 else [])
    for strategy, u in choices:
        torch.manual_seed(0)
        model = apply_context_parallel(LlamaForCausalLM(config), mesh, strategy=strategy, ulysses_degree=u)
        times = []
        for positions in layouts.values():
            full = {"input_ids": input_ids, "labels": torch.roll(input_ids, -1, 1), "position_ids": positions}
            batch = shard_batch(full, mesh, layout="documents" if strategy == "allgather" else "zigzag")
            times.append(_step_time(model, batch, steps))
        if rank == 0:
            name = f"hybrid u={u}" if u else strategy
            print(f"| {cp} | {name} | " + " | ".join(f"{t:.2f}" for t in times) + " |", flush=True)
    end_distributed()  # Note [Leaving a gloo job] in llama_cp/parallel/mesh.py


def _step(model, batch):
    extra = {SEQ_INDEX: batch[SEQ_INDEX]} if SEQ_INDEX in batch else {}
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], **extra).logits
    F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten()).backward()
    model.zero_grad(set_to_none=True)


def _step_time(model, batch, steps: int) -> float:
    """Seconds per step of the slowest rank, after one warm-up step."""
    _step(model, batch)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        _step(model, batch)
    t = torch.tensor([(time.perf_counter() - start) / steps], dtype=torch.float64)
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
        layouts = {"1 document": torch.arange(seq_len)[None], "chat mix": packed_positions("chat", seq_len, 1)}
        for cp, strategy in ((1, "-"), (2, "ring"), (2, "ulysses"), (2, "allgather")):
            torch.manual_seed(0)
            model = apply_context_parallel(LlamaForCausalLM(config), meshes[cp], strategy="ring" if cp == 1 else strategy)
            times = {}
            for name, positions in layouts.items():
                full = {"input_ids": input_ids, "labels": torch.roll(input_ids, -1, 1), "position_ids": positions}
                batch = shard_batch(full, meshes[cp], layout="documents" if strategy == "allgather" else "zigzag")
                times[name] = _step_time(model, batch, steps)
            docs = int((document_starts(layouts["chat mix"]) == torch.arange(seq_len)).sum())
            rows.append((seq_len, cp, strategy, docs, times["1 document"], times["chat mix"]))
    if rank == 0:
        print("| seq_len | cp | strategy | docs in the packed row | 1 document (s) | packed (s) | speed-up |")
        print("|---:|---:|---|---:|---:|---:|---:|")
        for seq_len, cp, strategy, docs, one, packed in rows:
            print(f"| {seq_len} | {cp} | {strategy} | {docs} | {one:.2f} | {packed:.2f} | {one / packed:.2f}x |")
    end_distributed()  # Note [Leaving a gloo job] in llama_cp/parallel/mesh.py


def gathers(seq_len: int = 65536, heads: int = 32, kv_heads: int = 8, head_dim: int = 128) -> None:
    """Print the planned peak of one packed row's attention forward + backward by path (markdown)."""
    from unittest import mock

    from torch._subclasses.fake_tensor import FakeTensorMode

    from llama_cp.attention import pieces, varlen
    from llama_cp.attention.workspace import ModelledBackend
    from llama_cp.plan.memory import track_peak_memory

    starts = document_starts(packed_positions("chat", seq_len, 1))
    documents = int((starts == torch.arange(seq_len)).sum())
    packed = DocumentLayout(starts).full_row_pieces()
    one = DocumentLayout(torch.zeros_like(starts)).full_row_pieces()
    paths = {"a call per piece": (packed, mock.patch.object(varlen, "varlen_windows", lambda block: None)),
             f"varlen, windows of {varlen.UNTILED_ROWS} rows": (packed, contextlib.nullcontext()),
             "varlen, the whole row gathered": (packed, mock.patch.object(varlen, "UNTILED_ROWS", seq_len)),
             "one document (the planner's row)": (one, contextlib.nullcontext())}
    print(f"| path ({seq_len} tokens, {documents} documents, {heads}/{kv_heads} heads of {head_dim}) | peak GiB |")
    print("|---|---:|")
    for name, (block, path) in paths.items():
        with path, FakeTensorMode():
            q = torch.empty(1, heads, seq_len, head_dim, dtype=torch.bfloat16).requires_grad_()
            k, v = (torch.empty(1, kv_heads, seq_len, head_dim, dtype=torch.bfloat16).requires_grad_() for _ in "kv")
            with track_peak_memory() as peak:
                out = pieces.pieces_attention(q, k, v, block, scale=head_dim**-0.5,
                                              backend=ModelledBackend("flash_attn"))
                out.backward(torch.empty_like(out))
        print(f"| {name} | {peak['Total'] / 2**30:.2f} |")


def speed(seq_lens: str | int | tuple = "8192,16384", steps: int = 2) -> None:
    """Print step times of one-document vs packed rows (markdown), on 2 gloo ranks."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_worker, args=(free_port(), _ints(seq_lens), steps), nprocs=WORLD_SIZE, start_method="spawn")


def _ints(value) -> list[int]:
    """fire turns "1024" into an int and "1024,2048" into a tuple."""
    if isinstance(value, int):
        return [value]
    return [int(x) for x in (value.split(",") if isinstance(value, str) else value)]


if __name__ == "__main__":
    fire.Fire({"balance": balance, "calls": calls, "gathers": gathers, "bytes": bytes, "windows": windows,
               "strategies": strategies, "speed": speed})
