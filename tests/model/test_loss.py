"""Chunked linear cross-entropy: value, gradients and memory, single process."""

import pytest
import torch
import torch.nn.functional as F
import torch.utils._python_dispatch

from llama_cp.model.cross_entropy import linear_cross_entropy
from llama_cp.modules.families import LogitTransform
from llama_cp.plan.memory import track_peak_memory


@pytest.mark.parametrize("chunk_size", [1, 5, 64, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_cross_entropy_on_full_logits(chunk_size, dtype):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 21, 16, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, 50, (3, 21), generator=g)
    labels[0, :7] = -100
    labels[2, 3] = -100
    want = F.cross_entropy((hidden @ weight.t()).flatten(0, 1), labels.flatten(), reduction="sum")
    want_grads = torch.autograd.grad(want, (hidden, weight))
    got = linear_cross_entropy(hidden, weight, labels, chunk_size=chunk_size)
    got_grads = torch.autograd.grad(got * 1.0, (hidden, weight))
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(got.to(dtype), want, **tol)
    for g_got, g_want in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g_got, g_want, **tol)


def _reference(hidden, weight, labels, transform):
    """The family's full logits and their summed cross-entropy, as transformers computes them."""
    logits = (hidden @ weight.t()) * transform.scale
    if transform.softcap is not None:
        logits = transform.softcap * torch.tanh(logits / transform.softcap)
    return logits, F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


@pytest.mark.parametrize("transform", [LogitTransform(scale=0.25), LogitTransform(softcap=2.0),
                                       LogitTransform(scale=3.0, softcap=5.0)])
def test_family_logit_transform_is_applied_in_every_chunk(transform):
    """Scaled and soft-capped logits (Granite, Cohere, Gemma2): value and gradients in float64
    equal the cross-entropy of the transformed full logits; the argmax flags come from them too."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 13, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(40, 8, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 40, (2, 13), generator=g)
    labels[1, :4] = -100
    logits, want = _reference(hidden, weight, labels, transform)
    want_grads = torch.autograd.grad(want, (hidden, weight))
    got, correct = linear_cross_entropy(hidden, weight, labels, chunk_size=5, transform=transform,
                                        return_correct=True)
    got_grads = torch.autograd.grad(got, (hidden, weight))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    for g_got, g_want in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g_got, g_want, atol=1e-12, rtol=1e-12)
    assert torch.equal(correct, (logits.argmax(-1) == labels) | (labels == -100))


def test_upstream_gradient_scales_the_result():
    hidden = torch.randn(8, 4, requires_grad=True)
    weight = torch.randn(10, 4)
    labels = torch.randint(0, 10, (8,))
    (g1,) = torch.autograd.grad(linear_cross_entropy(hidden, weight, labels, chunk_size=3) / 7, hidden)
    (g2,) = torch.autograd.grad(F.cross_entropy(hidden @ weight.t(), labels, reduction="sum") / 7, hidden)
    torch.testing.assert_close(g1, g2)


class _CountMatmuls(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return func(*args, **(kwargs or {}))


class _CountWeightGemms(torch.utils._python_dispatch.TorchDispatchMode):
    """The in-place GEMMs that add into the head's weight gradient, by how many tokens each sums over;
    and the exponentials and log-sum-exps taken (Note [One softmax a chunk])."""

    def __init__(self):
        super().__init__()
        self.tokens, self.exps, self.logsumexps = [], 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func == torch.ops.aten.addmm_.default:
            self.tokens.append(args[1].shape[1])  # grad_logits.T (V, n): n tokens
        self.exps += func.overloadpacket in (torch.ops.aten.exp, torch.ops.aten.exp_)
        self.logsumexps += func.overloadpacket == torch.ops.aten.logsumexp
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(scale=3.0, softcap=5.0)])
@pytest.mark.parametrize("trainable", [False, True], ids=["frozen head", "trainable head"])
def test_the_gradients_are_taken_in_the_forward(transform, trainable):
    """The gradients are taken while each chunk's logits exist (Note [The hidden states' gradient in
    the forward]), so the backward runs no GEMM (it recomputed every chunk's logits: three GEMMs of
    N x d x V instead of two), and under an upstream scale they are the full logits' cross-entropy's,
    in float64: LoRA's frozen head (the hidden states' gradient) and full fine-tuning's trainable one
    (also the head's, one GEMM a chunk in float64). The token losses of preference objectives keep the
    backward's GEMMs."""
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 23, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(40, 8, generator=g, dtype=torch.float64).requires_grad_(trainable)
    labels = torch.randint(0, 40, (2, 23), generator=g)
    labels[1, :4] = -100
    inputs = (hidden, weight) if trainable else (hidden,)
    _, want = _reference(hidden, weight, labels, transform)
    want_grads = torch.autograd.grad(want / 7, inputs)
    with _CountWeightGemms() as weight_gemms:
        got = linear_cross_entropy(hidden, weight, labels, chunk_size=5, transform=transform)
    with _CountMatmuls() as counted:
        got_grads = torch.autograd.grad(got / 7, inputs)
    assert counted.count == 0
    assert weight_gemms.tokens == ([5] * 9 + [1] if trainable else [])  # 46 tokens: 10 chunks, the last of 1
    assert (weight_gemms.exps, weight_gemms.logsumexps) == (10, 0)  # one softmax a chunk, for loss and gradient
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    for g_got, g_want in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g_got, g_want, atol=1e-12, rtol=1e-12)
    out = linear_cross_entropy(hidden, weight, labels, chunk_size=5, transform=transform, return_token_losses=True)
    with _CountMatmuls() as counted:
        torch.autograd.grad(out[0], hidden)
    assert counted.count >= 10, counted.count  # 10 chunks' logits again


def _eager_then_compiled(run) -> list:
    """``run(compiled)`` eager, then with --compile's loss chunks; dynamo captured frames in the second run
    only (Note [A compiled loss chunk])."""
    from torch._dynamo.utils import counters

    results = []
    for compiled in (False, True):
        captured = counters["stats"]["calls_captured"]
        results.append(run(compiled))
        assert (counters["stats"]["calls_captured"] > captured) == compiled
    return results


@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(scale=3.0, softcap=5.0)])
def test_a_compiled_loss_chunk_equals_the_eager_one(transform):
    """--compile's loss chunks (Note [A compiled loss chunk]): the loss, the argmax check and the hidden
    states' and the trainable head's gradients equal eager's in float32 (inductor sums in another
    order), chunks of 5 tokens and a last one of 1; dynamo ran it, and the planner's fake tensors
    take it eager."""
    from torch._dynamo.utils import counters
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 23, 8, generator=g, requires_grad=True)
    weight = torch.randn(40, 8, generator=g, requires_grad=True)
    labels = torch.randint(0, 40, (2, 23), generator=g)
    labels[1, :4] = -100

    def run(compiled):
        total, correct = linear_cross_entropy(hidden, weight, labels, chunk_size=5, transform=transform,
                                              return_correct=True, compiled=compiled)
        return total, correct, *torch.autograd.grad(total / 7, (hidden, weight))

    (want, want_correct, *want_grads), (got, got_correct, *got_grads) = _eager_then_compiled(run)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert torch.equal(got_correct, want_correct) and not got_correct.all()
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-7)
    captured = counters["stats"]["calls_captured"]
    with FakeTensorMode() as mode:
        fake_hidden = mode.from_tensor(hidden)
        fake = linear_cross_entropy(fake_hidden, mode.from_tensor(weight), mode.from_tensor(labels), chunk_size=5,
                                    transform=transform, compiled=True)
        torch.autograd.grad(fake, fake_hidden)
    assert counters["stats"]["calls_captured"] == captured


def test_one_gemm_of_the_head_gradient_sums_several_chunks():
    """In fp32 a GEMM of the trainable head's gradient takes two chunks' logit gradients (their
    fp32 logits' bytes twice: Note [The lm_head gradient's GEMM]); the last group is ragged, and the
    gradients are the full logits' cross-entropy's."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(46, 8, generator=g, requires_grad=True)
    weight = torch.randn(40, 8, generator=g, requires_grad=True)
    labels = torch.randint(0, 40, (46,), generator=g)
    labels[:3] = -100
    want = torch.autograd.grad(F.cross_entropy(hidden @ weight.t(), labels, reduction="sum") / 3, (hidden, weight))
    with _CountWeightGemms() as weight_gemms:
        got = linear_cross_entropy(hidden, weight, labels, chunk_size=5)
    assert weight_gemms.tokens == [10, 10, 10, 10, 6]
    for g_got, g_want in zip(torch.autograd.grad(got / 3, (hidden, weight)), want, strict=True):
        torch.testing.assert_close(g_got, g_want, atol=1e-5, rtol=1e-5)


def test_a_second_backward_through_a_trainable_head_is_refused():
    """The head's weight gradient is handed out, scaled in place, by the first backward; a second one
    through the same graph (retain_graph) would have nothing right to give, so it says so."""
    hidden = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(10, 4, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 10, (6,))
    loss = linear_cross_entropy(hidden, weight, labels, chunk_size=2)
    first = torch.autograd.grad(loss, weight, retain_graph=True)[0]
    want = torch.autograd.grad(F.cross_entropy(hidden @ weight.t(), labels, reduction="sum"), weight)[0]
    torch.testing.assert_close(first, want, atol=1e-12, rtol=1e-12)
    with pytest.raises(RuntimeError, match="second backward through the same loss"):
        torch.autograd.grad(loss, weight)


@pytest.mark.slow
def test_peak_memory_is_bounded_by_the_chunk_not_the_sequence():
    tokens, vocab, dim, chunk = 16384, 32000, 32, 1024
    full_logits_bytes = tokens * vocab * 4  # 2 GiB in fp32
    hidden = torch.randn(tokens, dim, requires_grad=True)
    weight = torch.randn(vocab, dim, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    with track_peak_memory() as peak:
        linear_cross_entropy(hidden, weight, labels, chunk_size=chunk).backward()
    assert peak["Total"] < full_logits_bytes / 4, peak
    # and it is of the order of a few chunks of logits, not more
    assert peak["Total"] < 6 * chunk * vocab * 4, peak


def test_bad_chunk_size():
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(torch.zeros(2, 2), torch.zeros(3, 2), torch.zeros(2, dtype=torch.long), chunk_size=0)


def _bf16_head(vocab=100, dim=64, tokens=40, seed=4):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, dim, generator=g).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(vocab, dim, generator=g) / dim**0.5).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    labels[:5] = -100
    return hidden, weight, labels


def test_bf16_weight_gradient_gemm_takes_bf16_operands():
    """Note [The lm_head gradient's GEMM]: under the planner's fake tensors (the GPU's path) every
    matmul of the loss takes bf16 operands; the weight gradient's are written in fp32, sum the
    tokens of 4 chunks and cover every vocabulary row."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    matmuls = []

    class Matmuls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
                operands = [a for a in args if isinstance(a, torch.Tensor)][-2:]
                matmuls.append(([t.dtype for t in operands], out.dtype, tuple(out.shape), operands[0].shape[1]))
            return out

    with FakeTensorMode():
        hidden, weight, labels = _bf16_head()
        with Matmuls():
            loss = linear_cross_entropy(hidden, weight, labels, chunk_size=8)
            grad_hidden, grad_weight = torch.autograd.grad(loss, (hidden, weight))
    assert grad_weight.dtype == torch.bfloat16 and matmuls
    assert all(dtypes == [torch.bfloat16] * 2 for dtypes, _, _, _ in matmuls), matmuls
    weights = [(shape[0], tokens) for _, dtype, shape, tokens in matmuls if dtype == torch.float32 and shape[1] == 64]
    # 40 tokens: a group of 4 chunks (32 tokens; the planner runs 3 of its chunks, Note [Planning tiles])
    # and one of 8, each group's GEMMs all 100 rows
    assert sum(rows for rows, _ in weights) == 2 * 100 and {tokens for _, tokens in weights} == {32, 8}, matmuls


def test_bf16_weight_gradient_in_vocabulary_slices_is_exact(monkeypatch):
    """The sliced compute-dtype path (CUDA's) with an exact CPU stand-in of torch.mm(out_dtype=fp32):
    the weight gradient equals the fp32 GEMM of the bf16-rounded logit gradient, and stays
    within bf16 rounding of the fp32 path CPU runs."""
    from llama_cp.model import cross_entropy as loss_module

    hidden, weight, labels = _bf16_head()
    cpu_path = torch.autograd.grad(linear_cross_entropy(hidden, weight, labels, chunk_size=8), weight)[0]
    slices, logits = [], []

    def stand_in(a, b, dtype):  # bf16 values are exact in fp32; the sum is fp32, as on the tensor cores
        (slices if b.shape[1] == 64 else logits).append(a.shape[0])  # b: the hidden states, or the head (d, V)
        return a.to(dtype) @ b.to(dtype)

    monkeypatch.setattr(loss_module, "mm_to_accumulation_dtype", lambda weight: True)
    monkeypatch.setattr(loss_module, "mm_out_dtype", stand_in)
    gpu_path = torch.autograd.grad(linear_cross_entropy(hidden, weight, labels, chunk_size=8), weight)[0]
    assert len(slices) > 5 and sum(slices) == 2 * 100  # two groups of chunks, several slices each, every row once
    assert logits == [8] * 5  # and every chunk's logits written in fp32 by the GEMM, once (the forward's)
    h, w = hidden.detach().double(), weight.detach().double()
    probs = torch.softmax(h @ w.t(), dim=-1)
    probs[torch.arange(40), labels.clamp(min=0)] -= 1
    probs[labels == -100] = 0
    want = probs.t() @ h
    torch.testing.assert_close(gpu_path.double(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(gpu_path, cpu_path, atol=2e-2, rtol=2e-2)


@pytest.mark.slow  # plans under fake tensors: seconds each
@pytest.mark.skipif(int(__import__("transformers").__version__.split(".")[0]) < 5,
                    reason="transformers 4 routes experts by torch.where on the router's choice, which fake tensors "
                           "cannot simulate")
def test_the_planner_plans_a_model_with_its_router_loss():
    """The router loss's expert counts (``router_statistics``) have a shape known without reading the
    router's choice, so the planner's fake tensors run an MoE with its load-balancing loss on (with
    bincount they stopped there: DynamicOutputShapeException). Its exactness: tests/modules/test_families.py."""
    from transformers import AutoConfig

    from llama_cp.config import TrainConfig
    from llama_cp.plan.simulate import plan_step_memory

    config = AutoConfig.for_model(
        "mixtral", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=0.3)
    plan = plan_step_memory(TrainConfig.from_flags(context_length=64, cp=2, report_to="none"), 2, model_config=config)
    assert plan.total > 0 and plan.activations > 0


@pytest.mark.parametrize("trainable", [False, True], ids=["frozen head", "trainable head"])
def test_a_compiled_loss_chunk_on_the_gpus_bf16_path_equals_the_eager_one(monkeypatch, trainable):
    """The GPU's path (bf16 operands, the logits written in fp32 by torch.mm's out_dtype: Note [The
    lm_head gradient's GEMM]) through an exact CPU stand-in of that GEMM, compiled (Note [A compiled
    loss chunk]) and eager: the loss and the gradients are equal up to the bf16 rounding of the logit
    gradient (its compute-dtype operand: LoRA's cast, full fine-tuning's stacked rows)."""
    from llama_cp.model import cross_entropy as loss_module

    monkeypatch.setattr(loss_module, "mm_to_accumulation_dtype", lambda weight: True)
    monkeypatch.setattr(loss_module, "mm_out_dtype", lambda a, b, dtype: a.to(dtype) @ b.to(dtype))
    hidden, weight, labels = _bf16_head()
    weight.requires_grad_(trainable)
    inputs = (hidden, weight) if trainable else (hidden,)

    def run(compiled):
        loss = linear_cross_entropy(hidden, weight, labels, chunk_size=8, compiled=compiled)
        return loss, *torch.autograd.grad(loss, inputs)

    results = _eager_then_compiled(run)
    for got, want in zip(results[1], results[0], strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-6, atol=0)  # the loss: fp32 throughout


def test_tokens_the_model_cannot_embed_or_score_are_refused_naming_them():
    """A host batch is checked against the model's rows before it goes to the device (on CUDA an id beyond
    them stops the run with a device-side assert that names nothing): an input id beyond the embedding, a
    label beyond the output layer (Apertus 1.5's is cut to its text tokens: 96 of 160 here), each in one
    line; peft's copy of a trained head (modules_to_save) reads as the head."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from llama_cp.model.loss import check_token_ids, token_rows

    fields = dict(vocab_size=160, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8)
    if "apertus1p5_text" in CONFIG_MAPPING_NAMES:
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("apertus1p5_text", **fields,
                                                                      output_vocab_size=96))
        head_rows = 96
    else:  # transformers without Apertus 1.5: a plain head
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **fields))
        head_rows = 160
    assert token_rows(model) == (160, head_rows)
    lora = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    assert token_rows(lora) == (160, head_rows)
    ids = torch.tensor([[3, 159, 7]])
    check_token_ids({"input_ids": ids, "labels": torch.tensor([[head_rows - 1, -100, 5]])}, 160, head_rows)
    with pytest.raises(ValueError, match=rf"^a label is token {head_rows}, but the model's output layer has "
                                         rf"{head_rows} rows: .*set their labels to -100$"):
        check_token_ids({"input_ids": ids, "labels": torch.tensor([[head_rows, -100, 5]])}, 160, head_rows)
    with pytest.raises(ValueError, match=r"^the batch holds token 160, but the model's embedding has 160 rows: "
                                         r".*resize_token_embeddings"):
        check_token_ids({"chosen_input_ids": torch.tensor([[3, 160]])}, 160, head_rows)
