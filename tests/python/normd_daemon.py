"""A normd process for the Python tests (tests/python, tests/gpu/test_python.py).

The daemon runs on a socket in a private temporary directory, which is also
its --state-dir, and is stopped with SIGTERM; it gets SIGTERM too if the test
process dies (no orphan daemons).
"""

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path


def _die_with_parent():
    """In the forked child: SIGTERM it if the test process dies."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class Daemon:
    """`binary --device DEVICE` with `extra` options; ready once it has logged event=listening."""

    def __init__(self, binary, device, *extra, log_level="debug", start_timeout=10,
                 stop_timeout=15):
        self.dir = tempfile.mkdtemp(prefix="normd-py.")
        self.socket = os.path.join(self.dir, "normd.sock")
        self.log_path = os.path.join(self.dir, "normd.log")
        self.stop_timeout = stop_timeout
        argv = [str(binary), "--config", "/dev/null", "--device", device, "--socket",
                self.socket, "--state-dir", self.dir, "--log-level", log_level, *extra]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         preexec_fn=_die_with_parent)
        deadline = time.monotonic() + start_timeout
        # The socket file exists from bind(); the daemon serves (and handles
        # SIGTERM) once it has logged event=listening.
        while not os.path.exists(self.socket) or "event=listening" not in self.log():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("normd did not start:\n" + self.log())
            time.sleep(0.01)

    def log(self):
        try:
            return Path(self.log_path).read_text(errors="replace")
        except OSError:
            return ""

    def stop(self):
        """SIGTERM, wait (stop_timeout s at most, then SIGKILL); returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return -1
        return self.proc.returncode

    def cleanup(self):
        for name in os.listdir(self.dir):
            os.unlink(os.path.join(self.dir, name))
        os.rmdir(self.dir)
