"""The public API: what ``llama_cp`` exports, and the README's building-blocks loop run as
written on 2 ranks, its loss and gradient norm equal to plain single-process transformers."""

import ast
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import llama_cp

ROOT = os.path.dirname(os.path.dirname(__file__))


def test_exports_are_what_a_loop_needs_and_nothing_test_only():
    for name in llama_cp.__all__:
        assert getattr(llama_cp, name) is not None, name
    for needed in ("init_distributed", "end_distributed", "launch", "save_checkpoint", "load_checkpoint", "parallelize_model",
                   "optimizer_step", "forward_backward", "build_rows", "DistributedRowLoader", "build_causal_lm",
                   "shard_batch", "unshard"):
        assert needed in llama_cp.__all__, needed
    for internal in ("ATTENTION_NAME", "ContextParallelAttention"):
        assert internal not in llama_cp.__all__ and not hasattr(llama_cp, internal), internal


def import_graph() -> dict[str, set[str]]:
    """Which llama_cp modules each llama_cp module imports, at the top or inside a function."""
    package = os.path.join(ROOT, "llama_cp")
    modules = {name[:-3] for name in os.listdir(package) if name.endswith(".py") and name != "__init__.py"}
    graph = {}
    for module in modules:
        with open(os.path.join(package, f"{module}.py")) as f:
            tree = ast.parse(f.read())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "llama_cp":
                imported |= {alias.name for alias in node.names}  # from llama_cp import kernels
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("llama_cp."):
                imported.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[1] for alias in node.names if alias.name.startswith("llama_cp.")}
        graph[module] = (imported & modules) - {module}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The groups of modules that import each other, directly or through others (sorted names)."""
    def reachable(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    reach = {module: reachable(module) for module in graph}
    return {tuple(sorted(m for m in graph if m in reach[module] and module in reach[m]))
            for module in graph if module in reach[module]}


def test_llama_cp_modules_do_not_import_each_other_in_a_circle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {("a", "b", "c")}
    graph = import_graph()
    # imports at the top (fsdp_wrap) and inside functions (quantize) are both seen
    assert "quantize" in graph["fsdp_wrap"] and "models" in graph["quantize"], graph
    assert import_cycles(graph) == set(), import_cycles(graph)


def readme_loop() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    after = readme[readme.index("The building blocks, for your own loop"):]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


@pytest.mark.slow
def test_readme_loop_runs_as_written_and_matches_transformers(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(readme_loop())
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
        capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    loss, grad_norm = map(float, re.search(r"loss (\S+) grad_norm (\S+)", result.stdout).groups())

    # the same model, tokens and labels in one process, through plain transformers
    from llama_cp.models import build_causal_lm, embedded_llama_config

    torch.manual_seed(0)
    model = build_causal_lm(embedded_llama_config())
    ids = torch.randint(0, 1024, (1, 4096), generator=torch.Generator().manual_seed(1))
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    want = F.cross_entropy(model(input_ids=ids).logits[0], labels[0], ignore_index=-100)
    want.backward()
    want_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert loss == pytest.approx(want.item(), rel=1e-5) and grad_norm == pytest.approx(want_norm.item(), rel=1e-4)


#: Two gloo ranks whose last all_reduce finishes while rank 0 leaves (rank 1 joins it late;
#: rank 0's globals drop the tensor, then hold the interpreter's exit up with an object slow to
#: delete). Left by the interpreter's own exit, the gloo worker releasing that work can abort the
#: rank (Note [Leaving a gloo job] in llama_cp/mesh.py): on 2 cores it did in some runs and not
#: in others, too irregular to assert; end_distributed() leaves before finalization.
LATE_COLLECTIVE = """
import sys, time
import torch, torch.distributed as dist
from llama_cp import end_distributed, init_distributed

init_distributed()


class DeletedSlowly:
    def __del__(self, sleep=time.sleep):  # the module's globals may be gone by then
        sleep(3)


if dist.get_rank() == 1:
    time.sleep(1.5)
tensor = torch.ones(4)
dist.all_reduce(tensor, async_op=True)  # its work object dropped: the gloo worker holds the last one
kept = DeletedSlowly()  # cleared after `tensor` (the globals go in order), its deletion outlasts rank 1's wait
print(f"rank {dist.get_rank()} leaves")
if sys.argv[1] == "end_distributed":
    end_distributed()
"""


@pytest.mark.slow
def test_end_distributed_leaves_cleanly_after_a_late_gloo_collective(tmp_path):
    script = tmp_path / "late.py"
    script.write_text(LATE_COLLECTIVE)
    for _ in range(2):
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
             "end_distributed"],
            capture_output=True, text=True, cwd=ROOT, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        # both ranks leave with status 0, their output flushed
        assert result.returncode == 0, result.stderr[-3000:]
        assert sorted(re.findall(r"rank \d leaves", result.stdout)) == ["rank 0 leaves", "rank 1 leaves"]
