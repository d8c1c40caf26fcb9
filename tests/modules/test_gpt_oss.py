"""gpt_oss (GptOssForCausalLM) under context parallelism against plain single-process transformers
(eager attention: transformers has no SDPA path for it) on 4 CPU ranks (gloo), with the BASE model,
batch, meshes and tolerances of tests/modules/test_families.py.

What gpt_oss adds, each made to count (``features_change_the_result`` records how far the logits or
the loss move without it): learned per-head sinks, set by hand to -1 .. 4 (Note [Attention sinks
under CP] in llama_cp/attention/sinks.py); a 6-token window on layer 0, shorter than a zigzag chunk
at cp 2 and longer at cp 4, next to a full layer 1; experts with the clamped SwiGLU (limit 0.1) and
the router's load-balancing loss; non-zero biases (transformers initialises them to zero). Checked:
logits, chunked loss and every gradient (the sinks' included) under ring, Ulysses, all-gather and
hybrid, cp 1, 2 and 4, plain and FSDP, float32 and float64, packed documents, LoRA on attention and
on the fused experts (peft's target_parameters). gpt_oss's RMSNorm and router loss compute in
float32 whatever the dtype, so its float64 runs agree to float32 precision (1e-5); the sink's own
math is checked in float64 to 1e-12 on one process (``test_sink_step_is_the_extra_softmax_column``).
"""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from dist_harness import Checks
from document_checks import documents_batch
from fsdp_checks import check_cp_against_reference
from llama_cp.attention import kernels
from llama_cp.attention.sinks import add_sinks, sink_gradient
from llama_cp.modules.families import transformers_refusal
from test_families import (
    BASE, FUSED_EXPERTS_LORA_PROBLEM, SEQ_LEN, TOLERANCE, TRANSFORMERS_5, WINDOW, WORLD_SIZE, batch, mesh_for, rope,
)

checks = Checks(setup=lambda sizes: [mesh_for(cp) for cp in sorted(sizes)])
SKIP = (f"transformers {transformers.__version__} has no gpt_oss" if "gpt_oss" not in CONFIG_MAPPING_NAMES
        else transformers_refusal("gpt_oss", transformers.__version__))
TOL = TOLERANCE[torch.float32]  # float32 norms and router loss (module docstring)

GPT_OSS = dict(
    BASE, attn_implementation="eager", intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
    layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW, swiglu_limit=0.1,
    output_router_logits=True, router_aux_loss_coef=0.3,
    **rope(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
           original_max_position_embeddings=64),
)
#: the sinks of layer 0's heads; layer i adds i
SINKS = (-1.0, 0.5, 1.5, 3.0)
#: documents of each packed row (SEQ_LEN tokens): split across zigzag chunks at cp 2 and 4, one of 1 token
PACKED_LENGTHS = [[5, 1, 14, 12], [9, 23]]


def gpt_oss_model(dtype=torch.float32, sinks=SINKS, **overrides):
    """The tiny gpt_oss in ``dtype``, its sinks set to ``sinks`` (+ the layer index) and its biases
    (attention, router, experts) non-zero."""
    config = AutoConfig.for_model("gpt_oss", **{**GPT_OSS, **overrides})
    torch.manual_seed(0)
    experts = {"experts_implementation": "eager"} if TRANSFORMERS_5 else {}  # grouped_mm takes no float64
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, **experts).to(dtype)  # norms kept in float32
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for index, layer in enumerate(model.model.layers):
            layer.self_attn.sinks.copy_(torch.tensor(sinks, dtype=dtype) + index)
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.rand(param.shape, generator=generator, dtype=dtype) - 0.5)
    return model


def packed_data() -> dict[str, torch.Tensor]:
    return documents_batch(batch()["input_ids"], PACKED_LENGTHS)


def reference_forward(model, data, lengths=None):
    """(logits, loss with the router's) of single-process transformers on whole rows, or with
    ``lengths``, each packed document on its own: transformers 5.24's GptOssModel builds its masks
    without position_ids (models/gpt_oss/modeling_gpt_oss.py, ``mask_kwargs``), so on a packed row it
    attends across documents, where llama-cp (--document_mask) and transformers' Llama do not."""
    from transformers.models.gpt_oss.modeling_gpt_oss import load_balancing_loss_func

    if lengths is None:
        outputs = [model(input_ids=data["input_ids"], use_cache=False)]
        logits = outputs[0].logits
    else:
        outputs, rows = [], []
        for row, row_lengths in enumerate(lengths):
            starts = [sum(row_lengths[:i]) for i in range(len(row_lengths))]
            outputs += [model(input_ids=data["input_ids"][row:row + 1, a:a + n], use_cache=False,
                              position_ids=data["position_ids"][row:row + 1, a:a + n])
                        for a, n in zip(starts, row_lengths)]
            rows.append(torch.cat([o.logits for o in outputs[-len(row_lengths):]], dim=1))
        logits = torch.cat(rows)
    router_logits = tuple(torch.cat(layer) for layer in zip(*(o.router_logits for o in outputs)))
    config = model.config
    aux = load_balancing_loss_func(router_logits, config.num_local_experts, config.num_experts_per_tok)
    if lengths is None:  # the same as the model's own
        torch.testing.assert_close(aux, outputs[0].aux_loss)
    loss = F.cross_entropy(logits.flatten(0, 1), data["labels"].flatten(), ignore_index=-100)
    return logits, loss + config.router_aux_loss_coef * aux


def with_lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], init_lora_weights=False))


@functools.cache
def reference(dtype: torch.dtype, packed: bool = False, lora: bool = False):
    """(pristine, reference, data, logits, loss), built once per rank: ``reference`` after its
    forward and backward (the checks read its gradients), ``pristine`` an untouched copy."""
    model = gpt_oss_model(dtype)
    if lora:
        model = with_lora(model)
    pristine = copy.deepcopy(model)
    data = packed_data() if packed else batch()
    logits, loss = reference_forward(model, data, PACKED_LENGTHS if packed else None)
    loss.backward()
    return pristine, model, data, logits.detach(), loss.detach()


def check(strategy: str, cp: int, sharded: bool, dtype: torch.dtype, packed: bool = False, lora: bool = False,
          block_size: int = 0):
    pristine, model, data, logits, loss = reference(dtype, packed, lora)
    check_cp_against_reference(copy.deepcopy(pristine), model, data, logits, loss, mesh_for(cp), strategy=strategy,
                               sharded=sharded, tol=TOL, max_seq_len=SEQ_LEN, block_size=block_size,
                               ulysses_degree=2 if strategy == "hybrid" else 0)


F32, F64 = torch.float32, torch.float64
#: (strategy, cp, FSDP, dtype, packed documents)
RUNS = [("ring", 1, False, F64, False), ("ring", 2, False, F64, False), ("ring", 4, True, F32, False),
        ("ulysses", 2, True, F32, False), ("ulysses", 4, False, F64, False), ("allgather", 2, False, F32, False),
        ("allgather", 4, True, F64, False), ("hybrid", 4, False, F64, False), ("hybrid", 4, True, F32, False),
        ("ring", 1, False, F64, True), ("ring", 4, False, F64, True), ("ulysses", 2, False, F32, True),
        ("allgather", 4, False, F64, True), ("hybrid", 4, True, F32, True)]
for _strategy, _cp, _sharded, _dtype, _packed in RUNS:
    checks.add(functools.partial(check, _strategy, _cp, _sharded, _dtype, _packed),
               name=f"{_strategy}_cp{_cp}_{'fsdp' if _sharded else 'plain'}_{str(_dtype)[6:]}"
                    f"{'_packed' if _packed else ''}",
               skip=SKIP, group=None if _sharded else _cp)
for _strategy, _cp in (("ring", 2), ("ulysses", 4)):  # kernel calls of 3 x 3 (Note [Tiled attention]), merged first
    checks.add(functools.partial(check, _strategy, _cp, False, F64, True, block_size=3),
               name=f"{_strategy}_cp{_cp}_plain_float64_packed_tiled", skip=SKIP, group=_cp)


@functools.partial(checks.add, skip=SKIP or FUSED_EXPERTS_LORA_PROBLEM)
def lora_on_attention_and_experts_ulysses_cp4_fsdp_float64():
    """peft's LoRA on q_proj/v_proj and on the fused, transposed experts (target_parameters): exact;
    the frozen sinks get no gradient."""
    pristine = reference(F64, lora=True)[0]
    assert sum("experts" in name for name, p in pristine.named_parameters() if p.requires_grad) == 8
    assert not any(p.requires_grad for name, p in pristine.named_parameters() if name.endswith("sinks"))
    check("ulysses", 4, True, F64, lora=True)


@functools.partial(checks.add, group=1, skip=SKIP)
def features_change_the_result():
    """Each feature moves the logits (the router loss: the loss) by more than 1e-3 when switched off:
    the sinks (at -inf: no sink column), the window, the SwiGLU clamp, the router loss, and
    documents run alone against transformers' packed rows (the reference of the packed checks)."""
    data = packed_data()
    ids = data["input_ids"]
    with torch.no_grad():
        on = gpt_oss_model()(input_ids=ids).logits
        moved = {
            "sinks": gpt_oss_model(sinks=(float("-inf"),) * 4)(input_ids=ids).logits,
            "window": gpt_oss_model(sliding_window=SEQ_LEN)(input_ids=ids).logits,
            "documents alone": reference_forward(gpt_oss_model(), data, PACKED_LENGTHS)[0],
        }
        if TRANSFORMERS_5:  # 4.x clamps at 7.0 whatever the config (models/gpt_oss GptOssExperts.limit)
            moved["SwiGLU clamp"] = gpt_oss_model(swiglu_limit=1e9)(input_ids=ids).logits
        moved = {name: float((logits - on).abs().max()) for name, logits in moved.items()}
        with_router = reference_forward(gpt_oss_model(), batch())[1]
        without = reference_forward(gpt_oss_model(router_aux_loss_coef=0.0), batch())[1]
        moved["router loss"] = float((with_router - without).abs())
    assert min(moved.values()) > 1e-3, moved


def save_mxfp4_checkpoint(path: str) -> None:
    """A tiny gpt_oss checkpoint as gpt-oss ships (Note [MXFP4 checkpoints] in llama_cp/model/build.py):
    the experts' weights as random MXFP4 ``*_blocks`` and ``*_scales`` (transformers 5.24 writes MXFP4
    only with triton kernels, which a CPU lacks), quantization_config quant_method mxfp4."""
    import json
    import os

    from safetensors.torch import load_file, save_file

    gpt_oss_model(intermediate_size=32).save_pretrained(path)  # MXFP4 blocks hold 32 values: I % 32 == 0
    file = os.path.join(path, "model.safetensors")
    state, generator = load_file(file), torch.Generator().manual_seed(5)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, fan_in, fan_out = state.pop(name).shape  # stored (E, out, in / 32, 16): two FP4 values a byte
        state[name + "_blocks"] = torch.randint(0, 256, (experts, fan_out, fan_in // 32, 16), generator=generator,
                                                dtype=torch.uint8)
        state[name + "_scales"] = torch.randint(124, 130, (experts, fan_out, fan_in // 32), generator=generator,
                                                dtype=torch.uint8)  # 2^-3 .. 2^2
    save_file(state, file, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


@functools.partial(checks.add, skip=SKIP)
def mxfp4_checkpoint_loads_dequantized_through_build_model_cp2():
    """build_model on an MXFP4 checkpoint (ring, cp 2 x dp_shard 2, FSDP): says so in one line, and
    its experts are transformers' dequantization (Mxfp4Config(dequantize=True); 4.56.2's in bfloat16, exact
    for FP4 values times powers of two); the model's
    config no longer claims MXFP4, and its logits are those of the dequantized model."""
    import contextlib
    import io

    import torch.distributed as dist
    from transformers import Mxfp4Config

    from dist_harness import shared_tmpdir
    from fsdp_checks import full_param
    from llama_cp import TrainConfig
    from llama_cp.model.build import MXFP4_LINE, build_model
    from llama_cp.parallel.sharding import shard_batch, unshard

    with shared_tmpdir() as path:
        if dist.get_rank() == 0:
            save_mxfp4_checkpoint(path)
        dist.barrier()
        cfg = TrainConfig.from_flags(model_name=path, cp=2, dp_shard=2, cp_strategy="ring", report_to="none")
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            model = build_model(cfg, mesh_for(2), torch.device("cpu"), path)
        assert printed.getvalue() == (MXFP4_LINE + "\n" if dist.get_rank() == 0 else ""), printed.getvalue()
        assert getattr(model.config, "quantization_config", None) is None
        experts = {"experts_implementation": "eager"} if TRANSFORMERS_5 else {}
        want = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **experts,
                                                    quantization_config=Mxfp4Config(dequantize=True)).float()
        got = dict(model.named_parameters())
        for name, param in want.named_parameters():
            torch.testing.assert_close(full_param(got[name]), param.detach(), atol=0, rtol=0)
        assert want.model.layers[0].mlp.experts.down_proj.abs().max() > 1  # dequantized, not zero or raw bytes
        data = batch()
        with torch.no_grad():
            local = shard_batch(data, mesh_for(2)["cp"])
            logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
            torch.testing.assert_close(unshard(logits, mesh_for(2)["cp"]), want(input_ids=data["input_ids"]).logits,
                                       **TOL)


results = checks.module_fixture(__name__, WORLD_SIZE)


@pytest.mark.parametrize("name", checks.names)
def test_check(results, name):
    checks.assert_passed(results, name)


def test_sink_step_is_the_extra_softmax_column():
    """Note [Attention sinks under CP] in float64, against autograd through the softmax with the sink
    column (transformers' eager gpt_oss): out', lse', dq, dk, dv and d sinks to 1e-12, with rows that see
    no key (out' = 0, lse' = s_h) and a head whose sink is -inf (out' = out, no gradient)."""
    torch.manual_seed(0)
    b, h, hkv, sq, sk, d, lag = 2, 4, 2, 8, 5, 1, 1  # query i sees keys j >= i - 1: rows 6 and 7 see none
    q, k, v, dout = (torch.randn(b, n, s, d, dtype=F64) for n, s in ((h, sq), (hkv, sk), (hkv, sk), (h, sq)))
    sinks = torch.tensor([0.3, float("-inf"), 2.0, -1.0], dtype=F64)
    out, lse = kernels.attention_forward(q, k, v, causal=False, scale=0.4, backend="math", lag=lag)
    out_s, lse_s = add_sinks(out, lse, sinks)
    grads = kernels.attention_backward(dout, q, k, v, out_s, lse_s, causal=False, scale=0.4, backend="math", lag=lag)
    dsinks = sink_gradient(dout, out_s, lse_s, sinks)

    qr, kr, vr, sr = (t.clone().requires_grad_() for t in (q, k, v, sinks))
    scores = qr @ kr.repeat_interleave(h // hkv, 1).transpose(-1, -2) * 0.4
    hidden = torch.arange(sq)[:, None] - torch.arange(sk)[None, :] > lag
    logits = torch.cat([scores.masked_fill(hidden, float("-inf")), sr[:, None, None].expand(b, h, sq, 1)], dim=-1)
    seen = ~(hidden.all(-1)[None, None, :, None] & (sinks == float("-inf"))[None, :, None, None])
    probs = torch.softmax(logits.where(seen, 0.0), dim=-1).where(seen, 0.0)  # no key and no sink: nothing
    want = probs[..., :-1] @ vr.repeat_interleave(h // hkv, 1)
    want.backward(dout)
    torch.testing.assert_close(out_s, want.detach(), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse_s, torch.logsumexp(logits.detach(), -1), atol=1e-12, rtol=1e-12)
    for got, ref in zip((*grads, dsinks), (qr.grad, kr.grad, vr.grad, sr.grad)):
        torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-12)
    assert (out_s[:, :, 6:] == 0).all() and (lse_s[:, 0, 6:] == 0.3).all()  # no key: the sink alone
    assert torch.equal(out_s[:, 1], out[:, 1]) and dsinks[1] == 0


def test_s_aux_of_another_shape_is_refused():
    """cp_attention_forward computes one sink per query head; an s_aux of another shape is refused
    in one line naming it."""
    from llama_cp import apply_context_parallel
    from llama_cp.cp_attention import cp_attention_forward

    if SKIP:
        pytest.skip(SKIP)
    layer = apply_context_parallel(gpt_oss_model(), None).model.layers[1].self_attn
    q = k = v = torch.randn(1, 4, 8, 8)
    with pytest.raises(ValueError, match=r"^GptOssAttention passes s_aux= of shape \(2,\); context-parallel "
                                         r"attention computes one sink logit per query head, shape \(4,\)$"):
        cp_attention_forward(layer, q, k, v, None, s_aux=torch.zeros(2))
    with_sinks = cp_attention_forward(layer, q, k, v, None, s_aux=torch.zeros(4))[0]
    assert not torch.allclose(with_sinks, cp_attention_forward(layer, q, k, v, None)[0])


def test_model_flops_are_what_the_flop_counter_measures():
    """model_flops of gpt_oss (k of E experts, gate_up and down at intermediate_size, the router) are
    what FlopCounterMode measures on a forward and backward: the linear layers per token, eager
    attention all L x L pairs; the sinks add no matmul (tests/plan/test_families_plan.py's check)."""
    from torch.utils.flop_counter import FlopCounterMode

    from llama_cp.model.flops import model_flops

    if SKIP:
        pytest.skip(SKIP)
    model = gpt_oss_model()
    ids = batch()["input_ids"]
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    by_module = counter.get_flop_counts()
    measured = {str(op): flops for op, flops in by_module["Global"].items()}
    for module, by_op in by_module.items():  # the rotary table is no model FLOP
        if module.endswith("rotary_emb"):
            for op, flops in by_op.items():
                measured[str(op)] -= flops
    flops = model_flops(model.config)
    assert measured["aten.mm"] + measured["aten.addmm"] == flops.per_token * ids.numel()
    assert measured["aten.bmm"] == flops.per_pair * ids.shape[0] * ids.shape[1] ** 2
    assert flops.windows == (WINDOW, None)


@pytest.mark.slow  # a simulation, ~1.5 s
def test_the_planner_plans_it():
    """The planner simulates the trainer's step of the tiny gpt_oss at cp 2 (its window planned as
    full attention, an upper bound: llama_cp/plan/simulate.py). Without the router loss: with it, the
    planner's fake tensors stop at loss.router_statistics' bincount (DynamicOutputShapeException, any
    MoE family; Mixtral too)."""
    from llama_cp.config import TrainConfig
    from llama_cp.plan.simulate import plan_step_memory

    if SKIP or not TRANSFORMERS_5:
        pytest.skip(SKIP or f"transformers {transformers.__version__} routes its experts by torch.where on the "
                            "router's choice, which fake tensors cannot simulate")
    fields = {k: v for k, v in GPT_OSS.items() if k != "attn_implementation"}
    config = AutoConfig.for_model("gpt_oss", **{**fields, "output_router_logits": False})
    plan = plan_step_memory(TrainConfig.from_flags(context_length=64, cp=2, report_to="none"), 2, model_config=config)
    assert plan.total > 0 and plan.activations > 0
