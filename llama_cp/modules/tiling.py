"""Per-token modules computed in tiles of tokens, so their intermediates never exist for the
whole sequence at once.

Note [Tiled per-token modules]
==============================

A decoder layer's MLP treats every token on its own. Untiled, its backward holds the
gate, up and activation outputs of the whole local sequence (3 x 14336 values per token
for Llama-3-8B, ~236 KiB per token with their gradients in bf16): at long context that,
not the checkpoints, is the peak. Tiled:

    forward (no grad)                   backward, tile by tile
    x (N, d) -> [x_0 | x_1 | ... ]      x_t -> recompute mlp(x_t) with grad
    out[t] = mlp(x_t)                   -> autograd.grad: dx_t, dW (summed over tiles)
    saved: x only                       one tile's intermediates alive at a time

The tiles run through the module itself (its ``forward``, peft's LoRA layers included),
and FSDP2 has gathered the layer's parameters around both (they belong to the decoder
layer's FSDP unit). Parameters that need a gradient are inputs of the autograd Function,
so their gradients reach FSDP's reduce-scatter like any other; per-tile parameter
gradients are summed in fp32 when the parameters are lower precision. The result is the
untiled gradient up to summation order (fp32 1e-5, fp64 1e-10 in the tests).

Note [Planning tiles]
====================

The memory planner runs the trainer's code under fake tensors (Note [Planning from a few
layers] in memory.py), where a tile costs the dispatch of its ops and computes nothing. At
524,288 tokens that is 528 attention tiles of 16384 tokens per layer in forward and as many in
backward (about 1,000 per ring step for 4M tokens at cp 8), 128 MLP tiles of 4096 tokens and
1,024 loss chunks of 512: an hour for one plan. Under fake tensors the loops run fewer tiles
(``planning``):

- tiled MLP/norms and the loss (``tile_starts``): the first tile, the second and the last;
- attention (``documents.planned_tiles``): of each query slice the first tile of each shape
  (keys, causal), and of the query slices the first of each kind (its length and the shapes
  of its tiles).

The tracked peak is unchanged. A tile's own tensors (kernel outputs and workspace, a tile's
activations, a chunk's logits, merge temporaries) are freed before the next tile; what the
tiles write or add into (out/lse/dQ of a query slice, the whole output, dK/dV, the summed
weight gradients, the loss) is allocated once, whatever the number of tiles, by the first
tile or before the loop; and tiles of one shape allocate the same bytes. So the peak over a
loop is that of its first tile (which allocates the sums), of a later one (which adds into
them), or of the ragged last one. tests/attention/test_workspace.py checks plans with every tile
(``PLAN_EVERY_TILE``) and with the shortcut equal, phase by phase and category by category.
Real tensors always run every tile.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

#: Whether a plan under fake tensors runs every tile (the tests compare) or a few (Note [Planning tiles]).
PLAN_EVERY_TILE = False


def planning(x: torch.Tensor) -> bool:
    """Whether ``x`` is a fake tensor of the memory planner, whose tile loops may run a few
    tiles of each shape (Note [Planning tiles])."""
    return not PLAN_EVERY_TILE and isinstance(x, FakeTensor)


def tile_starts(length: int, size: int, x: torch.Tensor):
    """The starts of the ``size``-long tiles of ``length`` rows: all of them, or under the
    planner's fake ``x`` the first, second and last (Note [Planning tiles])."""
    starts = range(0, length, size)
    return starts if len(starts) <= 3 or not planning(x) else [starts[0], starts[1], starts[-1]]


class _TiledTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, params_fn, tile_size, x, *params):
        # x: (..., d); fn maps (n, d) -> (n, d_out) token by token
        rows = x.detach().reshape(-1, x.shape[-1])  # (N, d); the graph comes from the backward
        out = out_rows = None  # allocated in the output's shape (a view would confuse FSDP's output hooks)
        with torch.no_grad():
            for start in tile_starts(rows.shape[0], tile_size, rows):
                tile = fn(rows[start:start + tile_size])
                if out is None:
                    out = tile.new_empty((*x.shape[:-1], tile.shape[-1]))
                    out_rows = out.view(-1, tile.shape[-1])
                out_rows[start:start + tile.shape[0]] = tile
        ctx.save_for_backward(x)
        ctx.fn, ctx.params_fn, ctx.tile_size, ctx.params = fn, params_fn, tile_size, params
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        params = ctx.params_fn()
        if len(params) != len(ctx.params) or any(a is not b for a, b in zip(params, ctx.params)):
            raise RuntimeError(
                "tiled module: its trainable parameters changed between forward and backward "
                "(were they re-registered?); the recompute would not differentiate the right tensors"
            )
        needs_x = ctx.needs_input_grad[3]
        rows = x.reshape(-1, x.shape[-1])
        grad_rows = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = torch.empty_like(x) if needs_x else None
        grad_x_rows = grad_x.view(-1, x.shape[-1]) if needs_x else None
        wanted = [p for p, needed in zip(params, ctx.needs_input_grad[4:]) if needed]
        sums: list[torch.Tensor | None] = [None] * len(wanted)
        for start in tile_starts(rows.shape[0], ctx.tile_size, rows):
            tile = rows[start:start + ctx.tile_size].detach().requires_grad_(needs_x)
            with torch.enable_grad():
                out = ctx.fn(tile)
            inputs = ([tile] if needs_x else []) + wanted
            grads = torch.autograd.grad(out, inputs, grad_rows[start:start + ctx.tile_size], allow_unused=True)
            if needs_x:
                grad_x_rows[start:start + tile.shape[0]] = grads[0]
                grads = grads[1:]
            for i, grad in enumerate(grads):
                if grad is None:
                    continue
                if sums[i] is None:  # accumulate in fp32 below fp32 (Note [Tiled per-token modules])
                    sums[i] = grad.float() if grad.dtype in (torch.bfloat16, torch.float16) else grad
                else:
                    sums[i] += grad
        by_param = dict(zip(map(id, wanted), sums))
        param_grads = []
        for p, needed in zip(params, ctx.needs_input_grad[4:]):
            grad = by_param.get(id(p)) if needed else None
            param_grads.append(None if grad is None else grad.to(p.dtype))
        return (None, None, None, grad_x, *param_grads)


def tiled_tokens(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile_size: int,
                 params_fn: Callable[[], list[torch.Tensor]]) -> torch.Tensor:
    """``fn(x)`` for a per-token ``fn`` (no token sees another), computed ``tile_size`` tokens
    at a time with the backward recomputing each tile (Note [Tiled per-token modules]).
    ``params_fn()`` returns the trainable tensors ``fn`` uses, the same ones in forward and
    backward."""
    if tile_size < 1:
        raise ValueError(f"tile_size must be >= 1, got {tile_size}")
    params = [p for p in params_fn() if p.requires_grad] if torch.is_grad_enabled() else []
    return _TiledTokens.apply(fn, lambda: [p for p in params_fn() if p.requires_grad], tile_size, x, *params)


def tile_module(module: nn.Module, tile_size: int, *, flag: str = "tile_size") -> None:
    """Make the per-token ``module`` compute in tiles of ``tile_size`` tokens. Refuses a module
    with active dropout: a tile's recompute would draw another mask."""
    for sub in module.modules():
        if isinstance(sub, nn.Dropout) and sub.p > 0:
            raise ValueError(
                f"--{flag} recomputes {type(module).__name__} tile by tile in backward, and its dropout "
                f"(p={sub.p}, e.g. --lora_dropout on MLP projections) would draw another mask there: "
                f"set --lora_dropout 0, leave the MLP out of --lora_target_modules, or drop --{flag}"
            )
    original = module.forward

    def forward(self, hidden_states):
        return tiled_tokens(original, hidden_states, tile_size, lambda: list(self.parameters()))

    module.forward = types.MethodType(forward, module)


def _is_norm(module: nn.Module | None) -> bool:
    return type(module).__name__.removeprefix("FSDP").endswith(("RMSNorm", "LayerNorm"))


def copied_norms(model: nn.Module) -> list[nn.Module]:
    """peft's wrappers of the norms ``--lora_modules_to_save`` copies (their ``original_module`` a
    norm), which :func:`norm_modules` does not find."""
    return [m for m in model.modules() if _is_norm(getattr(m, "original_module", None))]


def norm_modules(model: nn.Module, layers: list[nn.Module]) -> list[nn.Module]:
    """The hidden-size norms of the decoder: every RMSNorm / LayerNorm child of a decoder layer
    (input, post-attention, and the extra ones of Gemma2 / OLMo2) and the final norm. Norms
    inside attention (Qwen3's q/k norms, per head) are left alone."""
    norms = [child for layer in layers for child in layer.children() if _is_norm(child)]
    from llama_cp.modules.causal_lm import base_causal_lm

    final = getattr(base_causal_lm(model).get_decoder(), "norm", None)
    if final is not None and _is_norm(final):
        norms.append(final)
    return norms


def apply_tiled_norms(model: nn.Module, layers: list[nn.Module], tile_size: int) -> None:
    """Tile the decoder's norms (``--norm_tile_size``; :func:`norm_modules`): their fp32
    intermediates of the whole sequence (about 8 x hidden bytes per token in backward) are
    then one tile's."""
    norms = norm_modules(model, layers)
    if not norms:
        raise ValueError("--norm_tile_size: found no RMSNorm / LayerNorm in the decoder layers to tile")
    for norm in norms:
        tile_module(norm, tile_size, flag="norm_tile_size")


def apply_tiled_mlp(layers: list[nn.Module], tile_size: int) -> None:
    """Tile the ``mlp`` of every decoder layer in ``layers`` (``--mlp_tile_size``)."""
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is None:
            raise ValueError(f"--mlp_tile_size: {type(layer).__name__} has no .mlp to tile")
        tile_module(mlp, tile_size, flag="mlp_tile_size")
