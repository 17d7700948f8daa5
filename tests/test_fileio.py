"""fileio.atomic_dir puts a folder in place whole or not at all: over a folder or a file, after a crash's leftover,
through an error in the block; a full disk (a small tmpfs) is one DiskFullError with the old folder intact, for
atomic_dir itself and for convert.py export."""
import os
import shlex
import sys

import pytest

from conftest import REPO
from faults import run_on_small_disk
from fileio import atomic_dir
from test_export import MINIMIND_TOKENIZER, TINY, random_checkpoint

FILL = """import sys
from errors import DiskFullError
from fileio import atomic_dir
try:
    with atomic_dir(sys.argv[1]) as tmp:
        (tmp / "small.txt").write_text("fits")
        (tmp / "big.bin").write_bytes(bytes(1 << 20))
except DiskFullError as e:
    print(e)
"""


def test_atomic_dir_puts_a_whole_folder_in_place_of_a_folder_or_a_file(tmp_path):
    out = tmp_path / "out"
    with atomic_dir(out) as tmp:
        assert tmp == tmp_path / "out.tmp" and tmp.is_dir() and not out.exists()
        (tmp / "sub").mkdir()
        (tmp / "sub" / "a.txt").write_text("nested")
    assert (out / "sub" / "a.txt").read_text() == "nested"
    with atomic_dir(out) as tmp:  # over a folder that is not empty: the old one goes
        (tmp / "b.txt").write_text("newer")
    assert [p.name for p in out.iterdir()] == ["b.txt"]
    (tmp_path / "file").write_text("a file")
    with atomic_dir(tmp_path / "file") as tmp:
        (tmp / "c.txt").write_text("in a folder now")
    assert (tmp_path / "file" / "c.txt").read_text() == "in a folder now"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "out"]  # no temp or set-aside folder left


def test_an_error_in_the_block_leaves_the_old_folder_and_no_temp_folder(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    (tmp_path / "out.tmp").mkdir()  # a crash's leftover: cleared, not mixed into the new folder
    (tmp_path / "out.tmp" / "stale.txt").write_text("old")
    with pytest.raises(ValueError, match="half-way"):
        with atomic_dir(out) as tmp:
            assert list(tmp.iterdir()) == []
            (tmp / "half.txt").write_text("half")
            raise ValueError("half-way")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"


def on_a_full_disk(tmp_path, command: str, size: str) -> tuple[str, str, list[str], list[str]]:
    """command (run in the repository, writing {mount}/out) on a tmpfs of size that already holds out/keep.txt ->
    (its stdout, its stderr, the tmpfs's listing after, out's listing after)."""
    mount, keep = tmp_path / "disk", tmp_path / "keep"
    mount.mkdir()
    keep.mkdir()
    script = (f"mkdir {mount}/out && echo mine > {mount}/out/keep.txt\n"
              f"cd {shlex.quote(REPO)} && {command.format(mount=mount)} > {keep}/stdout 2> {keep}/stderr\n"
              f"ls -A {mount} > {keep}/listing; ls -A {mount}/out > {keep}/out; cat {mount}/out/keep.txt > {keep}/kept\n")
    done = run_on_small_disk(script, mount, size, env={**os.environ, "PYTHONPATH": REPO}, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (keep / "kept").read_text() == "mine\n"
    return ((keep / "stdout").read_text(), (keep / "stderr").read_text(), (keep / "listing").read_text().split(),
            (keep / "out").read_text().split())


def test_a_full_disk_is_one_disk_full_error_and_the_old_folder_stays(tmp_path):
    (tmp_path / "fill.py").write_text(FILL)
    out, err, listing, old = on_a_full_disk(tmp_path, f"{shlex.quote(sys.executable)} {tmp_path}/fill.py {{mount}}/out",
                                            "256k")
    assert out == (f"no space left on the device to write {tmp_path}/disk/out: nothing was replaced (the previous "
                   "folder, if any, is intact); free some space and run again\n") and err == ""
    assert listing == ["out"] and old == ["keep.txt"]


def test_a_full_disk_during_a_folder_export_is_one_error_line_and_the_old_export_stays(tmp_path):
    ckpt = random_checkpoint(tmp_path / "ckpt.pt", TINY["tied_gqa"], MINIMIND_TOKENIZER)  # ~1.7 MB of weights
    out, err, listing, old = on_a_full_disk(
        tmp_path, f"{shlex.quote(sys.executable)} convert.py export {ckpt} {{mount}}/out --force", "512k")
    assert out == ""
    assert err.splitlines() == [f"error: no space left on the device to write {tmp_path}/disk/out: nothing was "
                                "replaced (the previous folder, if any, is intact); free some space and run again"]
    assert listing == ["out"] and old == ["keep.txt"]
