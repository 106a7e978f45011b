"""Fixtures for the Python binding's tests: a real CPU-backend daemon and clients.

The daemon is build/bin/normd (or $NORMD_BIN), started on a socket in a
private temporary directory and stopped with SIGTERM at the end; a daemon
that does not exit 0 fails the run. The package is imported from
bindings/python in this tree, and finds build/lib/libnormclient.so there.
"""

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bindings" / "python"))

import normd  # noqa: E402  (needs the path above)


def normd_bin():
    """The daemon binary: $NORMD_BIN (relative to the repository) or build/bin/normd."""
    path = Path(os.environ.get("NORMD_BIN", "build/bin/normd"))
    return path if path.is_absolute() else REPO / path


def _die_with_parent():
    """In the forked child: SIGTERM it if the test process dies (no orphan daemons)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class Daemon:
    """A normd --device cpu process on a private socket."""

    def __init__(self, *extra):
        self.dir = tempfile.mkdtemp(prefix="normd-py.")
        self.socket = os.path.join(self.dir, "normd.sock")
        self.log_path = os.path.join(self.dir, "normd.log")
        argv = [str(normd_bin()), "--config", "/dev/null", "--device", "cpu", "--socket",
                self.socket, "--state-dir", self.dir, "--log-level", "debug", *extra]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         preexec_fn=_die_with_parent)
        deadline = time.monotonic() + 10
        # The socket file exists from bind(); the daemon serves (and handles
        # SIGTERM) once it has logged event=listening.
        while not os.path.exists(self.socket) or "event=listening" not in self.log():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("normd did not start:\n" + self.log())
            time.sleep(0.01)

    def log(self):
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def stop(self):
        """SIGTERM, wait (15 s at most, then SIGKILL); returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return -1
        return self.proc.returncode

    def cleanup(self):
        for name in os.listdir(self.dir):
            os.unlink(os.path.join(self.dir, name))
        os.rmdir(self.dir)


@pytest.fixture(scope="session")
def daemon():
    """One daemon for the session; it must exit 0 on SIGTERM at the end."""
    d = Daemon()
    yield d
    rc = d.stop()
    log = d.log()
    d.cleanup()
    assert rc == 0, "normd exited with %s on SIGTERM; its log:\n%s" % (rc, log)


@pytest.fixture
def client(daemon):
    """A fresh connection to the session's daemon, closed after the test."""
    with normd.Client(daemon.socket, name="pytest") as c:
        yield c


@pytest.fixture
def rng():
    import numpy

    return numpy.random.default_rng(1234)
