"""Host regions and clients: creation, sharing, free, use after free, close, fork."""

import gc
import os
import time

import numpy as np
import pytest

import normd
from normd import NormdError


def region_count(daemon):
    """The daemon's count of registered regions, seen by a separate client."""
    with normd.Client(daemon.socket, name="observer") as observer:
        return observer.stats()["regions"]


def client_count(daemon, expected, timeout=5.0):
    """Polls the daemon's client count (disconnects are noticed asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        with normd.Client(daemon.socket, name="observer") as observer:
            count = observer.stats()["clients"] - 1  # not the observer itself
        if count == expected or time.monotonic() > deadline:
            return count
        time.sleep(0.02)


def rms_forward(client, x, y, rstd):
    rows, cols = x.shape
    return client.run("RMSNORM_FWD", rows, cols, x=x, y=y, rstd=rstd)


def test_host_array_is_shared_zeroed_memory(client):
    x = client.host_array((3, 5), np.float32)
    assert x.shape == (3, 5) and x.dtype == np.float32 and not x.any()
    assert x.flags.writeable and x.flags.c_contiguous
    bf = client.host_array(7, "bf16")
    assert bf.dtype == np.uint16
    region = client.region_of(x)
    assert region is not None and region.size == x.nbytes and not region.freed
    assert client.tensor(x).region == region.id and client.tensor(x).offset == 0


def test_region_views_share_memory(client):
    region = client.host_region(4096)
    a = region.array(16, np.float32)
    b = region.array(16, np.float32, offset=0)
    a[:] = np.arange(16)
    assert np.array_equal(b, np.arange(16))
    c = region.array((2, 4), "f16")
    assert c.__array_interface__["data"][0] - region.address == normd.host.ALIGNMENT
    with pytest.raises(ValueError, match="do not fit"):
        region.array(4096, np.float32)


def test_free_then_use_is_refused(daemon, client, rng):
    before = region_count(daemon)
    x = client.host_copy(rng.normal(0, 1, (2, 8)).astype(np.float32))
    y = client.host_array((2, 8), np.float32)
    rstd = client.host_array(2, np.float32)
    assert region_count(daemon) == before + 3
    rms_forward(client, x, y, rstd)
    stale = client.tensor(x)
    client.free(x)
    assert region_count(daemon) == before + 2
    # The daemon refuses the stale region id ...
    with pytest.raises(NormdError) as info:
        client.run("RMSNORM_FWD", 2, 8, dtype="f32", x=stale, y=y, rstd=rstd)
    assert info.value.status == "NOT_FOUND"
    assert "region %d is not registered" % stale.region in info.value.message
    # ... the binding refuses the array, which stays readable here.
    with pytest.raises(NormdError) as info:
        rms_forward(client, x, y, rstd)
    assert info.value.status == "NOT_FOUND"
    assert x.shape == (2, 8) and np.isfinite(x).all()
    x[0, 0] = 1.0  # still our memory: writing is safe
    # Freeing again, or through the region, is a no-op.
    region = client.region_of(y)
    region.free()
    region.free()
    assert region.freed
    with pytest.raises(NormdError, match="not in a host region"):
        client.free(y)
    assert region_count(daemon) == before + 1


def test_region_context_manager(daemon, client):
    before = region_count(daemon)
    with client.host_region(100) as region:
        assert region_count(daemon) == before + 1
    assert region.freed
    assert region_count(daemon) == before


def test_close_frees_everything(daemon, rng):
    before = region_count(daemon)
    c = normd.Client(daemon.socket, name="closer")
    x = c.host_copy(rng.normal(0, 1, (2, 8)).astype(np.float32))
    c.host_array(100, np.float16)
    region = c.host_region(64)
    assert region_count(daemon) == before + 3
    c.close()
    assert c.closed
    assert region.freed
    assert region_count(daemon) == before
    assert np.isfinite(x).all()  # arrays outlive the client
    with pytest.raises(NormdError, match="the client is closed"):
        c.ping()
    with pytest.raises(NormdError, match="the client is closed"):
        c.host_region(64)
    c.close()  # idempotent
    region.free()  # no-op after close


def test_context_manager_closes(daemon):
    with normd.Client(daemon.socket) as c:
        c.ping()
    assert c.closed


def test_garbage_collected_client_disconnects(daemon):
    gc.collect()
    assert client_count(daemon, 0) == 0, "clients of earlier tests are still connected"
    c = normd.Client(daemon.socket, name="dropped")
    c.host_array(10, np.float32)
    assert client_count(daemon, 1) == 1
    del c
    gc.collect()
    assert client_count(daemon, 0) == 0


def test_forked_child_cannot_use_or_close_the_parents_client(client, rng):
    x = client.host_copy(rng.normal(0, 1, (2, 8)).astype(np.float32))
    y = client.host_array((2, 8), np.float32)
    rstd = client.host_array(2, np.float32)
    pid = os.fork()
    if pid == 0:  # the child: every use is refused, close() leaves the parent's session alone
        code = 1
        try:
            client.ping()
        except NormdError as err:
            code = 0 if "forked child" in err.message else 2
        client.close()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    client.ping()
    rms_forward(client, x, y, rstd)
    assert np.isfinite(y).all() and y.any()


def test_default_client(daemon, monkeypatch):
    monkeypatch.setenv("NORMD_SOCKET", daemon.socket)
    old = normd.set_default_client(None)
    try:
        first = normd.default_client()
        assert first is normd.default_client()
        assert first.socket == daemon.socket
        first.close()
        second = normd.default_client()
        assert second is not first and not second.closed
        second.close()
        with normd.Client(daemon.socket) as mine:
            normd.set_default_client(mine)
            assert normd.default_client() is mine
    finally:
        normd.set_default_client(old)
