"""The collective names llama_cp/parallel/collectives.py calls on each torch it admits (Note
[Collective names across torch versions]), without a process group: torch.distributed is replaced by
a namespace holding exactly the names of that torch, each a recorder, so an old name misspelt, or a
2.13-only name called on 2.10, fails here on any installed torch. torch 2.10.0's names are those
tests/test_torch_floor.py recorded (torch_floor_names.json); 2.13 has them and the two new ones.
The all-gather strategy running on the old names over gloo: tests/attention/test_documents.py."""

from __future__ import annotations

import json
import pathlib
import types

import pytest
import torch

from llama_cp.parallel import collectives

FLOOR = json.loads(pathlib.Path(__file__).parents[1].joinpath("torch_floor_names.json").read_text())
TORCH_2_10 = set(FLOOR["modules"]["torch.distributed"])
TORCH_2_13 = TORCH_2_10 | {"all_gather_single", "reduce_scatter_single"}
#: what each function must call: the new name where torch has it (the old one warns there), else the old
CALLS = {
    "2.10": {"all_gather_into": "all_gather_into_tensor", "reduce_scatter_into": "reduce_scatter_tensor"},
    "2.13": {"all_gather_into": "all_gather_single", "reduce_scatter_into": "reduce_scatter_single"},
}


def test_the_floor_has_the_old_names_only():
    assert FLOOR["torch"] == "2.10.0"
    assert {"all_gather_into_tensor", "reduce_scatter_tensor"} <= TORCH_2_10
    assert not {"all_gather_single", "reduce_scatter_single"} & TORCH_2_10


@pytest.mark.parametrize("version", ["2.10", "2.13"])
@pytest.mark.parametrize("function", ["all_gather_into", "reduce_scatter_into"])
def test_each_torch_gets_a_name_it_has(monkeypatch, version, function):
    calls = []
    names = TORCH_2_10 if version == "2.10" else TORCH_2_13
    fake = types.SimpleNamespace(**{name: (lambda *args, _name=name, **kwargs: calls.append((_name, args, kwargs)))
                                    for name in names})
    monkeypatch.setattr(collectives, "dist", fake)
    output, input, group = torch.zeros(4), torch.ones(2), object()
    getattr(collectives, function)(output, input, group=group)
    assert len(calls) == 1, calls
    name, args, kwargs = calls[0]
    assert name == CALLS[version][function]
    assert args[0] is output and args[1] is input and kwargs == {"group": group}  # (output, input), as both names take


def test_the_running_torch_is_one_of_the_two():
    """The installed torch has one of the name sets above, so the cases cover what runs here."""
    import torch.distributed as dist

    version = "2.13" if hasattr(dist, "all_gather_single") else "2.10"
    assert all(hasattr(dist, name) for name in CALLS[version].values()), version
