"""
Writing files so that neither a crash nor a full disk costs what is already there.

  atomic_write(path)   write path.tmp, fsync, rename over path: a reader (or a resume) sees the old file or the
                       complete new one; on any failure the temp file is removed and path is left as it was
  atomic_dir(path)     the same for a folder: fill path.tmp/, fsync its files, then it takes path's place (what
                       was there moved aside and deleted)
  append_line(path)    one line at the end of a log (metrics.jsonl): what it held stays
  disk_full(e)         whether an exception comes from a full disk (or a quota), however deep torch wrapped it
A full disk is a DiskFullError naming the file: one `error:` line, not a traceback.
"""
import errno
import os
import shutil
import tempfile
from contextlib import contextmanager, suppress
from pathlib import Path

from errors import DiskFullError

NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def disk_full(e: BaseException | None) -> bool:
    """True if e, or an exception it was raised from or during (torch wraps the OSError of a write), is a full
    disk."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in NO_SPACE:
            return True
        e = e.__cause__ or e.__context__
    return False


def full_disk_error(path: str, what: str = "file") -> DiskFullError:
    return DiskFullError(f"no space left on the device to write {path}: nothing was replaced (the previous {what}, "
                         f"if any, is intact); free some space and run again")


@contextmanager
def atomic_write(path: str, mode: str = "wb", tmp: str | None = None, **open_args):
    """with atomic_write(path) as f: ... -- f is tmp (default path.tmp), renamed over path once written and
    fsynced."""
    tmp = tmp or f"{path}.tmp"
    try:
        with open(tmp, mode, **open_args) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with suppress(OSError):
            os.remove(tmp)
        if disk_full(e):
            raise full_disk_error(path) from None
        raise
    fsync_dir(path)


@contextmanager
def atomic_dir(path):
    """with atomic_dir(path) as tmp: ... -- tmp, a fresh folder path.tmp (a Path), is filled, its files fsynced, and
    then takes the place of path (a folder or a file, if any); on any failure tmp is removed and path is left as it
    was."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a crash
    try:
        tmp.mkdir(parents=True)
        yield tmp
        for folder, _, files in os.walk(tmp):
            for name in files:
                fsync_path(os.path.join(folder, name))
            fsync_path(folder)
        replace_tree(tmp, path)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if disk_full(e):
            raise full_disk_error(str(path), "folder") from None
        raise
    fsync_dir(str(path))


def replace_tree(src: Path, dst: Path):
    """Rename the folder src to dst; what dst was is moved aside first and deleted after (a folder cannot be
    renamed over a full one), so a crash between the two renames leaves it in a hidden .NAME.old.* beside dst."""
    if not os.path.lexists(dst):
        os.replace(src, dst)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old.", dir=dst.parent))
    os.replace(dst, aside / dst.name)
    try:
        os.replace(src, dst)
    except BaseException:
        os.replace(aside / dst.name, dst)  # back as it was
        os.rmdir(aside)
        raise
    shutil.rmtree(aside)


def fsync_path(path: str):
    """fsync a file or a folder by name."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str):
    """Make a rename into path's directory durable."""
    fsync_path(os.path.dirname(os.path.abspath(path)))


def append_line(path: str, line: str):
    """Append one line (a newline is added) to a text file; a full disk is a DiskFullError."""
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    except OSError as e:
        if disk_full(e):
            raise full_disk_error(path) from None
        raise
