"""Causing faults for real in tests: a full disk is a small tmpfs, mounted in a mount namespace of the script's own
(unshare: no root needed, nothing stays mounted when it exits)."""
import functools
import shlex
import shutil
import subprocess

import pytest


@functools.cache
def tmpfs_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "d=$(mktemp -d) && mount -t tmpfs -o size=64k tmpfs $d"],
                           capture_output=True)
    return probe.returncode == 0


def run_on_small_disk(script: str, mount, size: str, **run_args) -> subprocess.CompletedProcess:
    """Run the shell script with a tmpfs of size (e.g. "2m") mounted on the existing directory mount, so that what it
    writes there lands on a disk that fills. The tmpfs vanishes when the script ends: the script copies out what the
    test inspects. Skips the test where unshare or user namespaces are not available."""
    if not tmpfs_works():
        pytest.skip("needs unshare with user and mount namespaces (util-linux) for a real full disk")
    return subprocess.run(["unshare", "-rm", "sh", "-c",
                           f"mount -t tmpfs -o size={size} tmpfs {shlex.quote(str(mount))} || exit 99\n{script}"],
                          capture_output=True, text=True, **run_args)
