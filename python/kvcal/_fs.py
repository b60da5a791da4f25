"""Small process and file-system helpers the calibrate modules share (the
run lock, the embedded worker, the checkpoint's shared lock)."""
from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True while process `pid` of this host runs (a zombie has exited; a
    process of another user counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def same_file(fd: int, path: str) -> bool:
    """True when `path` (not followed if a symbolic link) is the file open
    as `fd`: a lock holder that unlinked it leaves another file, or none."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)
