"""The Python package's output files follow the C++ rules (kvcal/_output.py,
util/file_io.h): written through links, non-regular targets refused, a
failed write leaving the target and no temporary file."""
import os
import socket
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvcal import _output
from kvcal.scales import read_safetensors, write_safetensors


def names(directory):
    return sorted(os.listdir(directory))


def test_creates_and_replaces_leaving_no_temporary_file(tmp_path):
    out = tmp_path / "out.json"
    _output.write_output_file(out, b"first")
    _output.write_output_file(out, b"second")
    assert out.read_bytes() == b"second"
    assert names(tmp_path) == ["out.json"]


def test_symbolic_links_are_written_through_and_mode_kept(tmp_path):
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "scales.safetensors"
    target.write_bytes(b"old")
    os.chmod(target, 0o600)
    link = tmp_path / "latest.safetensors"
    link.symlink_to("real/scales.safetensors")
    write_safetensors(str(link), {"x": np.arange(4, dtype=np.float32)})
    assert link.is_symlink()
    tensors, _ = read_safetensors(str(target))
    np.testing.assert_array_equal(tensors["x"], np.arange(4, dtype=np.float32))
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600
    assert names(tmp_path / "real") == ["scales.safetensors"]
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to("real/new.json")
    _output.write_output_file(dangling, b"{}")
    assert (tmp_path / "real" / "new.json").read_bytes() == b"{}"


def test_non_regular_targets_are_refused_and_left_alone(tmp_path):
    (tmp_path / "a-dir").mkdir()
    os.mkfifo(tmp_path / "a-fifo")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "a-socket"))
    (tmp_path / "link-to-fifo").symlink_to("a-fifo")
    before = names(tmp_path)
    for name, kind in [("a-dir", "a directory"), ("a-fifo", "a FIFO"),
                       ("a-socket", "a socket"), ("link-to-fifo", "a FIFO")]:
        with pytest.raises(ValueError, match=f"refusing to write .*: it is {kind}, and kvcal "
                                             "replaces only regular files"):
            _output.write_output_file(tmp_path / name, b"data")
        assert names(tmp_path) == before
    assert stat.S_ISFIFO(os.stat(tmp_path / "a-fifo").st_mode)
    sock.close()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _output.write_output_file(tmp_path / "missing" / "x.json", b"{}")


def test_a_failed_write_removes_its_temporary_file(tmp_path):
    out = tmp_path / "out"
    out.write_bytes(b"original")

    def half_then_fail(f):
        f.write(b"half")
        raise RuntimeError("the writer gave up")

    with pytest.raises(RuntimeError, match="gave up"):
        _output.write_output_file(out, half_then_fail)
    assert out.read_bytes() == b"original"
    assert names(tmp_path) == ["out"]


def test_a_file_size_limit_leaves_the_target_and_no_temporary_file(tmp_path):
    out = tmp_path / "out"
    out.write_bytes(b"original")
    # In a child, so the limit stays there; SIGXFSZ ignored: write() fails
    # with EFBIG, as on a full disk.
    script = textwrap.dedent(f"""
        import resource, signal, sys
        sys.path.insert(0, {os.path.dirname(os.path.dirname(_output.__file__))!r})
        from kvcal import _output
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        try:
            _output.write_output_file({str(out)!r}, b"x" * (1 << 20))
        except OSError as e:
            print(e.strerror)
            sys.exit(0)
        sys.exit(1)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "File too large" in run.stdout
    assert out.read_bytes() == b"original"
    assert names(tmp_path) == ["out"]
