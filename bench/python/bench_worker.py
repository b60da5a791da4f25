"""One kvcal-worker process on 127.0.0.1 for a benchmark (port 0: the kernel
picks it; the worker writes it to a port file), shared by bench_capture.py
and bench_job.py.

    worker = Worker(WORKER_BIN, "--worker-id", "w0")
    client = kvcal.Client(worker.target)
    ...
    worker.peak_rss(), worker.cpu_seconds()
    worker.stop()
"""
import os
import signal
import subprocess
import tempfile
import time


class Worker:
    """A kvcal-worker (CPU backend) with `extra_args`; its output goes to a
    log file in a temporary directory (log() returns its end)."""

    def __init__(self, worker_bin, *extra_args):
        self.dir = tempfile.mkdtemp(prefix="kvcal-bench-")
        port_file = os.path.join(self.dir, "port")
        self.log_path = os.path.join(self.dir, "worker.log")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [worker_bin, "--listen", "127.0.0.1:0", "--port-file", port_file,
                 "--backend", "cpu", *extra_args],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvcal-worker exited {self.proc.returncode}: {self.log()}")
            if os.path.exists(port_file):
                with open(port_file) as f:
                    text = f.read().strip()
                if text:
                    self.target = f"127.0.0.1:{int(text)}"
                    return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError("kvcal-worker did not write its port: " + self.log())

    def log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()[-2000:]

    def peak_rss(self):
        """VmHWM in bytes (the process's peak resident set)."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmHWM in /proc/PID/status")

    def cpu_seconds(self):
        """user+sys CPU seconds of the process so far (/proc/PID/stat)."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
