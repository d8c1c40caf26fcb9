"""Files written whole: into a temporary name beside the target, then renamed over it (a rename
within one directory is atomic on POSIX), so a reader, or a run resumed after a crash, never
finds half a file under the real name. The temporary name carries the process id: ranks of one
job that write the same file at once do not write into each other's."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def write_whole(path: str | os.PathLike, write: Callable[[str], object]) -> None:
    """``write(temporary)`` a file beside ``path``, then rename it to ``path``; on an error the
    temporary file is removed and ``path`` is left as it was."""
    directory, base = os.path.split(os.path.abspath(path))
    temporary = os.path.join(directory, f".{base}.{os.getpid()}.tmp")
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    """``text`` into ``path``, whole (:func:`write_whole`)."""
    write_whole(path, lambda temporary: Path(temporary).write_text(text))
