"""Sliding windows with packed documents, on 4 CPU ranks (gloo): every strategy.

A Qwen2 whose first layer is full and whose second has a 10-token window (the
``max_window_layers`` split; a zigzag chunk is 12 tokens at cp 4 and 24 at cp 2),
on rows of 1, 2, 7 and 50 documents and on one-document rows, gives the logits, loss
and every gradient of single-process transformers: ring, Ulysses, all-gather and
hybrid, cp 1, 2 and 4, plain, FSDP and LoRA, tiled, float32 and float64. The ring
sends a block only to the ranks whose queries reach it through the window, and the
bytes equal the count from the dense masks (Note [Sliding windows under CP]).
"""

import collections
import functools

import pytest
import torch

from dist_harness import Checks
from document_checks import (
    HEADS, SEQ_LEN, check_documents, mesh_for, one_document_batch, one_step_wire_bytes, seen_blocks, shard_bytes,
    windowed_model,
)

WORLD_SIZE = 4
WINDOW = 10
checks = Checks(setup=lambda sizes: [mesh_for(cp, WORLD_SIZE) for cp in sorted(sizes)])  # the cp groups' meshes


def _name(*parts) -> str:
    return "_".join(str(p) for p in parts)


for _strategy, _cps in (("ring", (1, 2, 4)), ("ulysses", (2, 4)), ("allgather", (2, 4)), ("hybrid", (4,))):
    for _cp in _cps:
        for _mode in ("plain", "fsdp", "lora"):
            for _dtype in (torch.float32, torch.float64):
                if _mode != "plain" and (_dtype == torch.float64 or _cp != 4):
                    continue  # FSDP and LoRA once per strategy
                checks.add(
                    functools.partial(
                        lambda s, c, m, d: check_documents(
                            s, mesh_for(c, WORLD_SIZE), m != "plain", d, m == "lora", window=WINDOW,
                            ulysses_degree=2 if s == "hybrid" else 0,
                        ),
                        _strategy, _cp, _mode, _dtype,
                    ),
                    name=_name(_strategy, f"cp{_cp}", _mode, str(_dtype)[6:]),
                    group=_cp if _mode == "plain" else None,  # Note [Checks side by side] in dist_harness.py
                )

for _strategy in ("ring", "ulysses", "allgather", "hybrid"):
    checks.add(
        functools.partial(
            lambda s: check_documents(s, mesh_for(4, WORLD_SIZE), False, torch.float64, data=one_document_batch(),
                                      block_size=5, window=WINDOW, ulysses_degree=2 if s == "hybrid" else 0),
            _strategy,
        ),
        name=_name(_strategy, "cp4_one_document_rows_tiled_float64"),
    )


@checks.add(group=1)
def ring_cp1_tiled_packed_float64():
    check_documents("ring", mesh_for(1, WORLD_SIZE), False, torch.float64, block_size=4, window=WINDOW)


@checks.add
def window_of_one_token_cp4_float64():
    """Each token sees itself only: every other block is skipped."""
    check_documents("ring", mesh_for(4, WORLD_SIZE), False, torch.float64, window=1)


@checks.add
def ring_sends_only_what_the_window_reaches_cp4():
    """One-document rows at cp 4: the full layer sends every block around the ring, the windowed
    one only the blocks some query of the receiver reaches (from the dense masks), each rank's
    dK/dV share straight back to the owner; exact as well."""
    cp, dtype = 4, torch.float64
    mesh = mesh_for(cp, WORLD_SIZE)
    data = {key: value[:2] for key, value in one_document_batch().items()}
    check_documents("ring", mesh, False, dtype, data=data, window=WINDOW)
    sent, config, rank = one_step_wire_bytes("ring", mesh, dtype, data, model=windowed_model(WINDOW))
    seen = seen_blocks(cp, [[SEQ_LEN]] * 2, window=WINDOW)
    assert not bool(seen.all()) and bool(seen.diagonal().all())
    kv = 2 * shard_bytes(config, dtype, config.num_key_value_heads, cp)
    sends, receives = int(seen[:, rank].sum()) - 1, int(seen[rank].sum()) - 1
    full_layer = collections.Counter({"ring K/V": 2 * (cp - 1) * kv, "ring dK/dV": cp * kv})
    window_layer = collections.Counter({"ring K/V": 2 * sends * kv, "ring dK/dV": receives * kv})
    assert sent == full_layer + window_layer, (sent, seen)
    assert config.num_hidden_layers == 2 and HEADS["num_key_value_heads"] == config.num_key_value_heads


results = checks.module_fixture(__name__, WORLD_SIZE)


@pytest.mark.parametrize("name", checks.names)
def test_check(results, name):
    checks.assert_passed(results, name)
