"""The house rules that a reader can count: every module of the library, the recipes and the
benchmarks stays short enough to read in one sitting (one concern a module; issue 45)."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: The most lines a module may have.
MAX_LINES = 500
#: The folders whose modules are counted, from the repository root.
COUNTED = ("llama_cp", "recipes", "benchmarks")


def long_modules(root: str = ROOT, limit: int = MAX_LINES) -> dict[str, int]:
    """``{path: lines}`` of every .py file under ``COUNTED`` with more than ``limit`` lines, the
    paths relative to ``root``."""
    found = {}
    for folder in COUNTED:
        for directory, subdirectories, files in os.walk(os.path.join(root, folder)):
            subdirectories[:] = sorted(d for d in subdirectories if d != "__pycache__")
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(directory, name)
                    with open(path, encoding="utf-8") as f:
                        lines = sum(1 for _ in f)
                    if lines > limit:
                        found[os.path.relpath(path, root)] = lines
    return found


def test_long_modules_counts_lines_of_python_files_only(tmp_path):
    package = tmp_path / "llama_cp" / "inner"
    package.mkdir(parents=True)
    (package / "long.py").write_text("x = 1\n" * 4)
    (package / "short.py").write_text("x = 1\n" * 3)
    (package / "notes.md").write_text("text\n" * 9)
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "last_line_unended.py").write_text("x = 1\n" * 3 + "y = 2")
    assert long_modules(str(tmp_path), limit=3) == {
        os.path.join("llama_cp", "inner", "long.py"): 4, os.path.join("benchmarks", "last_line_unended.py"): 4}


def test_every_module_has_at_most_500_lines():
    offenders = long_modules()
    listed = "\n".join(f"  {path}: {lines} lines" for path, lines in sorted(offenders.items()))
    assert not offenders, f"modules over {MAX_LINES} lines (split them by concern):\n{listed}"


#: The README's size limit: what it is, the two commands, a launch, the flags, where to read on.
README_BYTES = 10 * 1024


def test_the_readme_is_short_and_its_history_is_in_the_changelog():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert len(readme.encode()) <= README_BYTES, f"README.md has {len(readme.encode())} bytes, more than {README_BYTES}"
    assert "Behaviour change" not in readme, "behaviour changes belong in CHANGELOG.md"
    with open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8") as f:
        assert f.read().startswith("# ")
