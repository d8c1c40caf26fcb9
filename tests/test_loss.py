"""Chunked linear cross-entropy: value, gradients and memory, single process."""

import pytest
import torch
import torch.nn.functional as F

from llama_cp.families import LogitTransform
from llama_cp.loss import linear_cross_entropy
from llama_cp.memory import track_peak_memory


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
    logits = (hidden @ weight.t()) * transform.scale
    if transform.softcap is not None:
        logits = transform.softcap * torch.tanh(logits / transform.softcap)
    want = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
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
