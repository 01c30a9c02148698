"""An append-only file of whole lines that never keeps half a line (the JSONL exporter's files)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable

log = logging.getLogger("flashwatch.exporters.jsonl")

__all__ = ["AppendFile", "open_raw"]


class AppendFile:
    """One append-only file of whole lines: a failed write is cut back to the last whole line.

    The file is unbuffered (every ``write`` goes to the kernel at once), so nothing of a failed
    line waits in a buffer to be glued to the next one. ``end`` is the size of the file at its
    last whole line; a write that fails (a full disk) truncates the file back to it.

    An existing file whose last line has no newline (a line a crash cut off, or text another
    program wrote) loses nothing when it is opened: a last line that ``complete`` accepts (None:
    any) is kept and ended with a newline; another is moved to ``<name>.cut`` beside the file
    (appended there), so that the file goes on with whole lines. Either way one warning says so.
    """

    def __init__(self, path: Path, fsync: bool, complete: Callable[[bytes], bool] | None = None) -> None:
        self.path = path
        self.fsync = fsync
        self._f = open_raw(path)
        try:
            self.end = self._end_last_line(complete)
            st = os.fstat(self._f.fileno())
        except BaseException:
            self._f.close()
            raise
        self._inode = (st.st_dev, st.st_ino)
        self._damaged = False  # a failed write could not be cut back: start the next line afresh

    def _end_last_line(self, complete: Callable[[bytes], bool] | None) -> int:
        """End a last line that has no newline (see the class docstring); the new size."""
        size = os.fstat(self._f.fileno()).st_size
        if size == 0:
            return 0
        tail_start = max(0, size - 65536)
        while True:
            self._f.seek(tail_start)
            tail = self._f.read(size - tail_start)
            if tail.endswith(b"\n"):
                return size
            cut = tail.rfind(b"\n")
            if cut >= 0 or tail_start == 0:
                break
            tail_start = max(0, tail_start - 65536)
        keep = tail_start + cut + 1  # 0 when the file holds no whole line
        line = tail[cut + 1:]
        if complete is None or complete(line):
            log.warning("%s: its last line had no newline (written by another program, or cut off by a crash): "
                        "kept, and ended with one", self.path)
            self._f.write(b"\n")
            return size + 1
        aside = self.path.with_name(self.path.name + ".cut")
        with open(aside, "ab") as f:
            f.write(line + b"\n")
        log.warning("%s: its last %d bytes were not a whole line (cut off by a crash while they were written): "
                    "moved to %s", self.path, size - keep, aside)
        os.ftruncate(self._f.fileno(), keep)
        return keep

    def vanished(self) -> bool:
        """True when ``path`` no longer names this file (deleted, or its folder deleted or moved)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return True
        return (st.st_dev, st.st_ino) != self._inode

    def write(self, data: bytes) -> None:
        """Append ``data`` (whole lines); on failure, cut the file back to its last whole line.

        Raises:
            OSError: the write failed (the message names the file and says what was kept).
        """
        if self._damaged:
            data = b"\n" + data
        view = memoryview(data)
        try:
            while view:
                n = self._f.write(view)
                view = view[n or 0:]
            if self.fsync:
                os.fsync(self._f.fileno())
        except OSError as exc:
            repaired = self._repair()
            kept = ("the partial line was removed; the file ends with its last whole record" if repaired
                    else "the partial line could not be removed; readers skip it")
            raise OSError(exc.errno, f"flashwatch could not write {self.path}: {exc.strerror or exc} "
                                     f"({kept})") from exc
        self.end += len(data)
        self._damaged = False

    def _repair(self) -> bool:
        try:
            os.ftruncate(self._f.fileno(), self.end)
            return True
        except OSError:
            self._damaged = True
            try:
                self.end = os.fstat(self._f.fileno()).st_size
            except OSError:
                pass
            return False

    def close(self) -> None:
        self._f.close()


def open_raw(path: Path):
    """The file object ``AppendFile`` writes through: unbuffered, append-only, readable."""
    return open(path, "a+b", buffering=0)
