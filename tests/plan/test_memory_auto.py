"""``--memory auto`` (llama_cp/plan/auto.py): the first candidate that fits, the one-line refusal,
the cache, the resolution of --memory default, the trainer's choice on CPU (said, levers kept), and
a run the planner cannot plan.

Every plan here is of the embedded Llama cut to 3 layers (one simulation each) at the trainer
test's 1024 tokens (where checkpointing, the tiles and parameter offload each lower the peak),
and each configuration is planned once for the module (``planned``), so the choices below cost
few plans of their own."""

from __future__ import annotations

import json
import os

import pytest
import torch.distributed as dist

from dist_harness import map_in_processes
from llama_cp.config import TrainConfig
from llama_cp.modules.causal_lm import embedded_llama_config
from llama_cp.plan import auto, fit, memory, simulate
from llama_cp.plan.auto import NothingFits, candidates, choose_for_run, choose_levers, with_levers
from llama_cp.plan.fit import with_context
from llama_cp.plan.memory import GiB

#: The planned model: a config never handed to the planner itself (its build sets the config's dtype).
CONFIG = embedded_llama_config(num_hidden_layers=3)
#: The trainer test's run: the passkey task, one step; 2048 tokens, where each lever moves the peak on the floors' versions
#: too (at 1024 the optimizer phase is the peak of all but the last candidate there).
RUN = dict(context_length=2048, num_passkey_samples=2, num_eval_samples=1, max_steps=1, passkey_warmup=0,
           report_to="none")


def model_config():
    return embedded_llama_config(num_hidden_layers=3)


class Calls(list):
    """Every call's TrainConfig (a test may clear and count them), and the plans made so far."""

    def __init__(self):
        super().__init__()
        self.done: dict[tuple, memory.MemoryBreakdown] = {}

    @staticmethod
    def key(cfg, world_size, model_config) -> tuple:
        shape = {k: v for k, v in model_config.to_dict().items() if k != "dtype"}  # dtype: set by a plan
        return auto.cache_key(cfg, world_size, 0, CONFIG), json.dumps(shape, sort_keys=True)


@pytest.fixture(scope="module")
def planned():
    """``simulate.plan_step_memory`` for the module: each configuration planned once, told apart by
    what can change its memory (``auto.cache_key``: not --output_dir, --gpu_memory_gb, ...);
    yields the list of every call's TrainConfig (``Calls``), which a test may clear and count."""
    calls = Calls()
    plan = simulate.plan_step_memory

    def once(cfg, world_size, *, model_config):
        calls.append(cfg)
        key = calls.key(cfg, world_size, model_config)
        if key not in calls.done:
            calls.done[key] = plan(cfg, world_size, model_config=model_config)
        return calls.done[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(simulate, "plan_step_memory", once)
        yield calls


def plan_candidate(levers: dict) -> memory.MemoryBreakdown:
    """``simulate.plan_step_memory`` of the module's run with ``levers``, for ``map_in_processes``."""
    return simulate.plan_step_memory(with_levers(TrainConfig.from_flags(**RUN), levers), 1, model_config=model_config())


@pytest.fixture(scope="module")
def peaks(planned):
    """The planned peak of every candidate of the module's run, planned directly: in two processes
    (``map_in_processes``: one core each), each plan then kept as the module's plan of its candidate."""
    cfg = TrainConfig.from_flags(**RUN)
    levers = candidates(cfg)
    plans = map_in_processes(plan_candidate, levers)
    for lever, plan in zip(levers, plans, strict=True):
        planned.done.setdefault(planned.key(with_levers(cfg, lever), 1, model_config()), plan)
    return [plan.total for plan in plans]


def test_the_candidates_are_cumulative_cheapest_first():
    full, lora = TrainConfig.from_flags(**RUN), TrainConfig.from_flags(use_peft=True, **RUN)
    described = [auto.describe_levers(levers) for levers in candidates(full)]
    assert described == [
        "no lever", "activation checkpointing", "activation checkpointing, attention blocks of 16384",
        "activation checkpointing, attention blocks of 16384, MLP/norm tiles of 8192",
        "activation checkpointing, attention blocks of 16384, MLP/norm tiles of 8192, checkpoint offload",
        "activation checkpointing, attention blocks of 16384, MLP/norm tiles of 8192, checkpoint offload, "
        "parameter offload"]
    # LoRA: no parameter offload (full fine-tuning only); trainable norm copies: no norm tiles
    assert candidates(lora) == candidates(full)[:-1]
    saved = TrainConfig.from_flags(use_peft=True, lora_modules_to_save="norm", **RUN)
    assert candidates(saved)[3]["norm_tile_size"] == 0 and candidates(saved)[3]["mlp_tile_size"] == auto.TILE_SIZE


@pytest.mark.slow  # the planned fixtures: six plans (tests/conftest.py's tiers)
def test_auto_takes_the_first_candidate_that_fits(planned, peaks, tmp_path):
    cfg = TrainConfig.from_flags(**RUN)
    levers = candidates(cfg)
    # a budget at a candidate's peak, below every earlier one's: that candidate, and only its plans
    for k in (0, 1, len(levers) - 1):
        assert peaks[k] < min(peaks[:k], default=peaks[k] + 1), (k, peaks)
        expected = next(i for i, peak in enumerate(peaks) if peak <= peaks[k])
        planned.clear()
        choice = choose_levers(cfg, 1, peaks[k], model_config=model_config(), cache_dir=str(tmp_path / str(k)))
        assert choice.levers == levers[expected] and choice.plan.total == peaks[expected], (k, choice)
        assert [c.model for c in planned] == [with_levers(cfg, lv).model for lv in levers[:expected + 1]]
        assert choice.plans == expected + 1
    assert cfg == TrainConfig.from_flags(**RUN)  # the run's own config is left as it was


@pytest.mark.slow  # the planned fixtures: six plans (tests/conftest.py's tiers)
def test_nothing_fits_is_refused_with_the_peak_and_the_longest_context(planned, peaks, tmp_path):
    cfg = TrainConfig.from_flags(**RUN)
    with pytest.raises(NothingFits) as refused:
        choose_levers(cfg, 1, peaks[-1] - 1, model_config=model_config(), cache_dir=str(tmp_path))
    message, length = str(refused.value), refused.value.max_context
    assert "\n" not in message and refused.value.peak_bytes == peaks[-1]
    assert f"is {peaks[-1] / GiB:.2f} GiB per GPU" in message
    step = RUN["context_length"] // 32  # about 1/32 of the asked context, a multiple of 2 x cp
    assert f"the longest --context_length that fits with them is {length:,} tokens (searched in steps of {step})" in message
    # the longest: it fits with every lever, one step more does not
    every = with_levers(cfg, candidates(cfg)[-1])
    assert 0 < length < RUN["context_length"]
    assert simulate.plan_step_memory(with_context(every, length), 1, model_config=model_config()).total < peaks[-1]
    assert simulate.plan_step_memory(with_context(every, length + step), 1, model_config=model_config()).total >= peaks[-1]


@pytest.mark.slow  # the planned fixtures: six plans (tests/conftest.py's tiers)
def test_a_second_choice_is_read_from_the_cache(planned, peaks, tmp_path):
    cfg = TrainConfig.from_flags(**RUN)
    first = choose_levers(cfg, 1, peaks[1], model_config=model_config(), cache_dir=str(tmp_path))
    with pytest.raises(NothingFits) as refused:
        choose_levers(cfg, 1, peaks[-1] - 1, model_config=model_config(), cache_dir=str(tmp_path))
    planned.clear()
    again = choose_levers(with_levers(cfg, {}), 1, peaks[1], model_config=model_config(), cache_dir=str(tmp_path))
    assert again.levers == first.levers and again.plan == first.plan and again.plans == 0
    assert again.plan.tracked == first.plan.tracked and first.plan.tracked  # what the host bytes hold, kept too
    with pytest.raises(NothingFits) as cached:
        choose_levers(cfg, 1, peaks[-1] - 1, model_config=model_config(), cache_dir=str(tmp_path))
    assert str(cached.value) == str(refused.value) and cached.value.max_context == refused.value.max_context
    assert planned == []  # nothing planned: both from the cache
    # another budget, or another flag that changes memory, is another entry
    choose_levers(cfg, 1, peaks[0], model_config=model_config(), cache_dir=str(tmp_path))
    assert len(planned) == 1
    assert len(list(tmp_path.glob("*.json"))) == 3
    other = TrainConfig.from_flags(**{**RUN, "batch_size": 2})
    assert auto.cache_key(other, 1, peaks[1], CONFIG) != auto.cache_key(cfg, 1, peaks[1], CONFIG)
    moved = TrainConfig.from_flags(**{**RUN, "output_dir": str(tmp_path / "elsewhere"), "lr": 1e-4})
    assert auto.cache_key(moved, 1, peaks[1], CONFIG) == auto.cache_key(cfg, 1, peaks[1], CONFIG)


def test_memory_default_resolves_by_the_levers_given():
    assert TrainConfig.from_flags().model.memory == "auto"
    assert TrainConfig.from_flags(mlp_tile_size=4096).model.memory == "manual"
    assert TrainConfig.from_flags(activation_checkpointing=False).model.memory == "manual"  # given, if off
    assert TrainConfig.from_flags(memory="manual").model.memory == "manual"
    programmatic = TrainConfig()
    programmatic.model.offload_checkpoints, programmatic.model.activation_checkpointing = True, True
    programmatic.resolve_defaults()
    assert programmatic.model.memory == "manual"
    resolved = TrainConfig()
    resolved.resolve_defaults()
    resolved.resolve_defaults()  # idempotent: the resolved checkpointing is not a lever given
    assert resolved.model.memory == "auto"
    with pytest.raises(ValueError, match=r"^--memory auto chooses the memory levers itself, and "
                                         r"--activation_checkpointing true and --mlp_tile_size 4096 set levers: drop "
                                         r"them, or give --memory manual to set the levers yourself$"):
        TrainConfig.from_flags(memory="auto", activation_checkpointing=True, mlp_tile_size=4096)
    with pytest.raises(ValueError, match=r"--headroom is a fraction"):
        TrainConfig.from_flags(headroom=1.0)


@pytest.mark.slow  # the planned fixtures: six plans (tests/conftest.py's tiers)
def test_on_cuda_the_choice_is_set_and_a_run_that_cannot_fit_is_refused(planned, peaks, tmp_path):
    """``choose_for_run`` as the trainer calls it on a CUDA machine (the device type is passed in)."""
    said = []
    cfg = TrainConfig.from_flags(memory="auto", headroom=0.0, **RUN)
    cfg.model.gpu_memory_gb = (peaks[0] + peaks[1]) / 2 / GiB  # between no lever and checkpointing
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(auto, "planned_model_config", lambda name: model_config())
        record = choose_for_run(cfg, 1, "cuda", 80 * GiB, said.append, cache_dir=str(tmp_path))
        assert cfg.model.activation_checkpointing and cfg.model.attention_block_size == 0
        assert record["applied"] and record["chosen"] == "activation checkpointing"
        assert len(said) == 1 and said[0].startswith("--memory auto: activation checkpointing -> planned peak ")
        cfg = TrainConfig.from_flags(memory="auto", headroom=0.0, **RUN)
        cfg.model.gpu_memory_gb = (peaks[-1] - 1) / GiB  # exact: a division by a power of two
        with pytest.raises(NothingFits, match=r"^--memory auto: this run does not fit one GPU \(.* GiB GPU, 0% "
                                              r"headroom\): with every lever .* is .* GiB per GPU, over the .* GiB "
                                              r"usable; the longest --context_length that fits with them is "):
            choose_for_run(cfg, 1, "cuda", 80 * GiB, said.append, cache_dir=str(tmp_path))
    # without --gpu_memory_gb the device's memory is the budget (80 GiB: no lever needed)
    cfg = TrainConfig.from_flags(memory="auto", **RUN)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(auto, "planned_model_config", lambda name: model_config())
        record = choose_for_run(cfg, 1, "cuda", 80 * GiB, said.append, cache_dir=str(tmp_path))
    assert record["usable_bytes"] == fit.usable_bytes(80, 0.1)
    assert said[-1].startswith("--memory auto: no lever -> planned peak ") and "(80 GiB GPU, 10% headroom)" in said[-1]


def test_a_run_the_planner_cannot_plan_keeps_its_levers(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    said = []
    cfg = TrainConfig.from_flags(memory="auto", cp=2, cp_strategy="allgather", context_length=128)
    before = TrainConfig.flatten(cfg.to_dict())
    record = choose_for_run(cfg, 2, "cuda", 80 * GiB, said.append)
    assert said == [f"--memory auto could not plan this run, so the levers stay as given: {record['could_not_plan']}"]
    assert "cannot simulate --cp_strategy allgather" in said[0]
    assert TrainConfig.flatten(cfg.to_dict()) == before and not record["applied"]
    # --memory manual plans nothing; a CPU without --gpu_memory_gb has nothing to plan for
    assert choose_for_run(TrainConfig.from_flags(memory="manual"), 1, "cuda", 80 * GiB, said.append) == {
        "memory": "manual"}
    assert choose_for_run(TrainConfig.from_flags(), 1, "cpu", None, said.append) == {"memory": "auto", "planned": False}
    assert len(said) == 1


@pytest.mark.slow  # the planned fixtures: six plans (tests/conftest.py's tiers)
def test_the_cpu_trainer_says_the_choice_and_keeps_the_levers(planned, peaks, tmp_path, monkeypatch, capsys):
    from llama_cp import Trainer

    if dist.is_initialized():  # an earlier test's run: the trainer would plan in a child process
        dist.destroy_process_group()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(auto, "planned_model_config", lambda name: model_config())  # the module's plans
    # the run sets these in this process as a world of one: put back afterwards, so that a later
    # test's subprocess does not inherit this run's MASTER_PORT, whose store is bound here
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    before = {name: os.environ.get(name) for name in names}
    out = tmp_path / "run"
    cfg = TrainConfig.from_flags(memory="auto", headroom=0.0, output_dir=str(out), **RUN)
    cfg.model.gpu_memory_gb = (peaks[0] + peaks[1]) / 2 / GiB  # checkpointing needed
    try:
        Trainer(cfg).fit()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("--memory auto")]
    assert len(said) == 1 and said[0].startswith("--memory auto: activation checkpointing -> planned peak ")
    assert said[0].endswith("; the levers stay as given on cpu")
    assert (cfg.model.activation_checkpointing, cfg.model.attention_block_size) == (False, 16384)
    info = json.loads((out / "run_info.json").read_text())
    assert info["memory"]["levers"]["activation_checkpointing"] and not info["memory"]["applied"]
    assert info["memory"]["planned_peak_bytes"] == peaks[1]
    assert info["config"]["model"]["activation_checkpointing"] is False


@pytest.mark.slow  # the planned fixtures: six plans (tests/conftest.py's tiers)
def test_the_child_process_answers_what_choose_levers_returns_or_raises(planned, peaks, tmp_path, monkeypatch):
    """``python -m llama_cp.plan.auto``'s answer to what ``plan_elsewhere`` sends, through JSON,
    and the parent's reading of it: choose_levers' choice or its refusal."""
    monkeypatch.setattr(auto, "planned_model_config", lambda name: model_config())

    def ask(cfg, world_size, budget):
        request = {"config": cfg.to_dict(), "world_size": world_size, "budget_bytes": budget,
                   "cache_dir": str(tmp_path / "child")}
        return auto.read_answer(json.loads(json.dumps(auto.answer(json.loads(json.dumps(request))))))

    cfg = TrainConfig.from_flags(memory="auto", **RUN)
    here = choose_levers(cfg, 1, peaks[1], model_config=model_config(), cache_dir=str(tmp_path / "here"))
    assert ask(cfg, 1, peaks[1]) == here
    with pytest.raises(NothingFits) as refused:
        ask(cfg, 1, peaks[-1] - 1)
    assert str(refused.value).startswith("with every lever") and refused.value.peak_bytes == peaks[-1]
    with pytest.raises(ValueError, match="cannot simulate --cp_strategy allgather") as cannot:
        ask(TrainConfig.from_flags(cp=2, cp_strategy="allgather", context_length=128), 2, peaks[1])
    assert not isinstance(cannot.value, NothingFits)


@pytest.mark.slow  # the planned fixtures: six plans (tests/conftest.py's tiers)
def test_the_trainer_chooses_before_it_claims_the_output_dir(planned, peaks, tmp_path, monkeypatch, capsys):
    """fit() chooses before OutputDirClaim writes config.yaml (so it records the levers the run
    trains with on CUDA), not in setup() after it."""
    from llama_cp import Trainer
    from llama_cp.train import trainer as trainer_module

    if dist.is_initialized():
        dist.destroy_process_group()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(auto, "planned_model_config", lambda name: model_config())
    claimed = []  # what had been said about --memory when the output_dir was claimed

    def claim(self, say):
        claimed.append([line for line in capsys.readouterr().out.splitlines() if line.startswith("--memory auto")])

    def stop(self):
        raise RuntimeError("stop: nothing after the claim is needed here")

    monkeypatch.setattr(trainer_module.OutputDirClaim, "claim", claim)
    monkeypatch.setattr(Trainer, "setup", stop)
    cfg = TrainConfig.from_flags(memory="auto", gpu_memory_gb=80, output_dir=str(tmp_path / "run"), **RUN)
    with pytest.raises(RuntimeError, match="stop"):
        Trainer(cfg).fit()
    assert len(claimed) == 1 and claimed[0][0].startswith("--memory auto: no lever -> planned peak ")


@pytest.mark.slow
def test_a_process_with_a_process_group_plans_in_a_child(planned, tmp_path):
    """``plan_elsewhere``: the same choice from ``python -m llama_cp.plan.auto`` (the embedded model
    itself, planned in both processes)."""
    if dist.is_initialized():  # the trainer test's run: this process could not plan
        dist.destroy_process_group()
    cfg = TrainConfig.from_flags(**RUN)
    direct = choose_levers(cfg, 1, 80 * GiB, cache_dir=str(tmp_path / "here"))
    there = auto.plan_elsewhere(cfg, 1, 80 * GiB, cache_dir=str(tmp_path / "there"))
    assert (there.levers, there.plan, there.plans) == (direct.levers, direct.plan, direct.plans)
    # a refusal's way back through JSON: test_the_child_process_answers_what_choose_levers_returns_or_raises
