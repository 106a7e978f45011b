"""Fixtures for the Python binding's tests: a real CPU-backend daemon and clients.

The daemon is build/bin/normd (or $NORMD_BIN), started on a socket in a
private temporary directory and stopped with SIGTERM at the end; a daemon
that does not exit 0 fails the run. The package is imported from
bindings/python in this tree, and finds build/lib/libnormclient.so there.
"""

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "bindings" / "python"), str(Path(__file__).resolve().parent)]

import normd  # noqa: E402  (needs the path above)
import normd_daemon  # noqa: E402


def normd_bin():
    """The daemon binary: $NORMD_BIN (relative to the repository) or build/bin/normd."""
    path = Path(os.environ.get("NORMD_BIN", "build/bin/normd"))
    return path if path.is_absolute() else REPO / path


class Daemon(normd_daemon.Daemon):
    """A normd --device cpu process on a private socket."""

    def __init__(self, *extra):
        super().__init__(normd_bin(), "cpu", *extra)


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
