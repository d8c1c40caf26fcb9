"""Does llama-cp work on this GPU machine? One command, 1-8 CUDA GPUs, a JSON file and a table.

    python benchmarks/gpu_acceptance.py                       # every GPU of the machine
    python benchmarks/gpu_acceptance.py --nproc 4 --output_dir acceptance/
    python benchmarks/gpu_acceptance.py --dry_run             # CPU, gloo, 2 ranks, tiny shapes (CI)

It starts its own ranks (one process per GPU, torchrun's environment, as
``llama_cp.launcher`` does) and writes ``gpu_acceptance.json`` and
``gpu_acceptance.md`` into ``--output_dir``:

1. exactness: ring and Ulysses at cp = N, one document and packed documents, in bf16,
   against single-GPU transformers on the same weights and rows: the loss, the logits
   and every parameter's gradient, as relative errors against transformers in fp32.
   The yardstick is transformers' own bf16 error against fp32 on the same data: a CP
   run passes when its error is at most twice that (plus 1e-3 for the loss, whose
   error can be ~0 by chance).
2. memory: a Llama-3-8B-shaped model cut to ``--layers`` decoder layers at 32K-512K
   tokens on N GPUs (cp = N), each lever (none, activation checkpointing, + offloaded
   checkpoints, + tiled MLP and norms, LoRA): the planner's per-step peak
   (``llama_cp.memory.plan_step_memory``, the ``recipes/plan_memory`` figures) against
   ``torch.cuda.max_memory_allocated`` of a real step, reset before it.
3. speed: tokens/s/GPU, model TFLOP/s/GPU and MFU (Note [Model FLOPs] in
   llama_cp/flops.py) of the same model at cp 1, 2, 4 ... N, ring and Ulysses, one
   document and packed documents; and ring efficiency: model TFLOP/s/GPU of ring at
   cp = N over that of one GPU running the same local tokens (L / N) alone.
4. the longest context: the largest --context_length whose step runs at cp = N with
   activation checkpointing, doubling from 32K until a step runs out of memory, then
   bisecting to 1/16 of the last step.

Each measurement runs in a fresh group of processes, so one out-of-memory error
(which stops every rank of the group) fails that measurement only. A measurement
that fails is in the JSON with its error. ``--dry_run`` runs all of it on the CPU
with gloo, 2 ranks and the embedded model's shapes, so that the pipeline is tested
in CI; its figures mean nothing, and since a CPU does not run out of memory the
same way, its bisection treats lengths over ``DRY_RUN_FITS`` tokens as out of memory.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import sys
import tempfile
import time
import traceback
from typing import Any

import fire
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script from anywhere

from llama_cp.config import TrainConfig  # noqa: E402
from llama_cp.flops import attention_pairs, model_flops, peak_flops, throughput  # noqa: E402
from llama_cp.mesh import free_port  # noqa: E402

GiB = 1 << 30
#: In --dry_run, the longest context that "fits" (a CPU has no out-of-memory error to find).
DRY_RUN_FITS = 192
#: The memory levers of part 2: name -> flags.
LEVERS = {
    "none": {},
    "activation_checkpointing": {"activation_checkpointing": True},
    "+ offload_checkpoints": {"activation_checkpointing": True, "offload_checkpoints": True},
    "+ tiled mlp, norms": {"activation_checkpointing": True, "mlp_tile_size": 8192, "norm_tile_size": 8192},
    "lora": {"activation_checkpointing": True, "use_peft": True},
}


@dataclasses.dataclass
class Settings:
    """The shapes of one acceptance run (GPU, or --dry_run)."""

    device_type: str
    nproc: int
    exact_len: int
    exact_model: dict
    memory_lens: list[int]
    speed_len: int
    doc_len: int
    steps: int
    start_len: int
    layers: int
    model: dict
    fits: int | None = None
    """--dry_run: the longest context that counts as running (a CPU has no out-of-memory error to find)."""

    @classmethod
    def of(cls, dry_run: bool, nproc: int | None, layers: int) -> "Settings":
        from llama_cp.memory import MODEL_PRESETS
        from llama_cp.models import EMBEDDED_LLAMA

        if dry_run:
            tiny = {**EMBEDDED_LLAMA, "num_hidden_layers": 2}
            return cls("cpu", nproc or 2, 64, tiny, [128], 128, 16, 2, 128, 2, tiny, fits=DRY_RUN_FITS)
        if not torch.cuda.is_available():
            raise SystemExit("error: no CUDA GPU here; --dry_run runs the pipeline on the CPU")
        nproc = nproc or min(torch.cuda.device_count(), 8)
        small = {**EMBEDDED_LLAMA, "hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16,
                 "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 32000, "num_hidden_layers": 2}
        model = {**MODEL_PRESETS["llama3-8b"], "num_hidden_layers": layers, "max_position_embeddings": 1 << 24}
        return cls("cuda", nproc, 8192, small, [32768, 65536, 131072, 262144, 524288], 65536, 2048, 5,
                   32768, layers, model)


# ----------------------------------------------------------------------------- in each rank


def _llama(shape: dict):
    from transformers import LlamaConfig

    return LlamaConfig(**shape)


def _rows(config, length: int, doc_len: int | None, seed: int = 0) -> dict[str, torch.Tensor]:
    """One row of random tokens: one document, or documents of ``doc_len`` tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (1, length + 1), generator=g)
    positions = torch.arange(length) if doc_len is None else torch.arange(length) % doc_len
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:].clone(), "position_ids": positions[None]}


def _sync(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.synchronize()


def exactness(s: Settings, strategy: str, packed: bool) -> dict[str, Any]:
    """Relative errors of transformers bf16 and of llama-cp's cp = N bf16 against transformers fp32."""
    from transformers import LlamaForCausalLM

    from llama_cp import apply_context_parallel, shard_batch
    from llama_cp.sharding import unshard

    device = torch.device(s.device_type, torch.cuda.current_device() if s.device_type == "cuda" else 0)
    group = dist.group.WORLD
    config = _llama(s.exact_model)
    batch = {k: v.to(device) for k, v in _rows(config, s.exact_len, s.exact_len // 8 if packed else None).items()}
    torch.manual_seed(0)
    fp32 = LlamaForCausalLM(config).to(device)
    state = fp32.state_dict()

    def run(model, inputs, cp: bool):
        model.zero_grad(set_to_none=True)
        # no cache: with one, transformers does not mask packed documents from position_ids
        logits = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), inputs["labels"].flatten(), reduction="sum")
        (loss / s.exact_len).backward()
        grads = {n: p.grad.float() for n, p in model.named_parameters()}
        if cp:
            dist.all_reduce(loss)
            for g in grads.values():
                dist.all_reduce(g)
            logits = unshard(logits.detach(), group)
        return loss.detach() / s.exact_len, logits.detach().float(), grads

    reference = run(fp32, batch, cp=False)
    bf16 = LlamaForCausalLM(config).to(device, torch.bfloat16)
    bf16.load_state_dict(state)
    plain = run(bf16, batch, cp=False)
    cp_model = LlamaForCausalLM(config).to(device, torch.bfloat16)
    cp_model.load_state_dict(state)
    apply_context_parallel(cp_model, group, strategy=strategy)
    local = shard_batch(batch, group)
    ours = run(cp_model, local, cp=True)

    def errors(got):
        loss, logits, grads = got
        rel = lambda a, b: float((a - b).norm() / b.norm().clamp_min(1e-30))  # noqa: E731
        return {"loss": abs(float(loss - reference[0])) / abs(float(reference[0])),
                "logits": rel(logits, reference[1]),
                "gradients": max(rel(grads[n], reference[2][n]) for n in grads)}

    yardstick, measured = errors(plain), errors(ours)
    passed = all(measured[k] <= 2 * yardstick[k] + (1e-3 if k == "loss" else 0) for k in measured)
    return {"strategy": strategy, "documents": "packed" if packed else "one", "cp": dist.get_world_size(),
            "tokens": s.exact_len, "transformers_bf16_error": yardstick, "llama_cp_bf16_error": measured,
            "pass": passed}


def training_step(s: Settings, *, context_length: int, cp: int, strategy: str = "ring", packed: bool = False,
                  flags: dict | None = None) -> dict[str, Any]:
    """``s.steps`` optimizer steps of the Llama-3-8B-shaped model (bf16 on GPU) at ``context_length``
    on every rank (cp ``cp``, the rest data parallel): the steady step time (median after the
    first), the per-step peak memory, and the throughput figures."""
    from llama_cp import build_causal_lm, count_valid_tokens, optimizer_step, parallelize_model, shard_batch
    from llama_cp.optim import build_optimizer
    from llama_cp.trainer import PeakMemory

    world = dist.get_world_size()
    cfg = TrainConfig()
    cfg.data.context_length, cfg.data.document_mask = context_length, True
    cfg.parallel.cp, cfg.parallel.dp_shard, cfg.parallel.cp_strategy = cp, world // cp, strategy
    for name, value in (flags or {}).items():
        section = TrainConfig.flag_names()[name]
        setattr(getattr(cfg, section) if section else cfg, name, value)
    config = _llama(s.model)
    mesh = cfg.parallel.dims(world).build_mesh(s.device_type)
    device = torch.device(s.device_type, torch.cuda.current_device() if s.device_type == "cuda" else 0)
    torch.manual_seed(0)
    model = parallelize_model(build_causal_lm(config, device=device), cfg, mesh)
    optimizer = build_optimizer("adamw", [p for p in model.parameters() if p.requires_grad], lr=1e-5, weight_decay=0.0)
    dp_rank = mesh["dp_shard"].get_local_rank()
    row = _rows(config, context_length, s.doc_len if packed else None, seed=dp_rank)
    local = {k: v.to(device) for k, v in shard_batch(row, mesh["cp"]).items()}
    num_tokens = count_valid_tokens([local["labels"]])
    peak = PeakMemory(s.device_type)
    times, peaks = [], []
    for _ in range(s.steps):
        _sync(s.device_type)
        peak.reset()
        start = time.perf_counter()
        optimizer_step(model, optimizer, [local], num_tokens, max_grad_norm=1.0)
        _sync(s.device_type)
        times.append(time.perf_counter() - start)
        peaks.append(peak.read())
    seconds = sorted(times[1:] or times)[len(times[1:] or times) // 2]
    p = cfg.peft
    flops = model_flops(config, lora_r=p.lora_r if p.use_peft else 0, lora_targets=p.lora_target_modules)
    step_flops = flops.step(context_length, attention_pairs(row["position_ids"])) * (world // cp)
    name = torch.cuda.get_device_name() if s.device_type == "cuda" else None
    figures = throughput(tokens=context_length * (world // cp), flops=step_flops, seconds=seconds,
                         world_size=world, peak=peak_flops(name))
    worst = torch.tensor([max(peaks[1:] or peaks)], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"seconds_per_step": seconds, "measured_peak_bytes": int(worst.item()), **figures}


def longest_context(s: Settings, tried: dict[int, bool], note) -> dict[str, Any]:
    """The largest context whose step runs at cp = N (activation checkpointing): doubling from
    ``s.start_len`` until one does not, then bisecting down to 1/16 of the length. ``tried``:
    lengths already decided (a group that ran out of memory ended on the last one); ``note``
    records each decision before and after a step, so a fresh group goes on from there."""
    cp, unit = s.nproc, 2 * s.nproc

    def runs(length: int) -> bool:
        if length not in tried:
            if s.fits is not None and length > s.fits:  # --dry_run: over its limit, not run
                tried[length] = False
            else:
                note({"trying": length})
                training_step(dataclasses.replace(s, steps=2), context_length=length, cp=cp,
                              flags={"activation_checkpointing": True})
                tried[length] = True
            note({"tried": length, "runs": tried[length]})
        return tried[length]

    good, bad = 0, s.start_len
    while runs(bad):
        good, bad = bad, 2 * bad
    while good and bad - good > max(unit, good // 16):
        middle = (good + bad) // 2 // unit * unit
        good, bad = (middle, bad) if runs(middle) else (good, middle)
    return {"cp": cp, "longest_context": good, "first_failing": bad,
            "tried": {str(k): v for k, v in sorted(tried.items())}}


def _worker(rank: int, port: int, world: int, jobs: list[dict], path: str, settings: Settings) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if settings.device_type == "cpu":
        torch.set_num_threads(1)
    from llama_cp.mesh import init_distributed

    init_distributed(timeout_s=600)

    def note(entry: dict) -> None:
        if rank == 0:
            with open(path, "a") as f:
                f.write(json.dumps(entry) + "\n")

    try:
        for job in jobs:
            kind, args = job["kind"], job["args"]
            if kind == "exactness":
                result = exactness(settings, **args)
            elif kind == "longest":
                tried = {int(k): v for k, v in args["tried"].items()}
                result = longest_context(settings, tried, lambda e: note({"id": job["id"], **e}))
            else:
                result = training_step(settings, **args)
            note({"id": job["id"], "result": result})
            gc.collect()  # the job's model and optimizer: gone before the next job's peak is measured
            if settings.device_type == "cuda":
                torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- the driver


def run_jobs(jobs: list[dict], settings: Settings, meanwhile=None) -> dict[str, dict]:
    """Run ``jobs`` on ``settings.nproc`` ranks, in one group of processes while they succeed. A
    job that fails gets its error and the rest go on in a fresh group; the longest-context
    search goes on after the length that ran out of memory, which it counts as not running.
    ``meanwhile()`` runs here while the first group works."""
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "results.jsonl")
        while remaining := [job for job in jobs if job["id"] not in results]:
            error = None
            group = mp.start_processes(_worker, args=(free_port(), settings.nproc, remaining, path, settings),
                                       nprocs=settings.nproc, join=False, start_method="spawn")
            if meanwhile is not None:
                meanwhile, work = None, meanwhile
                try:
                    work()
                except BaseException:
                    for process in group.processes:  # this group's ranks, started above
                        process.kill()
                    raise
            try:
                while not group.join():
                    pass
            except Exception as exc:  # noqa: BLE001 - any rank's failure ends this group
                error = exc
            trying = None
            if os.path.exists(path):
                with open(path) as f:
                    for entry in map(json.loads, f):
                        if "result" in entry:
                            results[entry["id"]] = entry["result"]
                        elif "trying" in entry:
                            trying = entry["trying"]
                        else:
                            trying = None
                            next(j for j in jobs if j["id"] == entry["id"])["args"]["tried"][str(entry["tried"])] = \
                                entry["runs"]
                os.remove(path)
            failed = next((job for job in remaining if job["id"] not in results), None)
            if failed is None:
                continue
            lines = [line for line in str(error or "no result").splitlines() if line.strip()]
            message = lines[-1][:300] if lines else "failed"
            if failed["kind"] == "longest" and trying is not None and _out_of_memory(message):
                failed["args"]["tried"][str(trying)] = False  # go on in a fresh group
            else:
                results[failed["id"]] = {"error": message}
    return results


def _out_of_memory(message: str) -> bool:
    return any(marker in message.lower() for marker in ("out of memory", "outofmemoryerror"))


def plan(settings: Settings, context_length: int, flags: dict) -> int:
    """The planner's per-step peak bytes of one rank for that step (cp = N)."""
    from llama_cp.memory import plan_step_memory

    cfg = TrainConfig()
    cfg.data.context_length, cfg.parallel.cp = context_length, settings.nproc
    for name, value in flags.items():
        section = TrainConfig.flag_names()[name]
        setattr(getattr(cfg, section) if section else cfg, name, value)
    return plan_step_memory(cfg, settings.nproc, model_config=_llama(settings.model)).total


def main(dry_run: bool = False, output_dir: str = "gpu_acceptance", nproc: int | None = None, layers: int = 2,
         skip_longest: bool = False) -> None:
    """Run the four parts and write ``gpu_acceptance.json`` and ``gpu_acceptance.md``."""
    s = Settings.of(dry_run, nproc, layers)
    n = s.nproc
    heads = s.model["num_attention_heads"]
    cps = [c for c in (1, 2, 4, 8) if c <= n and n % c == 0]
    jobs = [{"id": f"exact/{st}/{'packed' if p else 'one'}", "kind": "exactness", "args": dict(strategy=st, packed=p)}
            for st in ("ring", "ulysses") for p in (False, True) if n > 1]
    for lever, flags in LEVERS.items():
        for length in s.memory_lens:
            jobs.append({"id": f"memory/{lever}/{length}", "kind": "step",
                         "args": dict(context_length=length, cp=n, flags=flags)})
    speed_flags = {"activation_checkpointing": True}
    for cp in cps:
        for st in ("ring", "ulysses") if cp > 1 else ("ring",):
            if heads % cp and st == "ulysses":
                continue
            for p in (False, True):
                jobs.append({"id": f"speed/{cp}/{st}/{'packed' if p else 'one'}", "kind": "step",
                             "args": dict(context_length=s.speed_len, cp=cp, strategy=st, packed=p, flags=speed_flags)})
    jobs.append({"id": "speed/local", "kind": "step",  # one GPU alone on the local tokens of cp = N
                 "args": dict(context_length=s.speed_len // n, cp=1, flags=speed_flags)})
    if not skip_longest:
        jobs.append({"id": "longest", "kind": "longest", "args": {"tried": {}}})
    planned = {}

    def plan_memory() -> None:  # in this process, while the ranks run
        for lever, flags in LEVERS.items():
            for length in s.memory_lens:
                planned[lever, length] = plan(s, length, flags)

    results = run_jobs(jobs, s, meanwhile=plan_memory)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if s.device_type == "cuda" else "cpu (--dry_run)",
        "gpus": n, "torch": torch.__version__, "dry_run": dry_run, "model": s.model,
        "exactness": [results[j["id"]] for j in jobs if j["kind"] == "exactness"],
        "memory": [], "speed": [],
    }
    for lever, flags in LEVERS.items():
        for length in s.memory_lens:
            measured = results[f"memory/{lever}/{length}"]
            got = measured.get("measured_peak_bytes")
            report["memory"].append({"lever": lever, "context_length": length, "planned_bytes": planned[lever, length],
                                     "measured_bytes": got, "error": measured.get("error"),
                                     "planned_over_measured": planned[lever, length] / got if got else None})
    for job in jobs:
        if job["id"].startswith("speed/") and job["id"] != "speed/local":
            _, cp, st, docs = job["id"].split("/")
            report["speed"].append({"cp": int(cp), "strategy": st, "documents": docs,
                                    "context_length": s.speed_len, **results[job["id"]]})
    ring, alone = results.get(f"speed/{n}/ring/one", {}), results["speed/local"]
    report["ring_efficiency"] = {
        "cp": n, "context_length": s.speed_len, "local_tokens": s.speed_len // n,
        "ring_tflops_per_gpu": ring.get("model_tflops_per_gpu"), "alone_tflops_per_gpu": alone.get("model_tflops_per_gpu"),
        "efficiency": (ring["model_tflops_per_gpu"] / alone["model_tflops_per_gpu"]
                       if "model_tflops_per_gpu" in ring and "model_tflops_per_gpu" in alone else None),
    }
    report["longest"] = None if skip_longest else results["longest"]
    os.makedirs(output_dir, exist_ok=True)
    _write(os.path.join(output_dir, "gpu_acceptance.json"), json.dumps(report, indent=1))
    _write(os.path.join(output_dir, "gpu_acceptance.md"), markdown(report))
    print(markdown(report))


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GiB:.2f}"


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown tables (the format docs/benchmarks.md shows)."""
    lines = [f"# llama-cp GPU acceptance: {report['gpus']} x {report['device']}, torch {report['torch']}", "",
             "## 1. Exactness (relative error vs transformers fp32; yardstick: transformers bf16)", "",
             "| strategy | documents | cp | loss | logits | gradients | bf16 loss | bf16 logits | bf16 gradients | pass |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for e in report["exactness"]:
        if "error" in e:
            lines.append(f"| {e['error']} |||||||||")
            continue
        ours, ref = e["llama_cp_bf16_error"], e["transformers_bf16_error"]
        lines.append(f"| {e['strategy']} | {e['documents']} | {e['cp']} | " + " | ".join(
            f"{d[k]:.2e}" for d in (ours, ref) for k in ("loss", "logits", "gradients")) + f" | {e['pass']} |")
    lines += ["", "## 2. Per-step peak memory per GPU (GiB), cp = all GPUs", "",
              "| lever | context | planned | measured | planned / measured |", "|---|---:|---:|---:|---:|"]
    for m in report["memory"]:
        measured = _gib(m["measured_bytes"]) if m["error"] is None else f"({m['error'][:40]})"
        lines.append(f"| {m['lever']} | {m['context_length']} | {_gib(m['planned_bytes'])} | {measured} | "
                     f"{_num(m['planned_over_measured'], '.3f')} |")
    lines += ["", "## 3. Speed", "",
              "| cp | strategy | documents | context | tokens/s/GPU | model TFLOP/s/GPU | MFU |",
              "|---:|---|---|---:|---:|---:|---:|"]
    for r in report["speed"]:
        lines.append(f"| {r['cp']} | {r['strategy']} | {r['documents']} | {r['context_length']} | "
                     f"{_num(r.get('tokens_per_sec_per_gpu'), '.1f')} | {_num(r.get('model_tflops_per_gpu'), '.2f')} | "
                     f"{_num(r.get('mfu'), '.1%')} |")
    e = report["ring_efficiency"]
    lines += ["", f"Ring efficiency at cp {e['cp']} ({e['context_length']} tokens) vs one GPU alone on its "
              f"{e['local_tokens']} local tokens: {_num(e['efficiency'], '.1%')}."]
    longest = report["longest"]
    if longest and "error" in longest:
        lines += ["", "## 4. Longest context", "", f"failed: {longest['error']}"]
    elif longest:
        lines += ["", "## 4. Longest context", "",
                  f"cp {longest['cp']}, activation checkpointing: {longest['longest_context']} tokens run, "
                  f"{longest['first_failing']} do not."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    fire.Fire(main)
