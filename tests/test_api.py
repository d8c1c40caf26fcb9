"""The public API: what ``llama_cp`` exports, and the README's building-blocks loop run as
written on 2 ranks, its loss and gradient norm equal to plain single-process transformers."""

import ast
import functools
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


#: llama_cp's layers, from the top. A module imports only modules of its own layer or of the
#: layers below it; llama_cp/__init__.py, the public API, stands above them all. A layer is a
#: folder or a file at the top of the package (the product card's cp_attention.py and
#: fsdp_wrap.py share one). config (the dataclasses) stands below everything that reads a
#: TrainConfig, and above flags, what is done with one (reading flags, help, checks, defaults by
#: run), which takes the config it works on rather than importing it. Both stand above the parts
#: whose rules they check when a flag is given, data among them: --dataset is checked with the
#: data's own grammar (data/grammar.py), and the rows' conventions (IGNORE_INDEX) are the data's,
#: which the loss in model/ reads; the layers under config take plain values.
#: eval stands right under train: a run ends with the evaluations of its trained model, and
#: they read nothing of train. files (a file written whole) is on the ground: every layer writes.
LAYERS = (("train",), ("eval",), ("plan",), ("optim",), ("model",), ("config",), ("flags",), ("data",),
          ("cp_attention", "fsdp_wrap"), ("attention",), ("modules",), ("parallel", "files"))


#: llama_cp/__init__.py in the import graph: the public API, above every layer.
FACE = "__init__"


def package_modules() -> dict[str, str]:
    """Every llama_cp module but the package faces (``__init__.py``): dotted name under llama_cp -> path."""
    package = os.path.join(ROOT, "llama_cp")
    modules = {}
    for folder, _, files in os.walk(package):
        for name in files:
            if name.endswith(".py") and name != "__init__.py":
                path = os.path.join(folder, name)
                modules[os.path.relpath(path, package)[:-3].replace(os.sep, ".")] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """Which llama_cp modules each llama_cp module imports, at the top or inside a function."""
    return {module: set(imported) for module, imported in _read_import_graph().items()}


@functools.lru_cache(maxsize=None)
def _read_import_graph() -> dict[str, frozenset[str]]:
    """import_graph, read once a process (three tests read the same files)."""
    modules = package_modules()
    graph = {}
    for module, path in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "llama_cp":
                base = node.module.partition(".")[2]
                for alias in node.names:  # from llama_cp.attention import kernels: a module; else a name of base
                    imported.add(f"{base}.{alias.name}".lstrip(".") if f"{base}.{alias.name}".lstrip(".") in modules
                                 else base or FACE)
            elif isinstance(node, ast.Import):
                imported |= {alias.name.partition(".")[2] or FACE for alias in node.names
                             if alias.name.split(".")[0] == "llama_cp"}
        graph[module] = frozenset((imported & {*modules, FACE}) - {module})
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

    graph = {module: imported - {FACE} for module, imported in graph.items()}
    reach = {module: reachable(module) for module in graph}
    return {tuple(sorted(m for m in graph if m in reach[module] and module in reach[m]))
            for module in graph if module in reach[module]}


def imports_up(graph: dict[str, set[str]], layers=LAYERS) -> set[tuple[str, str]]:
    """The imports ``(module, imported)`` that run up: to a layer above the module's own."""
    height = {FACE: -1, **{name: i for i, names in enumerate(layers) for name in names}}
    return {(module, other) for module, imported in graph.items() for other in imported
            if height[other.split(".")[0]] < height[module.split(".")[0]]}


def test_llama_cp_modules_do_not_import_each_other_in_a_circle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {("a", "b", "c")}
    graph = import_graph()
    # imports at the top (fsdp_wrap), inside functions (quantize) and of a module by name are all seen
    assert "modules.quantize" in graph["fsdp_wrap"] and "modules.causal_lm" in graph["modules.quantize"], graph
    assert "attention.kernels" in graph["cp_attention"], graph  # from llama_cp.attention import kernels
    assert import_cycles(graph) == set(), import_cycles(graph)


def test_imports_only_run_down_the_layers():
    toy = {"top.a": {"low.b", "top.c"}, "top.c": set(), "low.b": {"top.a"}}
    assert imports_up(toy, layers=(("top",), ("low",))) == {("low.b", "top.a")}
    graph = import_graph()
    layered = {name for names in LAYERS for name in names}
    assert imports_up({"low.b": {FACE}}, layers=(("low",),)) == {("low.b", FACE)}  # import llama_cp, from below
    assert {module.split(".")[0] for module in graph} == layered, "a new folder or top-level file needs its place in LAYERS"
    assert imports_up(graph) == set()


def recipe_imports(source: str, in_recipes: bool) -> list[str]:
    """The import statements of ``source`` that reach recipes/: ``import recipes.X``, ``from recipes
    import X``, ``from recipes.X import f``, and in a recipe (``in_recipes``) a relative import too."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            reaches = any(alias.name.split(".")[0] == "recipes" for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            reaches = in_recipes if node.level else node.module.split(".")[0] == "recipes"
        else:
            continue
        if reaches:
            found.append(ast.unparse(node))
    return found


def test_no_recipe_imports_another_and_llama_cp_imports_no_recipe():
    """A recipe is a thin main over llama_cp: what two recipes share lives in llama_cp (as the post-training
    evals of finetune_longctx live in llama_cp/eval, not in eval_longctx), and llama_cp never reaches up."""
    toy = "import recipes.export\nfrom recipes import export\nfrom .export import main\nfrom llama_cp.eval import needle\n"
    assert recipe_imports(toy, in_recipes=True) == ["import recipes.export", "from recipes import export",
                                                    "from .export import main"]
    assert recipe_imports("from . import mesh\nimport recipes_of_mine\n", in_recipes=False) == []
    found = {}
    for top in ("recipes", "llama_cp"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    with open(path) as f:
                        imports = recipe_imports(f.read(), in_recipes=top == "recipes")
                    if imports:
                        found[os.path.relpath(path, ROOT)] = imports
    assert found == {}, found


def test_the_layers_folders_are_faces():
    # a folder's __init__.py says what the folder holds and imports nothing: a module is imported by its own path
    for name in (names[0] for names in LAYERS):
        init = os.path.join(ROOT, "llama_cp", name, "__init__.py")
        if os.path.isdir(os.path.dirname(init)):
            body = ast.parse(open(init).read()).body
            assert len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant), init


@pytest.mark.slow  # fresh interpreters, to see what an import leaves loaded
def test_the_package_face_imports_a_layer_when_a_name_is_read():
    """Note [A lazy package face]: ``import llama_cp`` (and a low layer) leaves transformers, datasets and
    the trainer unimported; reading a name imports its module only. The names type checkers see
    (the imports under TYPE_CHECKING) are the names served."""
    probe = ("import sys, llama_cp.parallel.mesh, llama_cp; heavy = ('transformers', 'datasets', 'llama_cp.train.trainer'); "
             "print(sorted(m for m in heavy if m in sys.modules)); llama_cp.ParallelDims; "
             "print(sorted(m for m in heavy if m in sys.modules)); llama_cp.Trainer; "
             "print(sorted(m for m in heavy if m in sys.modules))")
    lines = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT,
                           check=True).stdout.splitlines()
    assert lines == ["[]", "[]", "['llama_cp.train.trainer', 'transformers']"], lines
    tree = ast.parse(open(os.path.join(ROOT, "llama_cp", "__init__.py")).read())
    typed = {alias.name: node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
             for alias in node.names if (node.module or "").startswith("llama_cp")}
    assert typed == llama_cp._MODULES and sorted(typed) == llama_cp.__all__ and set(typed) <= set(dir(llama_cp))
    with pytest.raises(AttributeError, match="no attribute 'ContextParallelAttention'"):
        llama_cp.ContextParallelAttention


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
    from llama_cp.modules.causal_lm import build_causal_lm, embedded_llama_config

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
#: rank (Note [Leaving a gloo job] in llama_cp/parallel/mesh.py): on 2 cores it did in some runs and not
#: in others, too irregular to assert; end_distributed() leaves before finalization.
LATE_COLLECTIVE = """
import sys, time
import torch, torch.distributed as dist
from llama_cp import end_distributed, init_distributed

init_distributed()


class DeletedSlowly:
    def __del__(self, sleep=time.sleep):  # the module's globals may be gone by then
        sleep(1)


if dist.get_rank() == 1:
    time.sleep(0.5)
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
