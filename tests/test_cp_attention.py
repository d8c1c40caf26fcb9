"""Context-parallel attention on 4 CPU ranks (gloo), against single-process references.

One process group for the whole module (see dist_harness.py). World 4 gives a
cp=4 mesh (dp_shard=1) and a cp=2 mesh (dp_shard=2, two cp groups side by side).
"""

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from dist_harness import Checks
from probes import LargestTensor
from llama_cp import ParallelDims, apply_context_parallel, shard_batch
from llama_cp.cp_attention import ContextParallelAttention
from llama_cp.parallel.sharding import unshard
from llama_cp.parallel.sharding import shard_sequence

WORLD_SIZE = 4
checks = Checks(setup=lambda sizes: [cp_mesh(cp) for cp in sorted(sizes)])  # the cp groups' meshes


@functools.cache
def cp_mesh(cp: int):
    """The ``cp`` sub-mesh of a (1, 4/cp, cp) mesh; built once per size, in the same order on all ranks."""
    return ParallelDims(dp_shard=WORLD_SIZE // cp, cp=cp).build_mesh("cpu")["cp"]


def tiny_llama(heads=8, kv_heads=8, dtype=torch.float32, layers=2, seed=0) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=128, hidden_size=8 * heads, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8,
        max_position_embeddings=4096, attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(dtype)


# (logits, gradients). fp32 gradients sum many more terms than logits, in a different order
# per layout, so they get 1e-4; the fp64 cases show the remaining difference is rounding.
TOLERANCES = {
    torch.float64: (dict(atol=1e-10, rtol=1e-10), dict(atol=1e-10, rtol=1e-10)),
    torch.float32: (dict(atol=1e-5, rtol=1e-5), dict(atol=1e-4, rtol=1e-4)),
    torch.bfloat16: (dict(atol=2e-2, rtol=2e-2), None),
}


def check_model(strategy, cp, heads, kv_heads, dtype=torch.float32, seq_len=64):
    """Sharded CP logits equal the full-sequence logits; cp-summed grads equal the full grads."""
    mesh = cp_mesh(cp)
    reference = tiny_llama(heads, kv_heads, dtype)
    model = copy.deepcopy(reference)
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 128, (2, seq_len), generator=g)

    ref_logits = reference(input_ids=input_ids).logits
    cotangent = torch.randn(ref_logits.shape, generator=g).to(dtype)
    (ref_logits * cotangent).sum().backward()

    apply_context_parallel(model, mesh, strategy=strategy)
    local = shard_batch({"input_ids": input_ids}, mesh)
    logits = model(**local).logits
    local_cotangent = shard_sequence(cotangent, cp, mesh.get_local_rank())
    (logits * local_cotangent).sum().backward()

    logits_tol, grad_tol = TOLERANCES[dtype]
    torch.testing.assert_close(unshard(logits.detach(), mesh), ref_logits.detach(), **logits_tol)
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters(), strict=True):
        grad = param.grad.clone() if grad_tol else param.grad.float()
        dist.all_reduce(grad, group=mesh.get_group())
        if grad_tol:
            torch.testing.assert_close(grad, ref_param.grad, **grad_tol, msg=lambda m: f"{name}: {m}")
        else:  # bf16: compare the whole tensor by relative norm, element-wise rounding is noisy
            error = (grad - ref_param.grad.float()).norm() / ref_param.grad.float().norm()
            assert error < 3e-2, f"{name}: relative gradient error {error:.3g}"


MODEL_CASES = [
    (strategy, cp, heads, kv_heads)
    for strategy in ("ring", "ulysses")
    for cp in (2, 4)
    for heads, kv_heads in ((8, 8), (8, 2), (8, 1))
]
for _case in MODEL_CASES:
    for _dtype, _dtype_name in ((torch.float32, "fp32"), (torch.float64, "fp64")):
        checks.add(
            functools.partial(check_model, *_case, _dtype), name="model_{}_cp{}_h{}_kv{}_".format(*_case) + _dtype_name,
            group=_case[1],  # Note [Checks side by side] in dist_harness.py
        )
for _strategy in ("ring", "ulysses"):
    checks.add(functools.partial(check_model, _strategy, 2, 8, 2, torch.bfloat16), name=f"model_{_strategy}_cp2_h8_kv2_bf16",
               group=2)


def check_kernel(strategy, cp, causal, kv_heads):
    """dq/dk/dv of CP attention on zigzag shards equal full-sequence SDPA's."""
    mesh = cp_mesh(cp)
    rank = mesh.get_local_rank()
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 32, 16, generator=g)
    k = torch.randn(2, kv_heads, 32, 16, generator=g)
    v = torch.randn(2, kv_heads, 32, 16, generator=g)
    dout = torch.randn(2, 4, 32, 16, generator=g)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    rep = 4 // kv_heads
    ref_out = F.scaled_dot_product_attention(
        ref[0], ref[1].repeat_interleave(rep, 1), ref[2].repeat_interleave(rep, 1), is_causal=causal
    )
    ref_out.backward(dout)

    local = [shard_sequence(t, cp, rank, seq_dim=2).requires_grad_() for t in (q, k, v)]
    attention = ContextParallelAttention(group=mesh.get_group(), strategy=strategy)
    out = attention(*local, causal=causal, scale=None)
    out.backward(shard_sequence(dout, cp, rank, seq_dim=2))
    torch.testing.assert_close(unshard(out.detach(), mesh, seq_dim=2), ref_out.detach(), atol=1e-5, rtol=1e-5)
    for name, got, want in zip("qkv", local, ref, strict=True):
        torch.testing.assert_close(
            unshard(got.grad, mesh, seq_dim=2), want.grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"d{name}: {m}"
        )


for _strategy in ("ring", "ulysses"):
    for _cp in (2, 4):
        for _causal in (True, False):
            for _kv in (4, 1):
                checks.add(
                    functools.partial(check_kernel, _strategy, _cp, _causal, _kv),
                    name=f"kernel_{_strategy}_cp{_cp}_{'causal' if _causal else 'full'}_kv{_kv}", group=_cp,
                )


def check_tiled_kernel(strategy, causal, kv_heads, block_size, documents, dtype):
    """Tiled CP attention (Note [Tiled attention]) at cp 2 equals the untiled CP attention and the
    single-process full-sequence attention: out, dq, dk, dv; with packed documents too."""
    from llama_cp.attention.documents import DocumentLayout
    from llama_cp.attention.local import local_attention
    from llama_cp.parallel.sharding import document_starts

    cp, seq = 2, 32
    mesh = cp_mesh(cp)
    rank = mesh.get_local_rank()
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 4, seq, 16, generator=g).to(dtype)
    k, v = (torch.randn(2, kv_heads, seq, 16, generator=g).to(dtype) for _ in range(2))
    dout = torch.randn(2, 4, seq, 16, generator=g).to(dtype)
    position_ids = torch.arange(seq).repeat(2, 1)
    if documents:  # row 0: documents of 5, 1 and 26 tokens; row 1: 20 and 12 (spanning both ranks)
        position_ids[0, 5:] -= 5
        position_ids[0, 6:] -= 1
        position_ids[1, 20:] -= 20
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    layout = DocumentLayout(document_starts(position_ids)) if documents else None
    ref_out = local_attention(*ref, causal=causal, scale=0.25, backend=None, block_size=0,
                              block=layout.ring_pieces(0) if documents else None)
    ref_out.backward(dout)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-10, rtol=1e-10)
    results = []
    for size in (0, block_size):
        attention = ContextParallelAttention(group=mesh.get_group(), strategy=strategy, block_size=size)
        local_documents = attention.document_layout(shard_sequence(position_ids, cp, rank)) if documents else None
        local = [shard_sequence(t, cp, rank, seq_dim=2).requires_grad_() for t in (q, k, v)]
        out = attention(*local, causal=causal, scale=0.25, documents=local_documents)
        out.backward(shard_sequence(dout, cp, rank, seq_dim=2))
        results.append([unshard(t, mesh, seq_dim=2) for t in (out.detach(), *(x.grad for x in local))])
    for name, untiled, tiled, want in zip(("out", "dq", "dk", "dv"), *results, (ref_out.detach(), *(t.grad for t in ref)),
                                          strict=True):
        torch.testing.assert_close(tiled, untiled, **tol, msg=lambda m: f"{name} tiled vs untiled: {m}")
        torch.testing.assert_close(tiled, want, **tol, msg=lambda m: f"{name} tiled vs one process: {m}")


for _strategy in ("ring", "ulysses"):
    for _causal, _documents in ((True, False), (False, False), (True, True)):
        for _kv, _block in ((4, 8), (2, 5), (1, 3)):
            for _dtype in (torch.float32, torch.float64):
                checks.add(
                    functools.partial(check_tiled_kernel, _strategy, _causal, _kv, _block, _documents, _dtype),
                    name=f"tiled_{_strategy}_cp2_{'documents' if _documents else 'causal' if _causal else 'full'}"
                         f"_kv{_kv}_block{_block}_{str(_dtype)[6:]}", group=2,
                )


@checks.add(group=1)
def cp1_matches_stock_sdpa():
    reference = tiny_llama(8, 2)
    model = apply_context_parallel(copy.deepcopy(reference), cp_mesh(1), strategy="ring")
    input_ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(3))
    want = reference(input_ids=input_ids).logits
    got = model(**shard_batch({"input_ids": input_ids}, cp_mesh(1))).logits
    assert reference.config._attn_implementation == "sdpa"
    assert model.config._attn_implementation == "llama_cp"
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@checks.add
def ring_sends_native_kv_heads():
    """Each forward ring step sends exactly K and V with their own (not expanded) head count."""
    cp, batch, seq_len, kv_heads, head_dim = 4, 2, 64, 2, 8
    mesh = cp_mesh(cp)
    model = apply_context_parallel(tiny_llama(8, kv_heads, layers=1), mesh, strategy="ring")
    input_ids = torch.randint(0, 128, (batch, seq_len), generator=torch.Generator().manual_seed(4))
    sent_per_call = []
    original = dist.batch_isend_irecv

    def recording(ops):
        sent_per_call.append(sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend))
        return original(ops)

    dist.batch_isend_irecv = recording
    try:
        with torch.no_grad():
            model(**shard_batch({"input_ids": input_ids}, mesh))
    finally:
        dist.batch_isend_irecv = original
    expected = 2 * batch * (seq_len // cp) * kv_heads * head_dim * 4  # K and V, fp32
    assert sent_per_call == [expected] * (cp - 1), (sent_per_call, expected)


@checks.add(group=2)
def no_seq_by_seq_tensor_in_cp_forward_backward():
    seq_len, cp = 1024, 2
    mesh = cp_mesh(cp)
    input_ids = torch.randint(0, 128, (1, seq_len), generator=torch.Generator().manual_seed(5))
    for strategy in ("ring", "ulysses"):
        model = apply_context_parallel(tiny_llama(8, 2), mesh, strategy=strategy)
        batch = shard_batch({"input_ids": input_ids}, mesh)
        with LargestTensor() as largest:
            model(**batch).logits.sum().backward()
        # largest legitimate tensors: local logits / MLP activations, 512 x 128 elements
        assert largest.numel < seq_len * seq_len // 8, (strategy, largest.numel, largest.op)
    # the detector does see an (L, L) score matrix when one exists: eager attention, one rank
    eager = tiny_llama(8, 2)
    eager.set_attn_implementation("eager")
    with LargestTensor() as largest:
        eager(input_ids=input_ids).logits.sum().backward()
    assert largest.numel >= seq_len * seq_len, largest.numel


@checks.add
def clear_errors():
    with pytest.raises(ValueError, match=r"divisible by 2 x cp = 8; pad or truncate it to 24 or 32"):
        shard_batch({"input_ids": torch.zeros(1, 30, dtype=torch.long)}, cp_mesh(4))
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\) divisible by cp \(4\); use cp_strategy='ring'"):
        apply_context_parallel(tiny_llama(6, 6), cp_mesh(4), strategy="ulysses")
    with pytest.raises(ValueError, match="unknown cp strategy 'zigzag'"):
        apply_context_parallel(tiny_llama(), cp_mesh(2), strategy="zigzag")
    with pytest.raises(ValueError, match=r"dp_replicate\(1\) \* dp_shard\(3\) \* cp\(2\) != world_size\(4\)"):
        ParallelDims(dp_shard=3, cp=2)


@checks.add
def mesh_has_named_and_flattened_dims():
    mesh = ParallelDims(dp_shard=2, cp=2).build_mesh("cpu")
    assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "cp")
    assert (mesh["dp_replicate"].size(), mesh["dp_shard"].size(), mesh["cp"].size()) == (1, 2, 2)
    assert mesh["dp_shard_cp"].size() == 4 and mesh["dp"].size() == 2
    rank = dist.get_rank()
    assert mesh["cp"].get_local_rank() == rank % 2 and mesh["dp"].get_local_rank() == rank // 2


results = checks.module_fixture(__name__, WORLD_SIZE)


@pytest.mark.parametrize("name", checks.names)
def test_check(results, name):
    checks.assert_passed(results, name)
