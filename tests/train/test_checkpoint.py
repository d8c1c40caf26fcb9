"""DCP checkpoints, 2 CPU ranks (gloo): exact resume (full and LoRA), keep-last-K, incomplete ones
ignored; on resume, unmarked and unlisted-file checkpoints skipped, manifest-less ones refused."""

import functools
import os
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.distributed.checkpoint import FileSystemReader

from dist_harness import Checks, shared_tmpdir
from fsdp_checks import build, full_param, global_batch, sharded_step, tiny_model
from llama_cp import ParallelDims
from llama_cp.optim.optimizers import DECAYS, build_optimizer
from llama_cp.train.checkpoint import load_checkpoint, save_checkpoint
from llama_cp.train.checkpoint_files import checkpoint_dir, latest_checkpoint

WORLD_SIZE = 2
SAVE_AT, TRAIN_AFTER = 2, 2
checks = Checks()


def lora(model, seed: int):
    config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]
    )
    model = get_peft_model(model, config)
    torch.manual_seed(seed)  # lora_B starts at zero: give the adapters seed-dependent values
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    return model


def trainer(dims: dict, model):
    """Sharded model, the trainer's AdamW (its param groups: norms and embeddings without weight
    decay) and a warmup-then-decay schedule (the lr changes every step)."""
    model, mesh = build(ParallelDims(**dims), model)
    optimizer = build_optimizer("adamw", model, lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(step + 1, 3) / (step + 1) ** 0.5)
    return model, mesh, optimizer, scheduler


def train(model, mesh, optimizer, scheduler, steps) -> list[float]:
    losses = []
    for step in steps:
        losses.append(sharded_step(model, global_batch(step), mesh).item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return losses


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def draw_random() -> tuple:
    """One draw from every RNG a checkpoint restores."""
    return random.random(), np.random.rand(), torch.rand(3)


def check_exact_resume(dims: dict, use_lora: bool):
    """Train, save, train on; a fresh run that loads the checkpoint trains on identically."""
    make_model = (lambda seed: lora(tiny_model(), seed)) if use_lora else tiny_model
    with shared_tmpdir() as output_dir:
        model, mesh, optimizer, scheduler = trainer(dims, make_model(0))
        train(model, mesh, optimizer, scheduler, range(SAVE_AT))
        seed_everything(100 + dist.get_rank())  # each rank its own RNG streams
        extra = {"data_position": {"epoch": 0, "batches_seen": SAVE_AT}}
        path = save_checkpoint(output_dir, SAVE_AT, model, optimizer, scheduler=scheduler, extra=extra)
        draws = draw_random()
        lr_at_save = scheduler.get_last_lr()
        losses = train(model, mesh, optimizer, scheduler, range(SAVE_AT, SAVE_AT + TRAIN_AFTER))

        assert path == checkpoint_dir(output_dir, SAVE_AT) and latest_checkpoint(output_dir) == path
        keys = set(FileSystemReader(path).read_metadata().state_dict_metadata)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert {k.removeprefix("model.") for k in keys if k.startswith("model.")} == trainable
        assert all(k.startswith(("model.", "optimizer.")) for k in keys), keys
        if use_lora:
            assert trainable and all("lora_" in n or "modules_to_save" in n for n in trainable), trainable
            assert not any(".base_layer." in k or "original_module" in k for k in keys), keys

        # the groups of Note [Which parameters decay]: a full fine-tune's norms and embedding in a second one
        groups = _group_names(model, optimizer)
        assert [decays for decays, _, _ in groups] == ([True] if use_lora else [True, False]), groups
        assert use_lora or {n.rsplit(".", 1)[0].rsplit(".", 1)[-1] for n in groups[1][2]} == {
            "embed_tokens", "input_layernorm", "post_attention_layernorm", "norm"}, groups

        # a fresh run: other trainable weights and other RNG streams until loaded
        saved_optimizer = optimizer
        resumed, mesh, optimizer, scheduler = trainer(dims, make_model(1))
        assert any(
            not torch.equal(full_param(p), full_param(q))
            for p, q in zip(resumed.parameters(), model.parameters(), strict=True) if p.requires_grad
        )
        seed_everything(999)
        for group in optimizer.param_groups:  # the loaded groups' options win
            group["weight_decay"] = 0.5
        state = load_checkpoint(path, resumed, optimizer, scheduler=scheduler)
        assert state == {"step": SAVE_AT, "extra": extra}, state
        assert _group_names(resumed, optimizer) == _group_names(model, saved_optimizer), _group_names(resumed, optimizer)
        for got, want in zip(draw_random(), draws, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert scheduler.get_last_lr() == lr_at_save
        resumed_losses = train(resumed, mesh, optimizer, scheduler, range(SAVE_AT, SAVE_AT + TRAIN_AFTER))

    torch.testing.assert_close(torch.tensor(resumed_losses), torch.tensor(losses), rtol=0, atol=1e-7)
    for (name, param), (_, want) in zip(resumed.named_parameters(), model.named_parameters(), strict=True):
        torch.testing.assert_close(full_param(param), full_param(want), rtol=0, atol=1e-7, msg=lambda m: f"{name}: {m}")


def _group_names(model, optimizer) -> list[tuple[bool, float, list[str]]]:
    """(decays, weight_decay, parameter names) of every param group."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [(g[DECAYS], g["weight_decay"], [names[id(p)] for p in g["params"]]) for g in optimizer.param_groups]


for _name, _dims in (("cp2", dict(dp_shard=1, cp=2)), ("dp_shard2", dict(dp_shard=2, cp=1))):
    checks.add(functools.partial(check_exact_resume, _dims, False), name=f"exact_resume_{_name}")
    checks.add(functools.partial(check_exact_resume, _dims, True), name=f"exact_resume_lora_{_name}")


@checks.add
def keep_last_and_incomplete_checkpoints_are_ignored():
    model, _, optimizer, scheduler = trainer(dict(dp_shard=2), tiny_model())
    save = functools.partial(save_checkpoint, model=model, optimizer=optimizer, scheduler=scheduler, keep_last=2)
    with shared_tmpdir() as output_dir:
        root = os.path.join(output_dir, "checkpoints")
        for step in (1, 2, 3):
            save(output_dir, step)
        assert sorted(os.listdir(root)) == ["step_00000002", "step_00000003"]
        assert latest_checkpoint(output_dir) == checkpoint_dir(output_dir, 3)
        dist.barrier()  # every rank has looked before rank 0 adds the broken ones

        if dist.get_rank() == 0:
            os.makedirs(os.path.join(root, ".tmp-step_00000009"))  # a save in progress (marker even)
            open(os.path.join(root, ".tmp-step_00000009", "COMPLETE"), "w").close()
            os.makedirs(os.path.join(root, "step_00000008"))  # a save interrupted before its marker
        dist.barrier()
        assert latest_checkpoint(output_dir) == checkpoint_dir(output_dir, 3)
        with pytest.raises(ValueError, match="incomplete"):
            load_checkpoint(os.path.join(root, "step_00000008"), model, optimizer)
        with pytest.raises(FileNotFoundError, match="no checkpoint"):
            load_checkpoint(os.path.join(root, "step_00000042"), model, optimizer)
        assert latest_checkpoint(os.path.join(output_dir, "nothing here")) is None

        # a run rewound to step 1 keeps what it just wrote, and the newest other one
        save(output_dir, 1)
        complete = sorted(n for n in os.listdir(root) if n.startswith("step_") and n != "step_00000008")
        assert complete == ["step_00000001", "step_00000003"], complete
        with pytest.raises(ValueError, match="keep_last"):
            save(output_dir, 4, keep_last=0)
        dist.barrier()  # every rank has listed before the directory is removed


@checks.add
def resume_skips_unmarked_and_unlisted_and_refuses_unverified_checkpoints():
    from llama_cp.train.checkpoint_files import UnverifiedCheckpoint, resumable_checkpoint

    model, _, optimizer, scheduler = trainer(dict(dp_shard=2), tiny_model())
    with shared_tmpdir() as output_dir:
        for step in (1, 2, 3):
            save_checkpoint(output_dir, step, model, optimizer, scheduler=scheduler)
        dist.barrier()
        if dist.get_rank() == 0:
            os.remove(os.path.join(checkpoint_dir(output_dir, 3), "COMPLETE"))  # e.g. a deletion under way
            with open(os.path.join(checkpoint_dir(output_dir, 2), "extra.pt"), "wb") as f:  # not in its manifest
                f.write(b"not verified")
            os.remove(os.path.join(checkpoint_dir(output_dir, 1), "MANIFEST.json"))
        dist.barrier()
        with pytest.raises(UnverifiedCheckpoint, match=r"^--resume: checkpoint \S+step_00000001 has no MANIFEST\.json, "
                                                       r"so its files cannot be verified .*--allow_unverified_checkpoint"):
            resumable_checkpoint(output_dir)
        path, skipped = resumable_checkpoint(output_dir, allow_unverified=True)
        assert path == checkpoint_dir(output_dir, 1), path
        assert skipped == [
            (checkpoint_dir(output_dir, 3), "no COMPLETE marker (its save was interrupted, or it is being deleted)"),
            (checkpoint_dir(output_dir, 2), "it holds files its MANIFEST.json does not list (extra.pt)"),
        ], skipped
        dist.barrier()


def _write_texts(root: str, name: str, texts: list[str]) -> str:
    """A jsonl file written by rank 0 and seen by every rank."""
    import json

    path = os.path.join(root, name)
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            f.write("".join(json.dumps({"text": text}) + "\n" for text in texts))
    dist.barrier()
    return path


@checks.add
def prepared_rows_are_made_once_while_the_other_rank_waits():
    from llama_cp.data.loader import build_rows
    from llama_cp.data.prepared import load_prepared_rows
    from llama_cp.data.tokenizer import byte_tokenizer

    tokenizer, rng = byte_tokenizer(), random.Random(0)
    with shared_tmpdir() as root:
        dataset = _write_texts(root, "data.jsonl", ["xyz " * rng.randrange(1, 60) for _ in range(30)])
        cache = os.path.join(root, "cache")
        train, evaluation = load_prepared_rows(dataset, tokenizer, 64, 2, cache_dir=cache, say=lambda _: None)
        for split, rows in (("train", train), ("eval", evaluation)):
            expected = build_rows(dataset, tokenizer, 64, 2, split=split)
            assert len(rows) == len(expected)
            assert all(torch.equal(a[k], b[k]) for a, b in zip(expected, rows) for k in a)
        assert len(os.listdir(cache)) == 1  # local rank 0 prepared, rank 1 waited and read the same files
        empty = _write_texts(root, "empty.jsonl", [""] * 4)
        # the preparer's error is raised on every rank, with the same message
        with pytest.raises(ValueError, match=r"^--dataset '\S+empty\.jsonl' \(train split\): no usable text: "):
            load_prepared_rows(empty, tokenizer, 64, 2, cache_dir=cache, say=lambda _: None)
        dist.barrier()


@checks.add
def streaming_position_of_every_dp_rank_resumes_from_a_checkpoint():
    from llama_cp.data.streaming import StreamingRowLoader
    from llama_cp.data.tokenizer import byte_tokenizer

    model, _, optimizer, scheduler = trainer(dict(dp_shard=2), tiny_model())
    tokenizer, rng, rank = byte_tokenizer(), random.Random(1), dist.get_rank()
    with shared_tmpdir() as root:
        dataset = _write_texts(root, "data.jsonl", ["ab " * rng.randrange(1, 50) for _ in range(40)])
        loader = StreamingRowLoader(dataset, tokenizer, 64, batch_size=1, dp_rank=rank, dp_size=2)
        batches = iter(loader)
        for _ in range(3 + rank):  # the ranks stand at different places of their shares
            next(batches)
        save_checkpoint(root, 3, model, optimizer, scheduler=scheduler, extra={"loader": loader.state_dict()})
        want = [next(batches) for _ in range(5)]
        state = load_checkpoint(checkpoint_dir(root, 3), model, optimizer)
        positions = state["extra"]["loader"]["streaming"]
        assert len(positions) == 2 and positions[0] != positions[1], positions
        resumed = StreamingRowLoader(dataset, tokenizer, 64, batch_size=1, dp_rank=rank, dp_size=2)
        resumed.load_state_dict(state["extra"]["loader"])
        got = iter(resumed)
        for batch in want:
            assert all(torch.equal(batch[k], v) for k, v in next(got).items())
        dist.barrier()


results = checks.module_fixture(__name__, WORLD_SIZE)


@pytest.mark.parametrize("name", checks.names)
def test_check(results, name):
    checks.assert_passed(results, name)
