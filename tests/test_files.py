"""llama_cp/files.py: a file is written whole or not at all."""

import os

import pytest

from llama_cp.files import write_text, write_whole


def test_a_file_is_replaced_whole_and_a_failed_write_leaves_the_old_one(tmp_path):
    path = tmp_path / "run_info.json"
    write_text(path, "old")
    seen = []

    def half_then_fail(temporary: str) -> None:
        with open(temporary, "w") as f:
            f.write("half")
        seen.append(os.listdir(tmp_path))  # the real name still holds the old text meanwhile
        assert path.read_text() == "old"
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_whole(path, half_then_fail)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["run_info.json"]  # no temporary left
    assert sorted(seen[0]) == [f".run_info.json.{os.getpid()}.tmp", "run_info.json"]  # beside it, by process
    write_text(path, "new")
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["run_info.json"]
