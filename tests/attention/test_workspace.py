"""The CPU stand-ins of the CUDA attention kernels (llama_cp/attention/workspace.py): exact values
against the math backend, the tracked peak of each equal to Note [GPU attention kernels'
workspace] in llama_cp/attention/workspace.py, and the planner including that workspace."""

import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from llama_cp.attention import kernels
from llama_cp.attention.workspace import MODELLED, ModelledBackend, efficient_backward_workspace_bytes
from llama_cp.config import TrainConfig
from llama_cp.plan.memory import step_peak, track_peak_memory
from llama_cp.plan.simulate import planned_attention_backend, simulate_step_phases


def _round_up(x, m):
    return -(-x // m) * m


@pytest.mark.parametrize(
    "backend,causal,heads", list(itertools.product(MODELLED, [True, False], [(4, 4), (4, 2), (4, 1)]))
)
def test_stand_in_matches_math(backend, causal, heads):
    g = torch.Generator().manual_seed(0)
    sq = 24
    sk = sq if causal else 40
    h, hkv = heads
    q = torch.randn(2, sq, h, 16, generator=g).transpose(1, 2)  # HF's layout: a (B, S, H, D) tensor viewed
    k, v = (torch.randn(2, hkv, sk, 16, generator=g) for _ in range(2))
    dout = torch.randn(2, h, sq, 16, generator=g)
    out, lse = kernels.attention_forward(q, k, v, causal=causal, backend=ModelledBackend(backend))
    ref_out, ref_lse = kernels.attention_forward(q, k, v, causal=causal, backend="math")
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    grads = kernels.attention_backward(dout, q, k, v, out, lse, causal=causal, backend=ModelledBackend(backend))
    ref = kernels.attention_backward(dout, q, k, v, ref_out, ref_lse, causal=causal, backend="math")
    for name, got, want in zip("dq dk dv".split(), grads, ref):
        assert got.shape == want.shape, name
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


# Llama-3-8B's attention on 1000 tokens: B=1, H=32, Hkv=8, D=128, bf16.
B, S, H, HKV, D, E = 1, 1000, 32, 8, 128, 2


def _expected_peaks(backend, head_dim=D):
    """(forward, forward+backward) peak bytes of one call each, by Note [GPU attention kernels'
    workspace], the inputs q, k, v (and dout) included; all (B, H, S, head_dim) contiguous."""
    q_bytes, kv_bytes = B * S * H * head_dim * E, B * S * HKV * head_dim * E
    lse = B * H * S * 4
    inputs_fwd, inputs_bwd = q_bytes + 2 * kv_bytes, 2 * q_bytes + 2 * kv_bytes  # q, k, v (+ dout)
    softmax_d = B * H * _round_up(S, 128) * 4
    dq_accum = B * _round_up(S, 128) * H * _round_up(head_dim, 32) * 4
    if backend == "flash_attn":
        # forward: (B, S, H, D) copies of q, k, v; out; lse; rng_state (2 x int64)
        fwd = q_bytes + 2 * kv_bytes + q_bytes + lse + 16
        # backward: out and lse kept; copies of dout, q, k, v (out is laid out (B, S, H, D) already);
        # dq, dk, dv; softmax_d, dq_accum, dk/dv expanded to H heads
        bwd = q_bytes + lse + 2 * q_bytes + 2 * kv_bytes + q_bytes + 2 * kv_bytes + softmax_d + dq_accum + 2 * q_bytes
    elif backend == "sdpa_flash":
        # forward: K/V expanded to H heads; out; lse; the returned philox seed/offset and debug mask (24 bytes)
        fwd = 2 * q_bytes + q_bytes + lse + 24
        # backward: out, lse; K/V expanded; the zero philox scalar; dout and out copied to (B, S, H, D);
        # dq, dk, dv with H heads; softmax_d, dq_accum
        bwd = q_bytes + lse + 2 * q_bytes + 8 + 2 * q_bytes + 3 * q_bytes + softmax_d + dq_accum
    else:
        lse32 = B * H * _round_up(S, 32) * 4
        if head_dim <= 128:  # the 128 x 128 backward, dK/dV in registers; one value pass forward
            workspace = B * H * _round_up(_round_up(S, 128) // 128 * 1 * (4 + 128 * 128), 4) * 4
            fwd = 2 * q_bytes + q_bytes + lse32 + 16  # + the returned philox seed and offset
        else:  # the global-memory kernels: 128 x 64 backward tiles, dK/dV accumulated in float32 per key split
            splits = min(_round_up(S, 64) // 64, 200 // (B * H))
            per_head = (_round_up(S, 128) // 128) * (head_dim // 64) * (4 + 128 * 64) + 2 * splits * 64 * head_dim
            workspace = B * H * _round_up(per_head, 4) * 4
            fwd = 2 * q_bytes + q_bytes + lse32 + B * S * H * head_dim * 4  # + the float32 output accumulator
        assert workspace == efficient_backward_workspace_bytes(B, H, S, S, head_dim, head_dim)
        # backward: out, padded lse; K/V expanded; zero scalar; our lse padded again; dout copied;
        # grad q, k, v with H heads; delta; the workspace
        bwd = q_bytes + lse32 + 2 * q_bytes + 8 + lse32 + q_bytes + 3 * q_bytes + lse + workspace
    return inputs_fwd + fwd, inputs_bwd + max(fwd, bwd)


@pytest.mark.parametrize("backend,head_dim", [(b, D) for b in MODELLED] + [("sdpa_efficient", 256),
                                                                             ("sdpa_efficient", 512)])
def test_stand_in_peak_is_the_notes_formula(backend, head_dim):
    """Under fake tensors (what the planner runs), one forward and one forward+backward of
    each stand-in peak at exactly the bytes of the Note, for a GQA shape of Llama-3-8B (and
    Gemma 4's heads of 512 and Gemma 3's of 256, which take the global-memory kernels of sdpa_efficient)."""
    expected_fwd, expected_both = _expected_peaks(backend, head_dim)
    modelled = ModelledBackend(backend)

    def new(heads):
        return torch.empty(B, heads, S, head_dim, dtype=torch.bfloat16)

    with FakeTensorMode():
        with track_peak_memory() as fwd:
            q, k, v = new(H), new(HKV), new(HKV)
            kernels.attention_forward(q, k, v, causal=True, backend=modelled)
        with track_peak_memory() as both:
            q, k, v, dout = new(H), new(HKV), new(HKV), new(H)
            out, lse = kernels.attention_forward(q, k, v, causal=True, backend=modelled)
            dq, dk, dv = kernels.attention_backward(dout, q, k, v, out, lse, causal=True, backend=modelled)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert fwd["Total"] == expected_fwd
    assert both["Total"] == expected_both
    if backend == "flash_attn":  # the figure: dq_accum 16 MiB + 2 x 8 MB expanded dK/dV at 1000 tokens
        assert both["Total"] - fwd["Total"] > 16 * (1 << 20) + 2 * B * S * H * D * E


def test_efficient_workspace_of_wide_heads():
    """The memory-efficient backward's workspace for heads over 128, by hand from kernel_backward.h's
    workspace_size (128 x 64 tiles; dK/dV staged in float32 per key split, the splits capped at
    200 // (B x H)): Gemma 4's full layer, 32 heads of 512, one 4096-row block; and with few heads,
    where the key blocks bound the splits."""
    tiles = (4096 // 128) * (512 // 64)
    assert efficient_backward_workspace_bytes(1, 32, 4096, 4096, 512, 512) == 32 * 4 * (
        tiles * (4 + 128 * 64) + 2 * (200 // 32) * 64 * 512)
    # 2 heads, 100 keys: ceil(100 / 64) = 2 splits (not 100); value heads of 128 round up to 128 rows
    assert efficient_backward_workspace_bytes(1, 2, 100, 100, 192, 128) == 2 * 4 * _round_up(
        1 * 3 * (4 + 128 * 64) + 2 * 64 * 256 + 2 * 64 * 128, 4)
    # heads up to 128: no dK/dV staging, whatever the keys
    assert efficient_backward_workspace_bytes(1, 2, 100, 9999, 128, 128) == 2 * 4 * _round_up(4 + 128 * 128, 4)


def test_modelled_backend_names_a_cuda_backend():
    assert ModelledBackend("flash_attn") == "flash_attn" and isinstance(ModelledBackend("sdpa_flash"), str)
    with pytest.raises(ValueError, match="models the CUDA attention backends .* not 'sdpa_cpu'"):
        ModelledBackend("sdpa_cpu")


def _gqa_config():
    """tests/memory's mid-size Llama: 8 query heads, 2 key/value heads, head size 64, 3 layers."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, tie_word_embeddings=False, max_position_embeddings=1 << 20,
    )


def test_planner_auto_is_flash_attn_and_refusals():
    config = _gqa_config()
    assert planned_attention_backend(TrainConfig.from_flags(), config) == "flash_attn"
    assert planned_attention_backend(TrainConfig.from_flags(attention_backend="sdpa_cpu"), config) == "sdpa_cpu"
    fp32 = TrainConfig.from_flags(dtype="float32", attention_backend="flash_attn")
    with pytest.raises(ValueError, match=r"^--attention_backend flash_attn cannot run here: flash_attn takes "
                                         r"float16/bfloat16 only, not torch.float32; .*: sdpa_efficient, math$"):
        planned_attention_backend(fp32, config)


@pytest.mark.slow  # plans under fake tensors: seconds each (the floors job runs it: .ci/run)
def test_planner_includes_flash_attn_workspace():
    """A GQA model whose attention dominates (16 query heads of 128, 2 key/value heads, small
    MLP, tiled MLP/norms, chunked loss), one rank, 4096 tokens: the flash_attn plan exceeds the
    sdpa_cpu plan by at least flash-attn's per-sequence float32 dq_accum, which nothing on the
    CPU path holds. (Not by dq_accum + the expanded dK/dV: the sdpa_cpu plan peaks at another
    moment of the layer's backward, so the two plans differ by less than the whole workspace.)"""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=2048, hidden_size=512, intermediate_size=512, num_hidden_layers=2, num_attention_heads=16,
        num_key_value_heads=2, head_dim=128, tie_word_embeddings=False, max_position_embeddings=1 << 20,
    )
    tokens, heads, head_dim = 4096, config.num_attention_heads, config.head_dim
    flags = dict(context_length=tokens, use_peft=True, activation_checkpointing=True, dtype="bfloat16",
                 loss_chunk_size=256, mlp_tile_size=256, norm_tile_size=256)
    peaks = {b: step_peak(simulate_step_phases(TrainConfig.from_flags(attention_backend=b, **flags), 1,
                                               model_config=config)).total
             for b in ("sdpa_cpu", "flash_attn")}
    dq_accum = _round_up(tokens, 128) * heads * _round_up(head_dim, 32) * 4
    assert peaks["flash_attn"] - peaks["sdpa_cpu"] >= dq_accum


@pytest.mark.slow  # plans under fake tensors: seconds each (the floors job runs it: .ci/run)
def test_plan_memory_says_which_backend_it_models(capsys):
    import json

    from recipes.plan_memory import main

    for flags, backend in (({}, "flash_attn"), ({"attention_backend": "sdpa_efficient"}, "sdpa_efficient")):
        main(model_name="embedded", num_gpus=1, context_length=256, json=True, **flags)
        lines = capsys.readouterr().out.strip().splitlines()
        assert f", attention {backend}" in lines[0]
        assert json.loads(lines[-1])["attention_backend"] == backend


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [dict(), dict(cp=2), dict(cp=2, cp_strategy="ulysses")],
                         ids=["cp1", "ring", "ulysses"])
def test_plan_of_one_tile_per_shape_equals_every_tile(parallel, monkeypatch):
    """Note [Planning tiles]: under fake tensors the planner runs a few attention tiles, MLP
    and norm tiles and loss chunks of each shape; the tracked peak, phase by phase and
    category by category, equals that of running every tile: 640 tokens per attention call
    in 128-token blocks (ragged in the ring: its zigzag halves are 320), MLP/norm tiles of
    96 (a ragged last one) and loss chunks of 128."""
    from transformers import LlamaConfig

    from llama_cp.modules import tiling

    config = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, tie_word_embeddings=False, max_position_embeddings=1 << 16,
    )
    world = parallel.get("cp", 1)
    cfg = TrainConfig.from_flags(context_length=1280 if world == 2 else 640, use_peft=True, dtype="bfloat16",
                                 activation_checkpointing=True, attention_block_size=128, mlp_tile_size=96,
                                 norm_tile_size=96, loss_chunk_size=128, **parallel)
    calls = []
    real = kernels.attention_forward

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "attention_forward", counted)
    phases = {}
    for every in (True, False):
        monkeypatch.setattr(tiling, "PLAN_EVERY_TILE", every)
        calls.clear()
        phases[every] = simulate_step_phases(cfg, world, model_config=config)
        phases[every, "calls"] = len(calls)
    assert phases[True] == phases[False]
    assert phases[False, "calls"] * 4 < phases[True, "calls"]  # the shortcut really skipped tiles
