"""Writing the trained model out: an HF ``save_pretrained`` directory (full weights) or a peft
adapter (LoRA), gathered from the shards to rank 0 and renamed into place when complete."""

from __future__ import annotations

import os
import shutil
import tempfile

import torch.distributed as dist
from torch import nn

from llama_cp.fsdp_wrap import gather_full_state_dict
from llama_cp.train.checkpoint import WriteFailed, describe_write_failure


def align_special_tokens(model: nn.Module, tokenizer) -> list[str]:
    """Set the bos / eos / pad ids of the model's config and generation config to the tokenizer's,
    so that ``generate()`` on the export stops at the eos it was trained to write; an id list
    that holds the tokenizer's (Llama 3 instruct's eos list) is kept. Returns the ids replaced
    (not those filled in where the config had none)."""
    from llama_cp.modules.causal_lm import base_causal_lm

    base, changed = base_causal_lm(model), []
    for config in filter(None, (base.config, getattr(base, "generation_config", None))):
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            wanted, held = getattr(tokenizer, name, None), getattr(config, name, None)
            if wanted is None or held == wanted or (isinstance(held, (list, tuple)) and wanted in held):
                continue
            setattr(config, name, wanted)
            if held is not None:  # a missing id filled in is not worth a line
                changed.append(f"{type(config).__name__}.{name} {held} -> {wanted}")
    return changed


def export_pretrained(model: nn.Module, output_dir: str) -> None:
    """Write an HF ``save_pretrained`` directory of the sharded ``model`` from rank 0,
    into a temporary directory renamed into place, so a half-written export never
    looks complete."""
    if os.path.exists(output_dir):  # every rank sees it: all raise before the collective
        raise FileExistsError(f"{output_dir!r} exists; choose another output directory")
    state = gather_full_state_dict(model)
    parent = os.path.dirname(os.path.abspath(output_dir))
    failure = [None]
    if dist.get_rank() == 0:
        tmp = None
        try:
            os.makedirs(parent, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=".tmp-export-", dir=parent)
            # a peft model saves its adapter (and modules_to_save) only; a plain model everything
            model.save_pretrained(tmp, state_dict=state)
            os.rename(tmp, output_dir)
        except Exception as error:  # noqa: BLE001 - e.g. a full disk: the other ranks must hear of it
            where = tmp or parent
            failure = [describe_write_failure(error, f"exporting {output_dir}", where, parent)]
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
    dist.broadcast_object_list(failure, src=0)  # also the barrier: the export is in place
    if failure[0] is not None:
        raise WriteFailed(failure[0])
