"""Part 1 of the GPU acceptance run, correctness: every CP strategy against single-GPU transformers
on a Llama (one document and packed documents), on a Mistral with a sliding window and on a Gemma 2
with soft-capped attention; QLoRA against transformers + bitsandbytes + peft; adamw8bit against
the same optimizer in one process. Each check runs on every rank of a group and returns its
result on rank 0.

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

import math
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.gpu.settings import Settings, hybrid_degree, llama_config, random_row
from llama_cp.config import TrainConfig

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


def case_config(s: Settings, case: str, feature: bool = True):
    """The HF config of exactness case ``case`` (``CASES``) at the exactness model's shapes;
    ``feature=False``: the same model with its window or cap turned off."""
    from transformers import AutoConfig

    if case == "llama":
        return llama_config(s.exact_model)
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


def _device(s: Settings) -> torch.device:
    return torch.device(s.device_type, torch.cuda.current_device() if s.device_type == "cuda" else 0)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


#: Attention ops -> the llama-cp backend (``llama_cp.attention.kernels``) that calls them; flash-attn's own
#: ops (namespace flash_attn) are flash_attn's.
_ATTENTION_OPS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": "sdpa_cpu",
    "aten::_scaled_dot_product_flash_attention": "sdpa_flash",
    "aten::_flash_attention_forward": "sdpa_flash",  # the varlen calls of packed documents, and windowed calls
    "aten::_scaled_dot_product_efficient_attention": "sdpa_efficient",
    "aten::_scaled_dot_product_cudnn_attention": "sdpa_cudnn",
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


def packed_document_length(case: str, length: int) -> int:
    """The documents of a packed row: an eighth of it; for the window, 3/8 (two documents longer than the
    5/16 window, and a shorter one, which joins their windowed varlen call: Note [Varlen document calls])."""
    return length * 3 // 8 if case == "mistral_window" else length // 8


def feature_refusal(case: str, device: torch.device, head_dim: int) -> str | None:
    """llama-cp's own one-line refusal when the attention backend it selects here cannot compute
    the case's window or cap (on CUDA a cap needs flash-attn, Note [Soft-capped attention] in
    llama_cp/attention/windows.py; a window flash-attn or torch's flash kernel, Note [Windows on
    torch's flash kernel] in kernel_calls.py), from one local kernel call on a probe; None when it can."""
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
              references: dict, block_size: int = 0, backend: str | None = None) -> dict[str, Any]:
    """Relative errors of transformers bf16 and of llama-cp's cp = N bf16 against transformers
    fp32 (Note [The acceptance yardsticks]), on rank 0 (the others: {}). ``references``: the
    weights and rank 0's single-process runs of the last (case, packed), kept for the next
    strategy. ``block_size``: llama-cp's ``--attention_block_size`` (0: whole shards), whose
    kernel calls on parts of a shard are merged by their log-sum-exp, as the ring's are.
    ``backend``: llama-cp's ``--attention_backend`` (None: what it selects here)."""
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
    batch = {k: v.to(device) for k, v in random_row(config, length, packed_document_length(case, length)
                                                    if packed else None).items()}

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
    apply_context_parallel(cp_model, group, strategy=strategy, max_seq_len=length, ulysses_degree=ulysses_degree,
                           block_size=block_size, backend=backend)
    local = shard_batch(batch, group, layout="documents" if strategy == "allgather" else "zigzag")
    with AttentionKernels() as kernels:
        ours = run(cp_model, local, cp=True)
    if runs is None:
        return {}
    reference, plain, effect = runs
    selected = backend or select_backend(torch.empty(1, 1, 1, config.head_dim, dtype=torch.bfloat16, device=device))

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
            "block_size": block_size or None,
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
    config = llama_config(s.exact_model)
    path = os.path.join(workdir, "qlora_checkpoint")
    if rank == 0:
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(path)
    dist.barrier()
    cfg = TrainConfig.from_flags(use_peft=True, quantization="4bit", dtype="bfloat16", cp=world, cp_strategy="ring",
                                 report_to=("none",), context_length=s.exact_len, **QLORA)
    mesh = cfg.parallel.dims(world).build_mesh(s.device_type)
    model = build_model(cfg, mesh, device, path)
    values = _lora_values({n: p.shape for n, p in model.named_parameters() if p.requires_grad})
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.copy_(distribute_tensor(values[name].to(device), param.device_mesh, param.placements))
    row = {k: v.to(device) for k, v in random_row(config, s.exact_len, None).items()}
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
    config = llama_config(s.exact_model)

    def seeded():  # a config of its own: apply_context_parallel names its attention in the model's config
        torch.manual_seed(0)
        return LlamaForCausalLM(llama_config(s.exact_model)).to(device)

    rows = [{k: v.to(device) for k, v in random_row(config, s.exact_len, None, seed=step).items()}
            for step in range(OPTIMIZER_STEPS)]
    cfg = TrainConfig.from_flags(optimizer="adamw8bit", dtype="float32", cp=world, cp_strategy="ring",
                                 report_to=("none",), context_length=s.exact_len)
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


def checkpoint_load(s: Settings) -> dict[str, Any]:
    """A saved Gemma 3 vision-language checkpoint, built and loaded the trainer's way on this device
    (``build_model``: its text model on the meta device, made real here, the buffers no checkpoint
    holds put back, its tensors loaded), against transformers' ``from_pretrained`` of the whole
    model, both float32: the relative error of the logits on a row of one document. Gemma's
    embed_scale and its RoPE tables per layer type are in no checkpoint (Note [Buffers no checkpoint
    holds]): left as memory they cost an error of order 1. Full layers and one document: float32 on
    CUDA takes sdpa_efficient, which takes no window and has no varlen call. World of one. The
    checkpoint goes to a temporary directory, not the report's, whose files come back from the GPU."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from llama_cp.model.build import build_model

    device = _device(s)
    shape = {key: s.exact_model[key] for key in _SHAPE_FIELDS if key != "tie_word_embeddings"}
    text = dict(model_type="gemma3_text", **shape, layer_types=["full_attention"] * shape["num_hidden_layers"],
                max_position_embeddings=s.exact_len)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    vocab = shape["vocab_size"]
    config = AutoConfig.for_model("gemma3", text_config=text, vision_config=vision, mm_tokens_per_image=1,
                                  image_token_index=vocab - 3, boi_token_index=vocab - 2, eoi_token_index=vocab - 1)
    row = {k: v.to(device) for k, v in random_row(config.text_config, s.exact_len, None).items()}
    with tempfile.TemporaryDirectory() as path:
        torch.manual_seed(0)
        AutoModelForImageTextToText.from_config(config).save_pretrained(path)
        cfg = TrainConfig.from_flags(model_name=path, dtype="float32", context_length=s.exact_len, report_to="none")
        model = build_model(cfg, cfg.parallel.dims(1).build_mesh(device.type), device, path)
        whole = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).to(device)
        with torch.no_grad():
            got = model(input_ids=row["input_ids"], position_ids=row["position_ids"], use_cache=False).logits
            want = whole(input_ids=row["input_ids"], position_ids=row["position_ids"], use_cache=False).logits
    error = _relative(got.float(), want.float())
    return {"model": type(whole).__name__, "trained_as": type(model).__name__, "logits_rel_error": error,
            "pass": error <= 1e-4}


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
