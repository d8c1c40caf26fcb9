"""Does llama-cp work on this GPU machine? One command, 1-8 CUDA GPUs, a JSON file and a table.

    python benchmarks/gpu_acceptance.py                       # every GPU of the machine
    python benchmarks/gpu_acceptance.py --nproc 4 --output_dir acceptance/
    python benchmarks/gpu_acceptance.py --dry_run             # CPU, gloo, 2 ranks, tiny shapes (CI)

It starts its own ranks (one process per GPU, torchrun's environment, as
``llama_cp.train.launcher`` does) and writes ``gpu_acceptance.json`` and
``gpu_acceptance.md`` into ``--output_dir``. The JSON's ``environment`` says what ran
(the device and how many GPUs, torch, CUDA, transformers, bitsandbytes and flash-attn
versions, the attention backends the exactness runs used); its ``checks`` give every
check of part 1 its verdict (pass, FAIL, or the error that stopped it):

1. exactness (Note [The acceptance yardsticks]): every strategy (ring, Ulysses,
   all-gather, hybrid) at cp = N on a small Llama in bf16, one document and packed
   documents, against single-GPU transformers on the same weights and rows: the loss,
   the logits and every parameter's gradient. Every strategy again on a Mistral whose
   sliding window is shorter than the row, and on a Gemma 2 with soft-capped attention
   scores. QLoRA (``--quantization 4bit``) at cp = N against transformers + bitsandbytes +
   peft in one process, and ``--optimizer adamw8bit`` for a few steps at cp = N against
   the same optimizer in one process.
2. memory: a Llama-3-8B-shaped model cut to ``--layers`` decoder layers at 32K-512K
   tokens on N GPUs (cp = N), each lever (none, activation checkpointing, + offloaded
   checkpoints, + tiled MLP and norms, LoRA): the planner's per-step peak
   (``llama_cp.plan.simulate.plan_step_memory``, the ``recipes/plan_memory`` figures) against
   ``torch.cuda.max_memory_allocated`` of a real step, reset before it.
3. speed: tokens/s/GPU, model TFLOP/s/GPU and MFU (Note [Model FLOPs] in
   llama_cp/model/flops.py) of the same model at cp 1, 2, 4, 8 (those dividing N) and N, ring
   and Ulysses, one document and packed documents; and ring efficiency: model
   TFLOP/s/GPU of ring at cp = N over that of one GPU running the same local tokens
   (L / N) alone.
4. the longest context: the largest --context_length whose step runs at cp = N with
   activation checkpointing, doubling from 32K until a step runs out of memory, then
   bisecting to 1/16 of the last step.

Shapes follow N, so that 1 to 8 GPUs all run every part: the exactness model's heads
are a multiple of N and of 4 (4:1 GQA), which Ulysses and every hybrid degree divide,
and every length is a multiple of 2N (the zigzag's 2 x cp chunks; the exactness rows
of 16N, so that packed documents of L / 8 tokens fit whole).

Each measurement runs in a fresh group of processes, so one out-of-memory error
(which stops every rank of the group) fails that measurement only. A measurement
that fails is in the JSON with its error. ``--dry_run`` runs all of it on the CPU
with gloo, 2 ranks and the embedded model's shapes, so that the pipeline is tested
in CI; its figures mean nothing, and since a CPU does not run out of memory the
same way, its bisection treats lengths over ``DRY_RUN_FITS`` tokens as out of memory.

Note [The acceptance yardsticks]
================================

A bf16 run never equals an fp32 one, so "exact" needs a scale, and ours is the error
the reference itself makes in bf16: transformers' bf16 run against its fp32 run on the
same weights and rows (relative errors of the loss, the logits and the worst
parameter gradient). A CP run passes when each of its errors against that fp32 run is
at most twice transformers' bf16 one (plus 1e-3 on the loss, whose bf16 error can be
~0 by chance). A wrong mask, a lost block or a misplaced chunk costs far more than
bf16 rounding, so it fails.

- Sliding windows and soft-capping: a check of a feature that does not change the
  result passes whatever the code does with it. Each such case records
  ``feature_effect``, the relative change of the fp32 logits when the feature is turned
  off (a CP run that ignored it would be about that far off), and passes only when the
  effect is over 4 x transformers' bf16 logits error (twice the pass threshold). Gemma
  2's own cap (50) never bites on random weights, so the case caps at ``SOFTCAP`` with
  weights of std ``SOFTCAP_INIT``: an effect of 0.2-0.8 at the shapes here, against a
  bf16 error of 0.01-0.02.
- QLoRA: both sides are 4-bit. The reference is what a transformers user gets,
  ``from_pretrained`` with a ``BitsAndBytesConfig`` (NF4) and peft's LoRA, in one
  process, in fp32 and in bf16 compute. llama-cp builds the same checkpoint the
  trainer's way (``build_model``: on the meta device, quantized as it is loaded), in
  bf16; its NF4 codes and block maxima must be bitsandbytes' own bit for bit, and its
  loss and LoRA gradients must pass the 2x test above against the fp32 reference with
  the bf16 one as the yardstick. That bf16 load quantizes the bf16-rounded weights, as a
  bf16 user's does, so this yardstick is looser than the exactness one; the codes are
  checked apart, and the attention under CP by the exactness checks.
- adamw8bit: its state is rounded to 8 bits, so two runs whose gradients differ in the
  last bits may step a few elements differently by one rounding step; no exact match
  is honest. The check runs in fp32 (bf16 noise in the gradients is the exactness checks')
  and compares the updates of ``OPTIMIZER_STEPS`` steps (every parameter's final minus
  initial value, all as one vector): llama-cp at cp = N (FSDP2 shards,
  ``ShardLocalOptimizer`` stepping each rank's shard) against the same optimizer
  (``build_optimizer("adamw8bit")``) stepping whole tensors of transformers in one
  process on the same rows. The yardstick is what 8-bit state costs at all: that
  single-process run against fp32 torch AdamW. It passes when everything is finite and
  the distance is at most the yardstick. bitsandbytes quantizes the state in blocks of
  256 consecutive elements and FSDP2 cuts whole rows, so with rows of a multiple of 256
  elements (every width of the GPU model) a shard's blocks are the whole tensor's, and
  only the gradients' last bits separate the two runs: far below the yardstick (the dry
  run's tiny model: 1e-4 against 1e-2), while a shard stepped with the wrong gradient, a
  lost step or state not kept between steps is an error of the order of the update.
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
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import fire
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script from anywhere

from llama_cp.config import TrainConfig  # noqa: E402
from llama_cp.model.flops import attention_pairs, model_flops, peak_flops, throughput  # noqa: E402
from llama_cp.parallel.mesh import free_port  # noqa: E402

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
STRATEGIES = ("ring", "ulysses", "allgather", "hybrid")
#: The models of the exactness checks: a Llama; a Mistral with a sliding window of 5/16 of its row
#: (longer than a zigzag chunk at every N >= 2: windows cross the ranks' borders); a Gemma 2 with
#: soft-capped attention scores.
CASES = ("llama", "mistral_window", "gemma2_softcap")
#: The Gemma 2 case's attention cap and weight init std (Note [The acceptance yardsticks]).
SOFTCAP, SOFTCAP_INIT = 1.0, 0.05
#: The QLoRA check's adapters (on the attention and the MLP, so both kinds of NF4 layer train).
QLORA = dict(lora_r=8, lora_alpha=16, lora_target_modules=("q_proj", "v_proj", "down_proj"))
#: The adamw8bit check: steps, and AdamW's settings for both runs and the fp32 yardstick.
OPTIMIZER_STEPS, ADAMW = 3, dict(lr=1e-3, weight_decay=0.01)
#: The config fields that give every family of CASES the exactness model's shapes.
_SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "tie_word_embeddings")


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def heads_for(n: int, at_least: int, head_dim: int) -> dict[str, int]:
    """Attention shapes that every strategy splits on N ranks: the fewest heads >= ``at_least``
    that are a multiple of N (Ulysses; a hybrid degree divides N, hence them) and of 4, with
    a quarter as many KV heads."""
    heads = _round_up(at_least, math.lcm(n, 4))
    return {"num_attention_heads": heads, "num_key_value_heads": heads // 4, "hidden_size": heads * head_dim,
            "head_dim": head_dim}


def hybrid_degree(n: int, heads: int) -> int:
    """--ulysses_degree of the hybrid checks: the largest divisor of N below N that divides the
    heads, so that Ulysses and the ring both span several ranks where N allows (4: 2 x 2, 6:
    3 x 2, 8: 4 x 2); at a prime N, 1: the ring over the sub-groups the hybrid makes, Ulysses
    over single ranks."""
    return max((u for u in range(1, n) if n % u == 0 and heads % u == 0), default=1)


@dataclasses.dataclass
class Settings:
    """The shapes of one acceptance run (GPU, or --dry_run), all chosen from N = ``nproc``."""

    device_type: str
    nproc: int
    exact_len: int
    """tokens of the exactness rows, a multiple of 16 N"""
    feature_len: int
    """tokens of the sliding-window and soft-capping rows (Gemma 2's reference is eager attention)"""
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

    @property
    def window(self) -> int:
        """The Mistral case's sliding window: 5/16 of its row, longer than a zigzag chunk (L / 2N) at N >= 2."""
        return self.feature_len * 5 // 16

    @classmethod
    def of(cls, dry_run: bool, nproc: int | None, layers: int) -> "Settings":
        from llama_cp.modules.causal_lm import EMBEDDED_LLAMA
        from llama_cp.plan.simulate import MODEL_PRESETS

        if dry_run:
            n = nproc or 2
            tiny = {**EMBEDDED_LLAMA, "num_hidden_layers": 2, **heads_for(n, 8, 32)}  # N = 2: the embedded model's
            length = _round_up(64, 16 * n)
            return cls("cpu", n, length, length, tiny, [_round_up(128, 2 * n)], _round_up(128, 2 * n), 16, 2,
                       _round_up(128, 2 * n), 2, tiny, fits=DRY_RUN_FITS)
        if not torch.cuda.is_available():
            raise SystemExit("error: no CUDA GPU here; --dry_run runs the pipeline on the CPU")
        n = nproc or min(torch.cuda.device_count(), 8)
        shape = heads_for(n, 16, 64)  # N = 1, 2, 4, 8: 16 heads of 64, 4 KV heads, hidden 1024
        # widths of multiples of 256: whole blocks of adamw8bit's state in every FSDP2 shard
        small = {**EMBEDDED_LLAMA, **shape, "intermediate_size": _round_up(shape["hidden_size"] * 11 // 4, 256),
                 "vocab_size": 32000, "num_hidden_layers": 2}
        model = {**MODEL_PRESETS["llama3-8b"], "num_hidden_layers": layers, "max_position_embeddings": 1 << 24}
        lengths = [_round_up(length, 2 * n) for length in (32768, 65536, 131072, 262144, 524288)]
        return cls("cuda", n, _round_up(8192, 16 * n), _round_up(2048, 16 * n), small, lengths,
                   _round_up(65536, 2 * n), 2048, 5, _round_up(32768, 2 * n), layers, model)


# ----------------------------------------------------------------------------- in each rank


def _llama(shape: dict):
    from transformers import LlamaConfig

    return LlamaConfig(**shape)


def case_config(s: Settings, case: str, feature: bool = True):
    """The HF config of exactness case ``case`` (``CASES``) at the exactness model's shapes;
    ``feature=False``: the same model with its window or cap turned off."""
    from transformers import AutoConfig

    if case == "llama":
        return _llama(s.exact_model)
    shape = {key: s.exact_model[key] for key in _SHAPE_FIELDS}
    if case == "mistral_window":
        return AutoConfig.for_model("mistral", **shape, sliding_window=s.window if feature else None)
    # Gemma 2 alternates windowed and full layers: a window as long as the row cuts nothing
    return AutoConfig.for_model(
        "gemma2", **shape, attn_logit_softcapping=SOFTCAP if feature else None, initializer_range=SOFTCAP_INIT,
        sliding_window=s.feature_len, query_pre_attn_scalar=shape["head_dim"],
        attn_implementation="eager",  # transformers soft-caps in its eager attention, not in SDPA
    )


def _causal_lm(config):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _rows(config, length: int, doc_len: int | None, seed: int = 0) -> dict[str, torch.Tensor]:
    """One row of random tokens: one document, or documents of ``doc_len`` tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (1, length + 1), generator=g)
    positions = torch.arange(length) if doc_len is None else torch.arange(length) % doc_len
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:].clone(), "position_ids": positions[None]}


def _sync(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.synchronize()


def _device(s: Settings) -> torch.device:
    return torch.device(s.device_type, torch.cuda.current_device() if s.device_type == "cuda" else 0)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


#: Attention ops -> the llama-cp backend (``llama_cp.attention.kernels``) that calls them; flash-attn's own
#: ops (namespace flash_attn) are flash_attn's.
_ATTENTION_OPS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": "sdpa_cpu",
    "aten::_scaled_dot_product_flash_attention": "sdpa_flash",
    "aten::_flash_attention_forward": "sdpa_flash",  # the varlen calls of packed documents
    "aten::_scaled_dot_product_efficient_attention": "sdpa_efficient",
}


class AttentionKernels(TorchDispatchMode):
    """The attention ops that run under it (forward and backward): which backend really ran,
    not which one a setting asked for. flash-attn's kernels are torch ops from 2.7 on; llama-cp's
    own kernels (math, and the exact dense kernel of windows and caps on CPU) are matmuls, so
    a run that shows no attention op ran those, or an older flash-attn (:meth:`backends`). On
    CPU a windowed run whose blocks without a window run sdpa_cpu shows sdpa_cpu alone."""

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name().removesuffix("_backward")
        if name in _ATTENTION_OPS or func.namespace == "flash_attn":
            self.ops.add(name)
        return func(*args, **(kwargs or {}))

    def backends(self, selected: str) -> str:
        """The backends seen, joined by "+"; none seen: flash_attn when that is what llama-cp
        selects here (before 2.7 its calls are not torch ops), else math."""
        seen = {"flash_attn" if op.startswith("flash_attn::") else _ATTENTION_OPS[op] for op in self.ops}
        return "+".join(sorted(seen)) or ("flash_attn" if selected == "flash_attn" else "math")


def feature_refusal(case: str, device: torch.device, head_dim: int) -> str | None:
    """llama-cp's own one-line refusal when the attention backend it selects here cannot compute
    the case's window or cap (on CUDA they need flash-attn: Note [Soft-capped attention] in
    llama_cp/attention/kernels.py), from one local kernel call on a probe; None when it can."""
    from llama_cp.attention.kernels import attention_forward

    if case == "llama":
        return None
    q = torch.zeros(1, 1, 2, head_dim, dtype=torch.bfloat16, device=device)  # (B, H, S, D)
    try:
        attention_forward(q, q, q, causal=True, softcap=SOFTCAP if case == "gemma2_softcap" else 0.0,
                          lag=0 if case == "mistral_window" else None)
    except ValueError as error:
        return str(error)
    return None


def exactness(s: Settings, case: str, strategy: str, packed: bool, ulysses_degree: int,
              references: dict) -> dict[str, Any]:
    """Relative errors of transformers bf16 and of llama-cp's cp = N bf16 against transformers
    fp32 (Note [The acceptance yardsticks]), on rank 0 (the others: {}). ``references``: the
    weights and rank 0's single-process runs of the last (case, packed), kept for the next
    strategy."""
    from llama_cp import apply_context_parallel, shard_batch
    from llama_cp.attention.kernels import select_backend
    from llama_cp.parallel.sharding import SEQ_INDEX, unshard

    device = _device(s)
    group = dist.group.WORLD
    length = s.exact_len if case == "llama" else s.feature_len
    config = case_config(s, case)
    refusal = feature_refusal(case, device, config.head_dim)
    if refusal is not None:  # every rank returns here, before any collective: the group goes on
        return {"error": refusal} if dist.get_rank() == 0 else {}
    batch = {k: v.to(device) for k, v in _rows(config, length, length // 8 if packed else None).items()}

    def run(model, inputs, cp: bool):
        model.zero_grad(set_to_none=True)
        extra = {SEQ_INDEX: inputs[SEQ_INDEX]} if SEQ_INDEX in inputs else {}  # all-gather's rows
        # no cache: with one, transformers does not mask packed documents from position_ids
        logits = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], use_cache=False,
                       **extra).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), inputs["labels"].flatten(), reduction="sum")
        (loss / length).backward()
        params = dict(model.named_parameters())
        flat = torch.cat([loss.detach().reshape(1), *(p.grad.float().flatten() for p in params.values())])
        if cp:  # the full row's loss and gradients: the sums over the ranks, in one all-reduce
            dist.all_reduce(flat)
            logits = unshard(logits.detach(), group, seq_index=inputs.get(SEQ_INDEX))
        loss, *grads = flat.split([1, *(p.numel() for p in params.values())])
        grads = {n: g.view(p.shape) for (n, p), g in zip(params.items(), grads)}
        return loss[0] / length, logits.detach().float(), grads

    if (case, packed) not in references:
        references.clear()  # one case's runs in memory at a time
        torch.manual_seed(0)
        fp32 = _causal_lm(config).to(device)
        state, runs = fp32.state_dict(), None
        if dist.get_rank() == 0:  # the single-process runs: rank 0 compares
            reference = run(fp32, batch, cp=False)
            bf16 = _causal_lm(config).to(device, torch.bfloat16)
            bf16.load_state_dict(state)
            plain = run(bf16, batch, cp=False)
            effect = None
            if case != "llama":  # how far off a run that ignored the window or the cap would be
                off = _causal_lm(case_config(s, case, feature=False)).to(device)
                off.load_state_dict(state)
                with torch.no_grad():
                    without = off(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                  use_cache=False).logits
                effect = _relative(without.float(), reference[1])
                del off, without
            runs = reference, plain, effect
        references[case, packed] = state, runs
    state, runs = references[case, packed]
    # a config of its own: apply_context_parallel names its attention in the model's config
    cp_model = _causal_lm(case_config(s, case)).to(device, torch.bfloat16)
    cp_model.load_state_dict(state)
    apply_context_parallel(cp_model, group, strategy=strategy, max_seq_len=length, ulysses_degree=ulysses_degree)
    local = shard_batch(batch, group, layout="documents" if strategy == "allgather" else "zigzag")
    with AttentionKernels() as kernels:
        ours = run(cp_model, local, cp=True)
    if runs is None:
        return {}
    reference, plain, effect = runs
    selected = select_backend(torch.empty(1, 1, 1, config.head_dim, dtype=torch.bfloat16, device=device))

    def errors(got):
        loss, logits, grads = got
        return {"loss": abs(float(loss - reference[0])) / abs(float(reference[0])),
                "logits": _relative(logits, reference[1]),
                "gradients": max(_relative(grads[n], reference[2][n]) for n in grads)}

    yardstick, measured = errors(plain), errors(ours)
    passed = all(measured[k] <= 2 * yardstick[k] + (1e-3 if k == "loss" else 0) for k in measured)
    if effect is not None:
        passed = passed and effect > 4 * yardstick["logits"]
    return {"case": case, "strategy": strategy, "documents": "packed" if packed else "one",
            "cp": dist.get_world_size(), "ulysses_degree": ulysses_degree or None, "tokens": length,
            "attention_backend": kernels.backends(selected), "attention_ops": sorted(kernels.ops),
            "feature_effect": effect, "transformers_bf16_error": yardstick, "llama_cp_bf16_error": measured,
            "pass": passed}


def _lora_values(shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Every adapter weight from one seed, the same on every rank; lora_B too (peft starts it at
    zero), so that every adapter weight gets a gradient."""
    generator = torch.Generator().manual_seed(7)
    return {name: torch.randn(shapes[name], generator=generator) * 0.02 for name in sorted(shapes)}


def _bnb_lora(path: str, dtype: torch.dtype, device: torch.device, values: dict[str, torch.Tensor]):
    """transformers + bitsandbytes NF4 (compute in ``dtype``) + peft LoRA of the checkpoint at
    ``path``, in this process, with the adapter weights ``values``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=quantization, dtype=dtype, attn_implementation="sdpa",
        device_map={"": device.index if device.type == "cuda" else "cpu"},
    ).train()  # train mode: in eval mode without gradients bitsandbytes on some CPUs repacks the weights
    model = get_peft_model(model, LoraConfig(r=QLORA["lora_r"], lora_alpha=QLORA["lora_alpha"],
                                             target_modules=list(QLORA["lora_target_modules"]), task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.copy_(values[name])
    return model


def qlora(s: Settings, workdir: str) -> dict[str, Any]:
    """QLoRA at cp = N, built as the trainer builds it, against transformers + bitsandbytes + peft
    in one process (Note [The acceptance yardsticks]): NF4 codes, loss, LoRA gradients."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    from transformers import LlamaForCausalLM

    from llama_cp import count_valid_tokens, forward_backward, shard_batch
    from llama_cp.model.build import build_model
    from llama_cp.modules.quantize import quantized_linears

    rank, world, device = dist.get_rank(), dist.get_world_size(), _device(s)
    config = _llama(s.exact_model)
    path = os.path.join(workdir, "qlora_checkpoint")
    if rank == 0:
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(path)
    dist.barrier()
    cfg = TrainConfig.from_flags(use_peft=True, quantization="4bit", dtype="bfloat16", cp=world, cp_strategy="ring",
                                 context_length=s.exact_len, **QLORA)
    mesh = cfg.parallel.dims(world).build_mesh(s.device_type)
    model = build_model(cfg, mesh, device, path)
    values = _lora_values({n: p.shape for n, p in model.named_parameters() if p.requires_grad})
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.copy_(distribute_tensor(values[name].to(device), param.device_mesh, param.placements))
    row = {k: v.to(device) for k, v in _rows(config, s.exact_len, None).items()}
    local = shard_batch(row, mesh["cp"])
    loss = forward_backward(model, [local], count_valid_tokens([local["labels"]]))
    dist.all_reduce(loss)

    def whole(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    grads = {n: whole(p.grad).float() for n, p in model.named_parameters() if p.requires_grad}
    codes = {n: (whole(m.weight).flatten(), whole(m.absmax).view(torch.float32)) for n, m in
             quantized_linears(model).items()}
    del model
    if rank != 0:
        return {}
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        reference = _bnb_lora(path, dtype, device, values)
        logits = reference(input_ids=row["input_ids"], use_cache=False).logits
        ref_loss = F.cross_entropy(logits.flatten(0, 1).float(), row["labels"].flatten())
        ref_loss.backward()
        runs[dtype] = ref_loss.detach(), {n: p.grad.float() for n, p in reference.named_parameters() if p.requires_grad}
        if dtype == torch.float32:  # the codes of the same full-precision weights
            identical = all(
                torch.equal(packed, reference.get_submodule(n).weight.data.view(torch.uint8).flatten())
                and torch.equal(absmax, reference.get_submodule(n).weight.quant_state.absmax)
                for n, (packed, absmax) in codes.items())
        del reference, logits
    want_loss, want_grads = runs[torch.float32]

    def errors(got_loss, got_grads):
        return {"loss": abs(float(got_loss - want_loss)) / abs(float(want_loss)),
                "lora_gradients": max(_relative(got_grads[n], want_grads[n]) for n in want_grads)}

    yardstick, measured = errors(*runs[torch.bfloat16]), errors(loss, grads)
    passed = (identical and grads.keys() == want_grads.keys()
              and all(measured[k] <= 2 * yardstick[k] + (1e-3 if k == "loss" else 0) for k in measured))
    return {"cp": world, "strategy": "ring", "tokens": s.exact_len, "lora_r": QLORA["lora_r"],
            "lora_targets": list(QLORA["lora_target_modules"]), "nf4_layers": len(codes),
            "nf4_codes_identical": identical, "transformers_bf16_error": yardstick, "llama_cp_bf16_error": measured,
            "pass": passed}


def adamw8bit(s: Settings) -> dict[str, Any]:
    """``OPTIMIZER_STEPS`` steps of --optimizer adamw8bit at cp = N, in fp32, against the same
    optimizer in one process, with fp32 AdamW's distance from it as the yardstick (Note [The
    acceptance yardsticks])."""
    from transformers import LlamaForCausalLM

    from llama_cp import optimizer_step, parallelize_model, shard_batch
    from llama_cp.optim.optimizers import build_optimizer

    world, device = dist.get_world_size(), _device(s)
    config = _llama(s.exact_model)

    def seeded():  # a config of its own: apply_context_parallel names its attention in the model's config
        torch.manual_seed(0)
        return LlamaForCausalLM(_llama(s.exact_model)).to(device)

    rows = [{k: v.to(device) for k, v in _rows(config, s.exact_len, None, seed=step).items()}
            for step in range(OPTIMIZER_STEPS)]
    cfg = TrainConfig.from_flags(optimizer="adamw8bit", dtype="float32", cp=world, cp_strategy="ring",
                                 context_length=s.exact_len)
    mesh = cfg.parallel.dims(world).build_mesh(s.device_type)
    model = parallelize_model(seeded(), cfg, mesh)
    optimizer = build_optimizer("adamw8bit", model.parameters(), **ADAMW)
    losses = []
    for row in rows:
        loss, _ = optimizer_step(model, optimizer, [shard_batch(row, mesh["cp"])], s.exact_len, max_grad_norm=0.0)
        dist.all_reduce(loss)
        losses.append(float(loss))
    ours = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    del model, optimizer
    if dist.get_rank() != 0:
        return {}
    initial = {n: p.detach() for n, p in seeded().named_parameters()}

    def one_process(name: str):
        reference = seeded()
        optimizer = build_optimizer(name, reference.parameters(), **ADAMW)
        ref_losses = []
        for row in rows:
            logits = reference(input_ids=row["input_ids"], position_ids=row["position_ids"], use_cache=False).logits
            ref_loss = F.cross_entropy(logits.flatten(0, 1), row["labels"].flatten())
            ref_loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            ref_losses.append(float(ref_loss.detach()))
        eight_bit = sum(p.numel() for p in reference.parameters()
                        if name == "adamw8bit" and p.numel() >= optimizer.inner.args.min_8bit_size)
        return {n: p.detach() for n, p in reference.named_parameters()}, ref_losses, eight_bit

    def update(params: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([(params[n] - initial[n]).flatten() for n in initial])

    single, single_losses, eight_bit = one_process("adamw8bit")
    fp32, _, _ = one_process("adamw")
    ours_update, single_update, fp32_update = update(ours), update(single), update(fp32)
    distance, yardstick = _relative(ours_update, single_update), _relative(single_update, fp32_update)
    finite = bool(ours_update.isfinite().all()) and all(math.isfinite(x) for x in losses)
    return {"cp": world, "steps": OPTIMIZER_STEPS, "tokens": s.exact_len, **ADAMW, "losses": losses,
            "one_process_losses": single_losses, "finite": finite,
            "state_8bit_share": eight_bit / sum(p.numel() for p in initial.values()),
            "update_error_vs_one_process": distance, "yardstick_8bit_vs_fp32_adamw": yardstick,
            "pass": finite and float(single_update.norm()) > 0 and distance <= yardstick}


def training_step(s: Settings, *, context_length: int, cp: int, strategy: str = "ring", packed: bool = False,
                  flags: dict | None = None) -> dict[str, Any]:
    """``s.steps`` optimizer steps of the Llama-3-8B-shaped model (bf16 on GPU) at ``context_length``
    on every rank (cp ``cp``, the rest data parallel): the steady step time (median after the
    first), the per-step peak memory, and the throughput figures."""
    from llama_cp import build_causal_lm, count_valid_tokens, optimizer_step, parallelize_model, shard_batch
    from llama_cp.optim.optimizers import build_optimizer
    from llama_cp.train.reporting import PeakMemory

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
    from llama_cp.parallel.mesh import end_distributed, init_distributed

    init_distributed(timeout_s=600)

    def note(entry: dict) -> None:
        if rank == 0:
            with open(path, "a") as f:
                f.write(json.dumps(entry) + "\n")

    references: dict = {}  # the exactness checks' single-process runs, shared by the strategies of a case
    try:
        for job in jobs:
            kind, args = job["kind"], job["args"]
            if kind != "exactness":
                references.clear()  # before any peak of parts 2-4 is measured
            if kind == "exactness":
                result = exactness(settings, **args, references=references)
            elif kind == "qlora":
                result = qlora(settings, os.path.dirname(path))
            elif kind == "adamw8bit":
                result = adamw8bit(settings)
            elif kind == "longest":
                tried = {int(k): v for k, v in args["tried"].items()}
                result = longest_context(settings, tried, lambda e: note({"id": job["id"], **e}))
            else:
                result = training_step(settings, **args)
            note({"id": job["id"], "result": result})
            gc.collect()  # the job's model and optimizer: gone before the next job's peak is measured
            if settings.device_type == "cuda":
                torch.cuda.empty_cache()
    except BaseException:  # the driver reads what was noted, and goes on in a fresh group
        dist.destroy_process_group()
        raise
    end_distributed()  # Note [Leaving a gloo job] in llama_cp/parallel/mesh.py


# ----------------------------------------------------------------------------- the driver


def run_jobs(jobs: list[dict], settings: Settings, meanwhile=None) -> dict[str, dict]:
    """Run ``jobs`` on ``settings.nproc`` ranks, in one group of processes while they succeed. A
    job that fails gets its error and the rest go on in a fresh group; the longest-context
    search goes on after the length that ran out of memory, which it counts as not running.
    ``meanwhile()`` runs here while the first group works."""
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "results.jsonl")  # its directory also holds the QLoRA check's checkpoint
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
    from llama_cp.plan.simulate import plan_step_memory

    cfg = TrainConfig()
    cfg.data.context_length, cfg.parallel.cp = context_length, settings.nproc
    for name, value in flags.items():
        section = TrainConfig.flag_names()[name]
        setattr(getattr(cfg, section) if section else cfg, name, value)
    return plan_step_memory(cfg, settings.nproc, model_config=_llama(settings.model)).total


def correctness_jobs(s: Settings) -> list[dict]:
    """Part 1: every case x strategy (packed documents for the Llama too), QLoRA, adamw8bit. At
    N = 1 there is no strategy: the ring's name runs the local attention."""
    n = s.nproc
    u = hybrid_degree(n, s.exact_model["num_attention_heads"])
    jobs = []
    for case in CASES:
        for packed in (False, True) if case == "llama" else (False,):
            for strategy in STRATEGIES if n > 1 else ("ring",):
                jobs.append({"id": f"exact/{case}/{strategy}/{'packed' if packed else 'one'}", "kind": "exactness",
                             "args": dict(case=case, strategy=strategy, packed=packed,
                                          ulysses_degree=u if strategy == "hybrid" else 0)})
    return jobs + [{"id": "qlora", "kind": "qlora", "args": {}}, {"id": "adamw8bit", "kind": "adamw8bit", "args": {}}]


def _version(*names: str) -> str:
    for name in names:
        try:
            return version(name)
        except PackageNotFoundError:
            pass
    return "not installed"


def environment(s: Settings, exact: list[dict]) -> dict[str, Any]:
    """What ran: the device, the GPUs used and visible, the versions that decide what runs, and
    the attention backends the exactness checks saw run (``AttentionKernels``)."""
    cuda = s.device_type == "cuda"
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu (--dry_run)",
        "gpus": s.nproc, "visible_gpus": torch.cuda.device_count() if cuda else 0, "cuda": torch.version.cuda,
        "torch": torch.__version__, "transformers": _version("transformers"), "bitsandbytes": _version("bitsandbytes"),
        "flash_attn": _version("flash-attn", "flash_attn"),
        "attention_backends": sorted({b for e in exact if "attention_backend" in e
                                      for b in e["attention_backend"].split("+")}),
    }


def verdict(result: dict) -> str:
    if "error" in result:
        return f"error: {result['error']}"
    return "pass" if result.get("pass") is True else "FAIL"


def main(dry_run: bool = False, output_dir: str = "gpu_acceptance", nproc: int | None = None, layers: int = 2,
         skip_longest: bool = False) -> None:
    """Run the four parts and write ``gpu_acceptance.json`` and ``gpu_acceptance.md``."""
    s = Settings.of(dry_run, nproc, layers)
    n = s.nproc
    heads = s.model["num_attention_heads"]
    cps = sorted({c for c in (1, 2, 4, 8) if c <= n and n % c == 0} | {n})
    jobs = correctness_jobs(s)
    correctness = [job["id"] for job in jobs]
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
    exact = [{"check": j["id"], **results[j["id"]]} for j in jobs if j["kind"] == "exactness"]
    report: dict[str, Any] = {
        "environment": environment(s, exact), "dry_run": dry_run, "exact_model": s.exact_model, "model": s.model,
        "checks": {name: verdict(results[name]) for name in correctness},
        "exactness": exact, "qlora": results["qlora"], "adamw8bit": results["adamw8bit"],
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


def _errors(ours: dict, ref: dict, keys: tuple[str, ...]) -> str:
    return " | ".join(f"{d[k]:.2e}" for d in (ours, ref) for k in keys)


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown tables (the format docs/benchmarks.md shows)."""
    env, checks = report["environment"], report["checks"]
    failing = [f"{name} ({v})" for name, v in checks.items() if v != "pass"]
    lines = [f"# llama-cp GPU acceptance: {env['gpus']} x {env['device']}", "",
             f"torch {env['torch']} (CUDA {env['cuda']}), transformers {env['transformers']}, bitsandbytes "
             f"{env['bitsandbytes']}, flash-attn {env['flash_attn']}; {env['visible_gpus']} GPUs visible; attention "
             f"backends that ran: {', '.join(env['attention_backends']) or '-'}.", "",
             f"Checks: {len(checks) - len(failing)} of {len(checks)} pass" + (
                 "; not passing: " + "; ".join(failing) if failing else "."), "",
             "## 1. Exactness (relative error vs transformers fp32; yardstick: transformers bf16)", "",
             "| case | strategy | documents | cp | backend | loss | logits | gradients | bf16 loss | bf16 logits "
             "| bf16 gradients | feature effect | pass |",
             "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for e in report["exactness"]:
        case, strategy, documents = e["check"].split("/")[1:]
        if "error" in e:
            lines.append(f"| {case} | {strategy} | {documents} | {e['error']} |||||||||")
            continue
        degree = f" (u {e['ulysses_degree']})" if e["ulysses_degree"] else ""
        lines.append(f"| {case} | {strategy}{degree} | {documents} | {e['cp']} | {e['attention_backend']} | "
                     + _errors(e["llama_cp_bf16_error"], e["transformers_bf16_error"], ("loss", "logits", "gradients"))
                     + f" | {_num(e['feature_effect'], '.2e')} | {e['pass']} |")
    q = report["qlora"]
    lines += ["", "QLoRA (NF4 base + LoRA, bf16, vs transformers + bitsandbytes + peft in fp32; yardstick: the "
              "same in bf16):", "",
              "| cp | NF4 layers | codes identical | loss | LoRA gradients | bf16 loss | bf16 LoRA gradients | pass |",
              "|---:|---:|---|---:|---:|---:|---:|---|"]
    if "error" in q:
        lines.append(f"| {q['error']} |||||||")
    else:
        lines.append(f"| {q['cp']} | {q['nf4_layers']} | {q['nf4_codes_identical']} | "
                     + _errors(q["llama_cp_bf16_error"], q["transformers_bf16_error"], ("loss", "lora_gradients"))
                     + f" | {q['pass']} |")
    a = report["adamw8bit"]
    lines += ["", "adamw8bit (fp32; updates after the steps vs the same optimizer in one process; yardstick: that "
              "run vs fp32 AdamW):", "",
              "| cp | steps | 8-bit state share | update error | yardstick | finite | pass |",
              "|---:|---:|---:|---:|---:|---|---|"]
    if "error" in a:
        lines.append(f"| {a['error']} ||||||")
    else:
        lines.append(f"| {a['cp']} | {a['steps']} | {a['state_8bit_share']:.1%} | "
                     f"{a['update_error_vs_one_process']:.2e} | {a['yardstick_8bit_vs_fp32_adamw']:.2e} | "
                     f"{a['finite']} | {a['pass']} |")
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
