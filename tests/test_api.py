"""The public API: what ``llama_cp`` exports, and the README's building-blocks loop run as
written on 2 ranks, its loss and gradient norm equal to plain single-process transformers."""

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
    for needed in ("init_distributed", "launch", "save_checkpoint", "load_checkpoint", "parallelize_model",
                   "optimizer_step", "forward_backward", "build_rows", "DistributedRowLoader", "build_causal_lm"):
        assert needed in llama_cp.__all__, needed
    for internal in ("ATTENTION_NAME", "ContextParallelAttention", "unshard"):
        assert internal not in llama_cp.__all__ and not hasattr(llama_cp, internal), internal


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
