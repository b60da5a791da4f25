"""The one way the Python package writes an output file.

The same rules as the C++ side's ``WriteOutputFile`` (util/file_io.h), for
the files Python writes (``Scales.save``, ``Evaluation.to_json``):

- the bytes go to a temporary file beside the target
  (``NAME.PID-N.kvcal-tmp``), which is fsynced, renamed over the target, and
  the directory fsynced: a reader sees the old file or the new one;
- a symbolic link is written through: the link stays, the file it points to
  is replaced (its mode kept);
- a target that exists and is not a regular file (a directory, a device, a
  FIFO, a socket) is refused with ValueError before anything is created; a
  missing directory is FileNotFoundError;
- a failed write (the writer's exception, a full disk, a file-size limit)
  removes the temporary file and leaves the target as it was.
"""
import itertools
import os
import stat

TEMP_SUFFIX = ".kvcal-tmp"
_created = itertools.count()


def _kind(mode):
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def resolve_output_path(path):
    """The file that writing ``path`` replaces: every symbolic link followed
    (a dangling link: the file it would create)."""
    path = os.fspath(path)
    if not path:
        raise ValueError("kvcal: the output path is empty")
    current = path
    for _ in range(41):
        if current.endswith("/"):
            raise ValueError(f"kvcal: output path {current} ends in '/': give a file name")
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            return current
        if not stat.S_ISLNK(st.st_mode):
            return current
        target = os.readlink(current)
        current = target if os.path.isabs(target) else os.path.join(os.path.dirname(current), target)
    raise ValueError(f"kvcal: output path {path}: too many levels of symbolic links")


def check_output_path(path):
    """What write_output_file checks before it creates anything; returns the
    resolved target and its stat (None when it does not exist yet)."""
    target = resolve_output_path(path)
    via = "" if target == os.fspath(path) else f" (the file the symbolic link {path} points to)"
    try:
        st = os.stat(target)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise ValueError(f"kvcal: refusing to write {target}{via}: it is {_kind(st.st_mode)}, "
                         "and kvcal replaces only regular files; give the path of a file")
    directory = os.path.dirname(target) or "."
    if st is None and not os.path.isdir(directory):
        raise FileNotFoundError(f"kvcal: cannot write {target}{via}: directory {directory} does not exist")
    return target, st


def write_output_file(path, data):
    """Writes ``data`` (bytes, or a function called with the open binary
    file) to ``path`` under the rules above."""
    target, st = check_output_path(path)
    directory = os.path.dirname(target) or "."
    temp = os.path.join(directory, f"{os.path.basename(target)[:200]}.{os.getpid()}-{next(_created)}{TEMP_SUFFIX}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            if st is not None:
                os.fchmod(f.fileno(), stat.S_IMODE(st.st_mode))
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, target)
    except BaseException:
        try:
            os.unlink(temp)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
