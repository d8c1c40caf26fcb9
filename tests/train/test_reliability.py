"""Faults a cluster inflicts on a run, injected on 2 CPU ranks (gloo), and what must survive them.

Damaged checkpoints (a truncated or bit-flipped shard, a deleted file) are skipped on
--resume for the newest one that verifies, and the resumed trajectory equals the
uninterrupted one; --resume true/auto with nothing to resume; an output_dir holding
an earlier run's artefacts is refused unless --resume or --overwrite; a --resume takes
the new schedule or refuses a setting in one line; a checkpoint without a manifest needs
--allow_unverified_checkpoint; one run per output_dir.
"""

import json
import math
import os
import shutil

import pytest
import torch
import torch.distributed as dist

from dist_harness import Checks, shared_tmpdir

WORLD_SIZE = 2
checks = Checks()


def _config(output_dir, **flags):
    from llama_cp import TrainConfig

    base = dict(context_length=128, num_passkey_samples=32, num_eval_samples=2, max_steps=6, log_every=1,
                warmup_steps=1, lr=3e-3, save_every=2, keep_last=3, output_dir=output_dir)
    return TrainConfig.from_flags(**{**base, **flags})


def _metrics(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _fit(cfg):
    """Run a Trainer; returns (its messages, the metrics rows)."""
    from llama_cp import Trainer

    trainer = Trainer(cfg)
    said = []
    trainer._say = said.append
    trainer.fit()
    return said, _metrics(cfg.output_dir)


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)


def _flip(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        chunk = f.read(256)
        f.seek(os.path.getsize(path) // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))


DAMAGE = {
    "truncated_shard": (lambda d: _truncate(os.path.join(d, "__1_0.distcp")), "__1_0.distcp has .* bytes"),
    "bit_flipped_shard": (lambda d: _flip(os.path.join(d, "__0_0.distcp")), "__0_0.distcp does not match its sha256"),
    "deleted_metadata": (lambda d: os.remove(os.path.join(d, ".metadata")), r"\.metadata is missing"),
    "deleted_trainer_state": (lambda d: os.remove(os.path.join(d, "trainer_state.pt")), "trainer_state.pt is missing"),
}


@checks.add
def damaged_checkpoints_are_skipped_and_the_trajectory_continues():
    from llama_cp.train.checkpoint_files import checkpoint_dir, resumable_checkpoint

    with shared_tmpdir() as root:
        straight = os.path.join(root, "straight")
        _, want = _fit(_config(straight, max_steps=4))  # checkpoints of steps 2 and 4
        for name, (damage, reason) in DAMAGE.items():
            run = os.path.join(root, name)
            if dist.get_rank() == 0:
                shutil.copytree(straight, run)
                damage(checkpoint_dir(run, 4))  # the newest checkpoint is damaged: resume from step 2
            dist.barrier()
            path, skipped = resumable_checkpoint(run)
            assert path == checkpoint_dir(run, 2) and len(skipped) == 1, (name, path, skipped)
            assert skipped[0][0] == checkpoint_dir(run, 4), skipped
            assert __import__("re").search(reason, skipped[0][1]), (name, skipped)
            said, got = _fit(_config(run, max_steps=4, resume=True))
            assert said[0].startswith(f"skipped checkpoint {checkpoint_dir(run, 4)}: "), said
            assert said[1] == f"resumed from step 2 ({checkpoint_dir(run, 2)})", said
            assert [r["step"] for r in got] == [1, 2, 3, 4], (name, got)
            for g, w in zip(got, want, strict=True):
                for key in ("loss", "grad_norm"):
                    assert abs(g[key] - w[key]) <= 1e-6 * max(1.0, abs(w[key])), (name, g, w)


@checks.add
def resume_true_needs_a_checkpoint_and_auto_starts_fresh():
    from llama_cp import Trainer

    with shared_tmpdir() as root:
        with pytest.raises(FileNotFoundError, match=r"--resume: no intact checkpoint under .*checkpoints; "
                                                    r"use --resume auto"):
            Trainer(_config(os.path.join(root, "empty"), resume=True, max_steps=2)).fit()
        said, rows = _fit(_config(os.path.join(root, "auto"), resume="auto", max_steps=2))
        assert said[0] == (f"--resume auto: no checkpoint under {os.path.join(root, 'auto', 'checkpoints')}, "
                           "starting from step 0"), said
        assert [line.split(":")[0] for line in said[1:]] == [  # the run's summary lines
            "throughput over 1 step", "passkey accuracy on 2 held-out rows of 128 tokens"], said
        assert [r["step"] for r in rows] == [1, 2]


@checks.add
def an_earlier_run_is_refused_unless_resume_or_overwrite():
    from llama_cp import Trainer
    from llama_cp.train.checkpoint_files import complete_checkpoints

    with shared_tmpdir() as root:
        out = os.path.join(root, "run")
        _fit(_config(out, max_steps=4))
        dist.barrier()  # rank 0 draws loss.png after the others return
        with pytest.raises(ValueError, match=r"holds an earlier run \(checkpoints up to step 4, final/, metrics\.jsonl, "
                                             r"tensorboard/, loss\.png\); pass --resume to continue it, --overwrite "
                                             r"to start over \(deletes them\), or choose another --output_dir$"):
            Trainer(_config(out, max_steps=2)).fit()
        assert [s for s, _ in complete_checkpoints(out)] == [2, 4]  # nothing was touched
        dist.barrier()
        if dist.get_rank() == 0:  # a finished run whose checkpoints were deleted (or never saved)
            shutil.rmtree(os.path.join(out, "checkpoints"))
        dist.barrier()
        with pytest.raises(ValueError, match=r"holds an earlier run \(final/, metrics\.jsonl, tensorboard/, loss\.png\)"):
            Trainer(_config(out, max_steps=2)).fit()
        assert len(_metrics(out)) == 4
        dist.barrier()  # every rank has looked before the overwrite below deletes it
        _, rows = _fit(_config(out, max_steps=2, overwrite=True))
        assert [r["step"] for r in rows] == [1, 2] and [s for s, _ in complete_checkpoints(out)] == [2]
        assert len(os.listdir(os.path.join(out, "tensorboard"))) == 1  # the old run's events are gone
        with open(os.path.join(out, "config.yaml")) as f:  # the resolved config is saved
            assert "context_length: 128" in f.read()
        dist.barrier()


def _lr(step, lr, max_steps, warmup_steps=1, floor=0.1):
    """The cosine schedule's lr of the step after ``step`` optimizer steps (written out again, as a reference)."""
    if step < warmup_steps:
        return lr * (step + 1) / (warmup_steps + 1)
    progress = (step - warmup_steps) / (max_steps - warmup_steps)
    return lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


@checks.add
def resume_takes_the_new_schedule_or_refuses_a_setting_in_one_line():
    from llama_cp import Trainer

    with shared_tmpdir() as root:
        out = os.path.join(root, "lora")
        _fit(_config(out, max_steps=2, use_peft=True))  # lr 3e-3, weight_decay 0
        # the schedule and the update take the new flags from the resumed step on
        trainer = Trainer(_config(out, max_steps=4, resume=True, use_peft=True, lr=1e-3, weight_decay=0.1))
        said = []
        trainer._say = said.append
        trainer.fit()
        rows = _metrics(out)
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        for row in rows[2:]:
            assert abs(row["lr"] - _lr(row["step"] - 1, 1e-3, 4)) <= 1e-12, row
        assert abs(rows[1]["lr"] - _lr(1, 3e-3, 2)) <= 1e-12, rows[1]
        assert all(group["weight_decay"] == 0.1 for group in trainer.optimizer.param_groups)
        if dist.get_rank() == 0:
            prefix = "--resume with a changed setting, in effect from the resumed step on: "
            assert said[:3] == [prefix + "lr: 0.003 -> 0.001", prefix + "weight_decay: 0.0 -> 0.1",
                                prefix + "max_steps: 2 -> 4"], said

        # what the checkpoint holds, or what a step trains on, cannot change: one line, before any build
        where = os.path.join(out, "checkpoints")
        state = "the checkpoint holds another model or optimizer state"
        data = "the data order and what one step trains on would change mid-run"
        for flags, changed, reason, fix in [
            (dict(lora_r=16), "--lora_r (8 -> 16)", state, "--lora_r 8"),
            (dict(lora_target_modules="q_proj,v_proj"), "--lora_target_modules (q_proj,k_proj,v_proj,o_proj -> "
             "q_proj,v_proj)", state, "--lora_target_modules q_proj,k_proj,v_proj,o_proj"),
            (dict(quantization="4bit"), "--quantization (none -> 4bit)", state, "--quantization none"),
            (dict(gradient_accumulation_steps=2, seed=1), "--gradient_accumulation_steps (1 -> 2), --seed (0 -> 1)",
             data, "--gradient_accumulation_steps 1 --seed 0"),
        ]:
            trainer = Trainer(_config(out, max_steps=4, resume=True, use_peft=True, **flags))
            trainer.setup = lambda: pytest.fail("built a model for a resume that must be refused")
            with pytest.raises(ValueError) as refused:
                trainer.fit()
            assert str(refused.value) == (
                f"--resume cannot change {changed}: {reason}. Resume with {fix} as the checkpoints in {where} were "
                "trained, or start a new run (--overwrite or another --output_dir)"
            ), str(refused.value)
        trainer = Trainer(_config(out, max_steps=4, resume=True))  # no --use_peft: a full fine-tune
        trainer.setup = lambda: pytest.fail("built a model for a resume that must be refused")
        with pytest.raises(ValueError, match=r"^--resume cannot change --use_peft \(True -> False\): the checkpoint "
                                             r"holds another model or optimizer state\. Resume with --use_peft True"):
            trainer.fit()
        dist.barrier()


@checks.add
def a_checkpoint_without_a_manifest_needs_allow_unverified_checkpoint():
    from llama_cp import Trainer
    from llama_cp.train.checkpoint_files import checkpoint_dir

    with shared_tmpdir() as root:
        out = os.path.join(root, "run")
        _fit(_config(out, max_steps=2))
        dist.barrier()
        if dist.get_rank() == 0:
            os.remove(os.path.join(checkpoint_dir(out, 2), "MANIFEST.json"))
        dist.barrier()
        with pytest.raises(ValueError, match=rf"^--resume: checkpoint {checkpoint_dir(out, 2)} has no MANIFEST\.json, "
                                             r"so its files cannot be verified .*; pass --allow_unverified_checkpoint "
                                             r"to load it anyway, or delete it to resume from an older checkpoint$"):
            Trainer(_config(out, max_steps=2, resume=True)).fit()
        said, rows = _fit(_config(out, max_steps=2, resume=True, allow_unverified_checkpoint=True))
        assert said == [f"resumed from step 2 ({checkpoint_dir(out, 2)})"] or dist.get_rank() != 0, said
        assert [r["step"] for r in rows] == [1, 2]
        dist.barrier()


@checks.add
def one_run_per_output_dir():
    from llama_cp import Trainer
    from llama_cp.train.run_dir import lock_output_dir

    with shared_tmpdir() as root:
        out = os.path.join(root, "run")
        if dist.get_rank() == 0:
            os.makedirs(out)
            holder = lock_output_dir(out)  # another run holds the directory
            with pytest.raises(RuntimeError, match=r"is in use by another run \(pid \d+ on .*, since .*\); wait"):
                Trainer(_config(out, max_steps=2)).fit()
            holder.close()
        dist.barrier()


results = checks.module_fixture(__name__, WORLD_SIZE)


@pytest.mark.parametrize("name", checks.names)
def test_check(results, name):
    checks.assert_passed(results, name)


# ---------------------------------------------------------------- stop signals (CLI, torchrun)
import re  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: Steps of a signal run: the first signal goes after step 3's row, the second (in the resumed run) after the row
#: of the step after the first stop, so a few steps are left for each to land before the end.
SIGNAL_STEPS = 12
SIGNAL_RUN = ["--cp", "2", "--context_length", "256", "--max_steps", str(SIGNAL_STEPS), "--log_every", "1",
              "--warmup_steps", "1",
              "--num_passkey_samples", "48", "--num_eval_samples", "2", "--lr", "3e-3"]


def _torchrun(output_dir, *flags):
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "recipes.finetune_longctx", *SIGNAL_RUN, "--output_dir", str(output_dir), *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _uninterrupted_rank(rank, port, output_dir, environ, cwd):
    """One rank of the reference run: the recipe's command line (run_cli, as ``python -m
    recipes.finetune_longctx`` runs it) in a rank forked from dist_harness's preloaded server, in
    torchrun's environment (Note [Ranks forked from a preloaded server] in tests/dist_harness.py)."""
    from llama_cp.parallel.mesh import end_distributed
    from llama_cp.train.cli import run_cli
    from recipes import finetune_longctx

    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    os.chdir(cwd)
    torch.set_num_threads(1)
    run_cli(finetune_longctx.main, usage="recipes.finetune_longctx", argv=[*SIGNAL_RUN, "--output_dir", output_dir])
    end_distributed()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The trajectory a signal run must resume into: the same command line, uninterrupted, on 2 ranks.
    What is checked against it is the signalled torchrun runs; this reference runs the recipe's
    command line in 2 ranks forked from the preloaded server (no torchrun agent, no fresh
    interpreters: ~12 s of CPU fewer), the same ranks, flags and single thread as under torchrun."""
    import torch.multiprocessing as mp

    from llama_cp.parallel.mesh import free_port

    out = tmp_path_factory.mktemp("uninterrupted")
    mp.start_processes(_uninterrupted_rank, args=(free_port(), str(out), dict(os.environ), ROOT), nprocs=2,
                       start_method="forkserver", join=True)
    return _metrics(out)


def test_sigusr1_is_caught_and_stops_with_its_name(tmp_path, monkeypatch):
    """SLURM's early warning (SIGUSR1) takes the path SIGTERM takes end to end below: recorded, not
    fatal, then the step is saved and the stop names it (one process: the all-reduce is the identity)."""
    from llama_cp.train import failures

    signals = failures.StopSignals()
    signals.catch()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)  # Python runs the handler between bytecodes
        assert signals.received == signal.SIGUSR1
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    monkeypatch.setattr(failures.dist, "all_reduce", lambda tensor, op=None: tensor)
    saved = []
    with pytest.raises(failures.TrainingStopped, match=r"^stopped by SIGUSR1 after step 3: saved .*step_3; resume "
                                                        r"with --resume$"):
        signals.stop_if_signalled(3, None, torch.device("cpu"), lambda step: saved.append(step) or f"x/step_{step}",
                                  str(tmp_path))
    assert saved == [3]


def _stop_with_sigterm(proc, out, rows, target):
    """Once ``out`` has ``rows`` metrics rows, SIGTERM torchrun (``target`` "torchrun", as SLURM/k8s
    send it) or one of its two workers only ("one_rank"); the run must finish the step, save it and
    exit non-zero saying so. Returns (the step, the checkpoint it saved, the run's stdout + stderr)."""
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(out / "metrics.jsonl") and len(_metrics(out)) >= rows:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before the signal"
    if target == "torchrun":
        proc.send_signal(signal.SIGTERM)
    else:
        workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(workers) == 2, workers
        os.kill(int(workers[-1]), signal.SIGTERM)
    stdout, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    stops = re.findall(r"^error: stopped by SIGTERM after step (\d+): saved (\S+); resume with --resume\b", err, re.M)
    assert len(stops) == 1, (target, err[-3000:])
    step, saved = int(stops[0][0]), stops[0][1]
    assert rows <= step < SIGNAL_STEPS and saved.endswith(f"step_{step:08d}") and os.path.isdir(saved), (step, saved)
    assert [r["step"] for r in _metrics(out)] == list(range(1, step + 1))
    return step, saved, stdout + err


def test_sigterm_saves_the_step_and_resume_continues_the_trajectory(tmp_path, uninterrupted):
    """SIGTERM to torchrun (as SLURM/k8s send it), then, in the resumed run, to one rank only: each
    time the ranks finish the step, save it, exit non-zero saying so; the last --resume then gives
    the uninterrupted trajectory (SIGUSR1, the same handler: test_sigusr1_is_caught_and_stops_with_its_name).
    The two signals were two tests of two runs and a resume each; chained in one trajectory they
    check the same (the second stop is also a resumed run's), one torchrun launch (~7 s) fewer."""
    out = tmp_path / "run"
    first, first_saved, _ = _stop_with_sigterm(_torchrun(out), out, 3, "torchrun")
    # the resumed run gets the second signal once it has trained a step of its own
    second, second_saved, said = _stop_with_sigterm(_torchrun(out, "--resume"), out, first + 1, "one_rank")
    assert f"resumed from step {first} ({first_saved})" in said
    resumed = _torchrun(out, "--resume")
    stdout, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    assert f"resumed from step {second} ({second_saved})" in stdout + err
    got = _metrics(out)
    assert [r["step"] for r in got] == list(range(1, SIGNAL_STEPS + 1))
    for g, w in zip(got, uninterrupted, strict=True):
        for key in ("loss", "grad_norm", "lr"):
            assert abs(g[key] - w[key]) <= 1e-6 * max(1.0, abs(w[key])), (g, w)


# ---------------------------------------------------------------- a stuck rank, a full disk


def _intact(path) -> bool:
    """Every file of checkpoint ``path`` has the size and sha256 its manifest records."""
    from llama_cp.train.checkpoint_files import COMPLETE_MARKER, MANIFEST_FILE, _file_digest

    with open(os.path.join(path, MANIFEST_FILE)) as f:
        files = json.load(f)["files"]
    return os.path.isfile(os.path.join(path, COMPLETE_MARKER)) and all(
        _file_digest(os.path.join(path, name)) == entry for name, entry in files.items()
    )


def test_a_stopped_rank_ends_the_job_after_the_collective_timeout(tmp_path):
    """SIGSTOP one of two ranks (launched directly, as srun does): after --collective_timeout
    the other gives up with one line naming itself, the step, the stopped rank and the
    newest checkpoint, which is intact, and ends the stopped rank (Note [Stuck ranks]);
    not gloo's 30-minute hang."""
    from llama_cp.parallel.mesh import free_port

    out, port = tmp_path / "run", str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "recipes.finetune_longctx", *SIGNAL_RUN[:-4], "--max_steps", "1000",
             "--save_every", "2", "--collective_timeout", "5", "--output_dir", str(out)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
        )
        for rank in range(2)
    ]
    try:
        deadline = time.time() + 300
        while time.time() < deadline and all(p.poll() is None for p in procs):
            if os.path.exists(out / "metrics.jsonl") and len(_metrics(out)) >= 3:
                break
            time.sleep(0.05)
        assert all(p.poll() is None for p in procs), "a rank ended before the stop"
        os.kill(procs[1].pid, signal.SIGSTOP)
        stopped = time.time()
        _, err = procs[0].communicate(timeout=120)
        waited = time.time() - stopped
        procs[1].wait(timeout=5)  # rank 0 ended it
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    assert procs[0].returncode == 1 and procs[1].returncode == -signal.SIGKILL and 5 <= waited < 60, (
        procs[0].returncode, procs[1].returncode, waited)
    found = re.findall(
        r"^error \(rank 0\): gave up waiting for a collective in step (\d+) \(.+\): another rank is stuck .*; "
        r"on this machine rank 1 is stopped; --collective_timeout is 5 s\. The newest checkpoint is (\S+): "
        r"resume with --resume", err, re.M,
    )
    assert len(found) == 1, err[-3000:]
    step, saved = int(found[0][0]), found[0][1]
    assert step >= 4 and saved.endswith(f"step_{(step - 1) // 2 * 2:08d}") and _intact(saved), (step, saved)


def test_a_stopped_rank_ends_the_torchrun_job_within_the_collective_timeout(tmp_path):
    """SIGSTOP one of two torchrun workers with --collective_timeout 5: torchrun exits within
    the timeout + 10 s (a step in flight, torchrun's own exit). It took the timeout + ~35 s:
    rank 0's Python teardown, then torchrun's 30 s SIGTERM grace for the stopped rank."""
    proc = _torchrun(tmp_path / "run", "--max_steps", "1000", "--save_every", "2", "--collective_timeout", "5")
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            if os.path.exists(tmp_path / "run" / "metrics.jsonl") and len(_metrics(tmp_path / "run")) >= 3:
                break
            time.sleep(0.05)
        workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert proc.poll() is None and len(workers) == 2, workers
        os.kill(int(workers[-1]), signal.SIGSTOP)
        stopped = time.time()
        _, err = proc.communicate(timeout=120)
        waited = time.time() - stopped
    finally:
        proc.kill()
        for pid in workers:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    print(f"torchrun exited {waited:.1f} s after the SIGSTOP")
    assert proc.returncode == 1 and 5 <= waited < 15, (proc.returncode, waited, err[-3000:])
    assert len(re.findall(r"^error \(rank 0\): gave up waiting for a collective in step \d+ .*; on this machine "
                          r"rank 1 is stopped; --collective_timeout is 5 s\.", err, re.M)) == 1, err[-3000:]
    assert "forcefully exiting via 9" not in err  # torchrun had nothing left to SIGKILL after its grace period


def test_a_full_disk_fails_the_save_and_keeps_the_last_checkpoint(tmp_path):
    """The output_dir on a 60 MiB filesystem: the step-1 checkpoint (~39 MiB) fits, the
    step-2 one does not. One line says the disk is full; no half-written checkpoint stays,
    the step-1 one is intact, nothing is exported."""
    from probes import tmpfs

    disk = tmp_path / "disk"
    disk.mkdir()
    with tmpfs(disk, "size=60m"):
        out = disk / "run"
        result = subprocess.run(
            [sys.executable, "-m", "recipes.finetune_longctx", "--context_length", "128", "--max_steps", "4",
             "--save_every", "1", "--keep_last", "3", "--num_passkey_samples", "8", "--num_eval_samples", "1",
             "--output_dir", str(out)],
            capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
        first = out / "checkpoints" / "step_00000001"
        assert result.returncode == 1 and len(errors) == 1, result.stderr[-3000:]
        assert re.fullmatch(
            rf"error: saving the checkpoint of step 2 in \S+\.tmp-step_00000002 failed: the filesystem is full "
            rf"\([\d.]+ MiB free; the writer said: (\[Errno 28\] No space left on device|unexpected pos \d+ vs \d+)\)\. Nothing of it was kept; "
            rf"the newest checkpoint, {first}, is "
            r"intact\. Free space, lower --keep_last or choose another --output_dir, then --resume "
            r"\(rerun with --debug for the traceback\)", errors[0]), errors[0]
        assert os.listdir(out / "checkpoints") == ["step_00000001"] and _intact(first)
        assert not (out / "final").exists()


def test_a_write_failure_is_described_without_traceback_text(tmp_path):
    """DCP's CheckpointException prints a traceback per rank as its text; the message gives the
    operating system's error behind it (or else the innermost error), on one line."""
    import errno
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from llama_cp.train.write_failures import describe_write_failure

    def failed_save(system_error):
        """DCP's exception for a rank whose zip writer failed (while handling ``system_error``)."""
        try:
            try:
                if system_error is not None:
                    raise system_error
            finally:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        except RuntimeError as inner:
            return CheckpointException("save failed", {0: (inner, traceback.extract_tb(inner.__traceback__))})

    full = failed_save(OSError(errno.ENOSPC, "No space left on device"))
    assert "Traceback" in str(full)  # what the message used to embed
    message = describe_write_failure(full, "saving the checkpoint of step 2", str(tmp_path / ".tmp"), str(tmp_path))
    assert re.fullmatch(
        rf"saving the checkpoint of step 2 in {tmp_path}/\.tmp failed: the filesystem is full \([\d.]+ MiB free; the "
        r"writer said: \[Errno 28\] No space left on device\)\. Nothing of it was kept; no earlier checkpoint exists\. "
        r"Free space, lower --keep_last or choose another --output_dir, then --resume", message), message
    for error, said in ((failed_save(OSError(errno.EIO, "Input/output error")), "[Errno 5] Input/output error"),
                        (failed_save(None), "unexpected pos 704 vs 598")):
        message = describe_write_failure(error, "exporting final", str(tmp_path / "final"), str(tmp_path))
        assert message == (f"exporting final in {tmp_path / 'final'} failed: {said}. Nothing of it was kept; no earlier "
                           "checkpoint exists. Fix the cause, then --resume"), message
