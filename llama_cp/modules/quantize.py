"""QLoRA: the frozen base Linear layers in bitsandbytes' 4-bit NormalFloat (NF4), sharded by FSDP2.

See Note [4-bit weights under FSDP2]. ``quantize_model`` swaps every ``nn.Linear`` of the
decoder layers for an :class:`NF4Linear` (before peft adds adapters to them); the trainer does
it in ``parallelize_model`` when ``--quantization 4bit``, for a real model (its weights are
quantized) and for one on the meta device (shapes only: the checkpoint is quantized as it is
loaded, :func:`quantize_checkpoint`, and the memory planner runs on the shapes).

Note [4-bit weights under FSDP2]
================================

bitsandbytes keeps a 4-bit weight as a ``Params4bit``: the packed codes (two 4-bit codes per
byte) plus a ``QuantState`` object (absmax of every block of 64 weights, the shape, the code
book). FSDP2 shards and all-gathers a parameter's plain storage; the gathered parameter is a
plain tensor, so the subclass and its ``quant_state`` are gone. Its forward also cannot find
an absmax that matches the gathered codes unless it is kept somewhere else.

:class:`NF4Linear` therefore holds everything as ordinary parameters, which FSDP2 shards and
gathers like any other, and nothing in Python attributes:

    weight  uint8 [(out * in) / 2, 1]   the packed NF4 codes, exactly bitsandbytes' layout
    absmax  int32 [(out * in) / 64]     the fp32 block maxima, their bits stored as int32

Both are frozen. Integer storage matters: ``MixedPrecisionPolicy(param_dtype=bf16)`` casts
only floating-point parameters (FSDP2 skips the rest), so neither the codes nor the fp32
absmax are ever rounded to bf16, whatever ``--dtype`` is, and integers have no NaN bit
patterns for a float copy to canonicalise (packed codes *viewed* as bf16, the
``quant_storage=bfloat16`` of FSDP1-QLoRA, do: bitsandbytes issue #1945). A decoder layer's
group mixes integer and float parameters, which FSDP2 all-gathers as one byte buffer.

In forward and backward the gathered codes are dequantized with bitsandbytes' own op
(``torch.ops.bitsandbytes.dequantize_4bit``) to the input's dtype and multiplied, which is what
bitsandbytes' ``Linear4bit`` computes when it trains (``matmul_4bit``: dequantize, then
``linear``; backward: dequantize again, then ``grad @ W``); only the codes are saved for
backward, never the dequantized weight. So gradients equal those of the single-process
bitsandbytes + peft model (``tests/modules/test_qlora.py``). bitsandbytes registers fake kernels for
that op, so the memory planner runs this same code under fake tensors and sees the dequantized
weight it allocates per Linear, in forward and again in backward (and in recompute).

Memory per rank: (out * in) * (1/2 + 4/64) bytes per Linear, divided by the FSDP shard count:
0.5625 bytes per weight instead of 4 (fp32) or 2 (bf16).

Note [QLoRA's version floor]
============================

The layout above needs two things that older releases setup.cfg admits do not have, so
``--quantization 4bit`` is refused at config validation (:func:`check_qlora_support`, one line
naming the installed and the needed versions) below torch 2.12 or bitsandbytes 0.46:

- FSDP2 must leave integer parameters alone (torch 2.10 and 2.11 are admitted and do not). Read in
  ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py`` of the released wheels:
  torch 2.8.0 and 2.11.0 wrap the sharded parameter as ``nn.Parameter(dtensor)`` (default
  ``requires_grad=True``) and only then call ``requires_grad_(param.requires_grad)``; for the
  uint8 codes that raises "only Tensors of floating point dtype can require gradients" inside
  ``fully_shard``, on CPU too (seen on torch 2.9.0 with bitsandbytes 0.46.0: ``fully_shard``
  of one :class:`NF4Linear`). Their ``init_dtype_attrs`` also sets
  ``param_dtype`` for every parameter, so on CUDA with bf16 the codes and absmax bits would be
  cast to bf16 and all-gathered as such. torch 2.12.0 (pytorch PR #177948) passes
  ``requires_grad=param.requires_grad`` to ``nn.Parameter`` and clamps ``param_dtype`` to None
  when ``not self.orig_dtype.is_floating_point``; 2.13.0 reads the same.
- ``torch.ops.bitsandbytes.dequantize_4bit`` (with its fake kernel, which the planner needs) is
  registered from bitsandbytes 0.46.0; 0.45.x has no such op.

``tests/test_config.py`` checks the refusal for given version strings and runs it where the
installed versions lack support; ``tests/modules/test_qlora.py`` skips there with the same reason.
"""

from __future__ import annotations

import logging
import re

import torch
import torch.nn.functional as F
from torch import nn

#: Weights per absmax block (bitsandbytes' default, as in transformers' BitsAndBytesConfig).
BLOCKSIZE = 64
QUANT_TYPE = "nf4"


def _packed_shape(out_features: int, in_features: int) -> tuple[int, int]:
    return ((out_features * in_features + 1) // 2, 1)


def _absmax_shape(out_features: int, in_features: int) -> tuple[int]:
    return (-(out_features * in_features // -BLOCKSIZE),)


def dequantize_nf4(
    packed: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """The [out, in] weight in ``dtype`` from packed NF4 codes and their fp32 block maxima
    (bitsandbytes' op; under fake tensors its fake kernel allocates the same output)."""
    return torch.ops.bitsandbytes.dequantize_4bit.default(packed, absmax, BLOCKSIZE, QUANT_TYPE, list(shape), dtype)


class _NF4Linear(torch.autograd.Function):
    """``x @ W.T + bias`` for a frozen NF4 ``W``: dequantize in forward and again in backward,
    saving only the packed codes, as bitsandbytes' ``MatMul4Bit`` does."""

    @staticmethod
    def forward(ctx, x, packed, absmax_bits, bias, shape):
        ctx.shape = shape
        ctx.save_for_backward(packed, absmax_bits)
        return F.linear(x, dequantize_nf4(packed, absmax_bits.view(torch.float32), shape, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad_out):
        packed, absmax_bits = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            weight = dequantize_nf4(packed, absmax_bits.view(torch.float32), ctx.shape, grad_out.dtype)
            grad_x = grad_out @ weight  # (..., out) @ (out, in)
        if ctx.needs_input_grad[3]:
            grad_bias = grad_out.flatten(0, -2).sum(0)
        return grad_x, None, None, grad_bias, None


class NF4Linear(nn.Linear):
    """A frozen ``nn.Linear`` whose weight is NF4, laid out so that FSDP2 can shard it (Note [4-bit
    weights under FSDP2]). A subclass of ``nn.Linear`` so that peft puts LoRA adapters on it."""

    #: peft casts new adapters to a base layer's ``compute_dtype`` when it has one, else to its
    #: weight's dtype (uint8 here, which it skips): None keeps the adapters in float32. The
    #: weight itself is always dequantized to the input's dtype.
    compute_dtype = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, device=None) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: no full-precision weight is ever allocated
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(
            torch.empty(_packed_shape(out_features, in_features), dtype=torch.uint8, device=device), requires_grad=False
        )
        self.absmax = nn.Parameter(
            torch.empty(_absmax_shape(out_features, in_features), dtype=torch.int32, device=device), requires_grad=False
        )
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "NF4Linear":
        """The NF4 version of ``linear``: its weight quantized (bitsandbytes ``quantize_4bit``), or
        only the shapes when it is on the meta device."""
        device = linear.weight.device
        module = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device=device)
        if device.type != "meta":
            packed, absmax = quantize_nf4(linear.weight.detach())
            with torch.no_grad():
                module.weight.copy_(packed)
                module.absmax.copy_(absmax)
                if linear.bias is not None:
                    module.bias.copy_(linear.bias)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return _NF4Linear.apply(x, self.weight, self.absmax, bias, (self.out_features, self.in_features))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, nf4"


def quantize_nf4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed uint8 codes [n/2, 1], absmax bits int32 [n/64])`` of a float [out, in] weight:
    bitsandbytes' ``quantize_4bit`` (NF4, blocks of 64, no double quantization), the same
    numbers a ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")`` load gives."""
    import bitsandbytes.functional as bnbF

    packed, state = bnbF.quantize_4bit(
        weight.contiguous(), blocksize=BLOCKSIZE, compress_statistics=False, quant_type=QUANT_TYPE,
        quant_storage=torch.uint8,
    )
    return packed, state.absmax.float().view(torch.int32)


def quantized_linears(model: nn.Module) -> dict[str, NF4Linear]:
    """Qualified name -> module of every :class:`NF4Linear` in ``model``."""
    return {name: m for name, m in model.named_modules() if isinstance(m, NF4Linear)}


def quantize_model(model: nn.Module) -> nn.Module:
    """Replace every ``nn.Linear`` inside the decoder layers of ``model`` (an HF causal LM, real or
    on the meta device, not yet wrapped by peft or FSDP) by an :class:`NF4Linear`; the
    embeddings, norms and ``lm_head`` stay in full precision (as transformers' 4-bit loading
    keeps ``lm_head``), and Gemma 3n's AltUp layers, whose weights transformers reads directly: it clamps
    them in place and multiplies by a clamped copy (models/gemma3n, Gemma3nTextAltUp: a 4-bit weight is codes,
    not numbers; they are altup_num_inputs wide, a few thousand numbers a layer). Returns ``model``."""
    from llama_cp.modules.causal_lm import decoder_layers

    if any(isinstance(p, NF4Linear) for p in model.modules()):
        raise ValueError("the model is quantized already")
    if hasattr(model, "peft_config"):
        raise ValueError("quantize the base model before adding LoRA adapters (peft), not after")
    check_qlora_support()
    for layer in decoder_layers(model):
        for name, child in list(layer.named_modules()):
            if type(child) is nn.Linear and not name.startswith("altup."):
                parent_name, _, attr = name.rpartition(".")
                parent = layer.get_submodule(parent_name) if parent_name else layer
                setattr(parent, attr, NF4Linear.from_linear(child))
    return model


def quantize_checkpoint(
    model: nn.Module, checkpoint: dict[str, torch.Tensor], checkpoint_key, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """``checkpoint`` (HF names -> full-precision tensors) with the weight of every
    :class:`NF4Linear` of ``model`` replaced by its packed codes and its ``absmax`` added, so
    that a full state dict for ``model`` can be read from it. ``checkpoint_key`` maps a model
    parameter name to its checkpoint name; each weight is quantized on ``device`` (a GPU is
    much faster than bitsandbytes' CPU path) and the results are returned on the CPU."""
    checkpoint = dict(checkpoint)
    for name, layer in quantized_linears(model).items():
        key = checkpoint_key(f"{name}.weight")
        if key not in checkpoint:
            raise KeyError(f"the checkpoint has no tensor {key!r} (needed for {name})")
        weight = checkpoint[key]
        if not weight.dtype.is_floating_point or tuple(weight.shape) != (layer.out_features, layer.in_features):
            raise ValueError(
                f"checkpoint tensor {key!r} is {weight.dtype} {tuple(weight.shape)}, not the full-precision "
                f"[{layer.out_features}, {layer.in_features}] weight that --quantization 4bit quantizes (a "
                "pre-quantized bitsandbytes checkpoint?): point --model_name at the full-precision checkpoint"
            )
        packed, absmax = quantize_nf4(weight.to(device, torch.float32))
        checkpoint[key] = packed.cpu()
        checkpoint[key.removesuffix(".weight") + ".absmax"] = absmax.cpu()
    return checkpoint


#: The first releases that run QLoRA: Note [QLoRA's version floor].
QLORA_NEEDS = {"torch": (2, 12), "bitsandbytes": (0, 46)}


def qlora_refusal(torch_version: str, bitsandbytes_version: str | None) -> str | None:
    """None when these versions (``bitsandbytes_version`` None: not installed) run
    ``--quantization 4bit``, else the one-line reason (Note [QLoRA's version floor])."""

    def release(version: str) -> tuple[int, ...]:  # "2.12.0a0+git1234" -> (2, 12, 0)
        return tuple(int(part) for part in re.match(r"\d+(?:\.\d+)*", version).group().split("."))

    installed = {"torch": torch_version, "bitsandbytes": bitsandbytes_version}
    if all(v is not None and release(v) >= QLORA_NEEDS[name] for name, v in installed.items()):
        return None
    needed = " and ".join(f"{name} >= {'.'.join(map(str, v))}" for name, v in QLORA_NEEDS.items())
    shown = ", ".join(f"{name} {v or 'not installed'}" for name, v in installed.items())
    return f"--quantization 4bit needs {needed} (installed: {shown}); upgrade them or train LoRA without --quantization"


def installed_qlora_refusal() -> str | None:
    """:func:`qlora_refusal` for the installed torch and bitsandbytes."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        bitsandbytes_version = version("bitsandbytes")
    except PackageNotFoundError:
        bitsandbytes_version = None
    return qlora_refusal(torch.__version__, bitsandbytes_version)


def check_qlora_support() -> None:
    """Refuse ``--quantization 4bit`` when the installed torch or bitsandbytes cannot run it
    (config validation calls it, before anything is built)."""
    refusal = installed_qlora_refusal()
    if refusal is not None:
        raise ValueError(refusal)
    import bitsandbytes  # noqa: F401  (registers the torch.ops.bitsandbytes kernels)


# Note [bitsandbytes' CPU kernel warning]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# peft imports bitsandbytes whenever it is installed (peft/import_utils.py, is_bnb_4bit_available),
# also for a run that quantizes nothing, and bitsandbytes 0.50's CPU backend then logs a warning at
# import on a CPU with AVX512-BF16: "Failed to load CPU gemm_4bit_forward from kernels-community"
# (bitsandbytes/backends/cpu/ops.py, 0.50.2: it tries the `kernels` package for its gemv_4bit op).
# llama-cp never calls that op: NF4Linear dequantizes with dequantize_4bit and multiplies with
# torch (Note [4-bit weights under FSDP2]), so the warning means nothing here, with or without
# --quantization 4bit. Its logger is raised to ERROR before peft can import bitsandbytes.


def quiet_bitsandbytes() -> None:
    """Silence bitsandbytes' CPU gemv kernel warning (Note [bitsandbytes' CPU kernel warning])."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
