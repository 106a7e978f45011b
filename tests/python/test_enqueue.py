"""The enqueue mode through the binding, on a CPU-backend daemon.

Client.enqueue / check / stream_wait (nc_job_enqueue, nc_conn_check,
nc_stream_wait): on the CPU backend the stream argument is a key naming an
order and stream_wait(key) waits, on the host, for the key's jobs. Also the
completion-mode setting normd.normalization reads (NORMD_COMPLETION,
normd.set_completion_mode), which needs no torch.
"""

import os
import signal
import time

import numpy as np
import pytest
from conftest import Daemon
from test_ops import assert_close, ref_backward, ref_forward

import normd
from normd import NcTensor, NormdError

ROWS, COLS = 6, 96


@pytest.fixture
def rms_job(client, rng):
    """(x values, x, y, rstd) host arrays of an RMSNORM_FWD job."""
    values = rng.normal(0, 2, (ROWS, COLS)).astype(np.float32)
    x = client.host_copy(values)
    return (values.astype(np.float64), x, client.host_array((ROWS, COLS), np.float32),
            client.host_array(ROWS, np.float32))


def test_enqueue_then_stream_wait(client, rms_job):
    values, x, y, rstd = rms_job
    before = client.stats()["jobs_ok"]
    assert client.enqueue("RMSNORM_FWD", ROWS, COLS, x=x, y=y, rstd=rstd, stream=0) is None
    client.stream_wait(0)
    ref_y, _, ref_rstd = ref_forward(True, values, None, None)
    assert_close("y", y.astype(np.float64), ref_y, "f32")
    assert_close("rstd", rstd.astype(np.float64), ref_rstd, "f32")
    client.check()
    assert client.stats()["jobs_ok"] == before + 1  # the daemon ran it


def test_every_op_enqueued(client, rng):
    """LayerNorm and RMSNorm, forward and backward, bf16 with f32 weights, on one key."""
    rows, cols, key = 5, 64, 7
    values = normd.from_bf16(normd.to_bf16(rng.normal(0, 1, (rows, cols)).astype(np.float32)))
    x = client.host_copy(values, "bf16")
    gamma = client.host_copy(rng.uniform(0.5, 1.5, cols).astype(np.float32))
    beta = client.host_copy(rng.normal(0, 1, cols).astype(np.float32))
    dy_values = normd.from_bf16(normd.to_bf16(rng.normal(0, 1, (rows, cols)).astype(np.float32)))
    dy = client.host_copy(dy_values, "bf16")
    x64, dy64, g64 = values.astype(np.float64), dy_values.astype(np.float64), \
        gamma.astype(np.float64)
    for rms in (False, True):
        name = "RMSNORM" if rms else "LAYERNORM"
        y = client.host_array((rows, cols), "bf16")
        mean = None if rms else client.host_array(rows, np.float32)
        rstd = client.host_array(rows, np.float32)
        dx = client.host_array((rows, cols), "bf16")
        dgamma = client.host_array(cols, np.float32)
        dbeta = None if rms else client.host_array(cols, np.float32)
        client.enqueue(name + "_FWD", rows, cols, stream=key, x=x, y=y, mean=mean, rstd=rstd,
                       gamma=gamma, beta=None if rms else beta)
        # Queued behind the forward on the same key: it reads the forward's rstd.
        client.enqueue(name + "_BWD", rows, cols, stream=key, x=x, dy=dy, mean=mean,
                       rstd=rstd, gamma=gamma, dx=dx, dgamma=dgamma, dbeta=dbeta)
        client.stream_wait(key)
        ref_y, _, _ = ref_forward(rms, x64, g64, None if rms else beta.astype(np.float64))
        assert_close(name + " y", normd.from_bf16(y).astype(np.float64), ref_y, "bf16")
        ref_dx, ref_dg, ref_db = ref_backward(rms, dy64, x64, g64)
        assert_close(name + " dx", normd.from_bf16(dx).astype(np.float64), ref_dx, "bf16")
        assert_close(name + " dgamma", dgamma.astype(np.float64), ref_dg, "f32", factor=rows)
        if not rms:
            assert_close(name + " dbeta", dbeta.astype(np.float64), ref_db, "f32",
                         factor=rows)


def test_dependent_chain_runs_in_order(client, rms_job):
    """Each job reads the previous one's output: the key orders them."""
    values, x, _, _ = rms_job
    stages = [x] + [client.host_array((ROWS, COLS), np.float32) for _ in range(8)]
    rstd = client.host_array(ROWS, np.float32)
    for src, dst in zip(stages, stages[1:]):
        client.enqueue("RMSNORM_FWD", ROWS, COLS, x=src, y=dst, rstd=rstd, eps=1.0, stream=3)
    client.stream_wait(3)
    ref = values
    for _ in range(8):
        ref, _, _ = ref_forward(True, ref, None, None, eps=1.0)
    assert_close("chain", stages[-1].astype(np.float64), ref, "f32", factor=8)


def test_two_keys(client, rms_job):
    values, x, y, rstd = rms_job
    y2 = client.host_array((ROWS, COLS), np.float32)
    rstd2 = client.host_array(ROWS, np.float32)
    client.enqueue("RMSNORM_FWD", ROWS, COLS, x=x, y=y, rstd=rstd, stream=11)
    client.enqueue("RMSNORM_FWD", ROWS, COLS, x=x, y=y2, rstd=rstd2, stream=12)
    client.stream_wait(11)
    client.stream_wait(12)
    ref_y, _, _ = ref_forward(True, values, None, None)
    assert_close("y key 11", y.astype(np.float64), ref_y, "f32")
    assert_close("y key 12", y2.astype(np.float64), ref_y, "f32")


def test_check_and_wait_with_nothing_enqueued(client):
    client.check()
    client.check(timeout_ms=0)
    client.stream_wait(0)
    client.stream_wait(12345, timeout_ms=0)


def test_local_errors_raise_at_once(client, rms_job):
    """What the library can judge raises NormdError from enqueue() and queues nothing."""
    _, x, y, rstd = rms_job
    with pytest.raises(NormdError) as info:
        client.enqueue(99, ROWS, COLS, x=x, y=y, rstd=rstd, dtype="f32")
    assert info.value.status == "INVALID_ARGUMENT" and info.value.message
    with pytest.raises(NormdError) as info:
        client.enqueue("RMSNORM_FWD", ROWS, COLS, x=NcTensor(987654, 0), y=y, rstd=rstd,
                       dtype="f32")
    assert info.value.status in ("NOT_FOUND", "INVALID_ARGUMENT"), str(info.value)
    with pytest.raises(NormdError) as info:
        client.enqueue("RMSNORM_FWD", ROWS, COLS, x=(client.region_of(x), 1 << 40), y=y,
                       rstd=rstd, dtype="f32")
    assert info.value.status in ("OUT_OF_RANGE", "INVALID_ARGUMENT"), str(info.value)
    tokens, n_in, n_out = 4, 8, 6
    wx = client.host_array((tokens, n_in), "bf16")
    wdy = client.host_array((tokens, n_out), "bf16")
    main_grad = client.host_array((n_out, n_in), np.float32)
    with pytest.raises(NormdError) as info:
        client.enqueue("WGRAD_ACCUM", tokens, n_in, out_features=n_out, x=wx, dy=wdy,
                       main_grad=main_grad)
    assert info.value.status == "UNSUPPORTED", str(info.value)
    # Nothing was queued and nothing is pending: the next job runs.
    client.check()
    client.enqueue("RMSNORM_FWD", ROWS, COLS, x=x, y=y, rstd=rstd)
    client.stream_wait(0)


def test_daemon_error_comes_back_later():
    """A job the daemon refuses (max_cols) poisons its outputs; the error comes back once."""
    daemon = Daemon("--max-cols", "64")
    try:
        with normd.Client(daemon.socket, name="pytest-enqueue") as c:
            x = c.host_copy(np.ones((2, 128), np.float32))
            y = c.host_array((2, 128), np.float32)
            rstd = c.host_array(2, np.float32)
            c.enqueue("RMSNORM_FWD", 2, 128, x=x, y=y, rstd=rstd)   # accepted by the library
            with pytest.raises(NormdError) as info:
                c.stream_wait(0)
            assert info.value.status == "OUT_OF_RANGE", str(info.value)
            assert "max_cols" in info.value.message
            assert np.isnan(y).all(), "the refused job's output is not poisoned"
            c.check()                                    # reported once
            ok_x = c.host_copy(np.ones((2, 64), np.float32))
            ok_y = c.host_array((2, 64), np.float32)
            c.enqueue("RMSNORM_FWD", 2, 64, x=ok_x, y=ok_y, rstd=rstd)
            c.stream_wait(0)
            assert np.allclose(ok_y, 1.0, atol=1e-4)
            # An error pending when enqueue() looks for replies comes back from
            # it (it looks once a millisecond or 32 requests).
            c.enqueue("RMSNORM_FWD", 2, 128, x=x, y=y, rstd=rstd, stream=5)
            with pytest.raises(NormdError) as info:
                for _ in range(400):
                    time.sleep(0.005)
                    c.enqueue("RMSNORM_FWD", 2, 64, x=ok_x, y=ok_y, rstd=rstd, stream=5)
            assert info.value.status == "OUT_OF_RANGE", str(info.value)
            c.stream_wait(5)
            c.check()
    finally:
        daemon.stop()
        daemon.cleanup()


def test_daemon_death_is_disconnected():
    daemon = Daemon("--cpu-workers", "1", "--cpu-threads", "1")
    try:
        with normd.Client(daemon.socket, name="pytest-enqueue") as c:
            rows, cols = 256, 4096
            x = c.host_copy(np.ones((rows, cols), np.float32))
            y = c.host_array((rows, cols), np.float32)
            rstd = c.host_array(rows, np.float32)
            for _ in range(20):
                c.enqueue("RMSNORM_FWD", rows, cols, x=x, y=y, rstd=rstd)
            os.kill(daemon.proc.pid, signal.SIGKILL)
            with pytest.raises(NormdError) as info:
                c.stream_wait(0, timeout_ms=5000)
            assert info.value.status == "DISCONNECTED", str(info.value)
            assert info.value.code == -103
            with pytest.raises(NormdError) as info:
                c.enqueue("RMSNORM_FWD", rows, cols, x=x, y=y, rstd=rstd)
            assert info.value.status == "DISCONNECTED", str(info.value)
    finally:
        daemon.stop()
        daemon.cleanup()


# ---- the completion mode of normd.normalization ------------------------------------------


@pytest.fixture
def mode_env(monkeypatch):
    """A clean setting: no NORMD_COMPLETION, no package-level choice (restored after)."""
    monkeypatch.delenv("NORMD_COMPLETION", raising=False)
    old = normd.set_completion_mode(None)
    yield monkeypatch
    normd.set_completion_mode(old)


def test_completion_mode_default_is_enqueue(mode_env):
    assert normd.completion_mode() == "enqueue"
    assert normd.COMPLETION_MODES == ("enqueue", "sync", "event")


@pytest.mark.parametrize("value,mode", [("sync", "sync"), (" Event ", "event"),
                                        ("enqueue", "enqueue"), ("", "enqueue")])
def test_completion_mode_from_environment(mode_env, value, mode):
    mode_env.setenv("NORMD_COMPLETION", value)
    assert normd.completion_mode() == mode


def test_completion_mode_bad_environment(mode_env):
    mode_env.setenv("NORMD_COMPLETION", "async")
    with pytest.raises(ValueError, match="NORMD_COMPLETION='async'.*enqueue, sync, event"):
        normd.completion_mode()


def test_set_completion_mode_overrides_environment(mode_env):
    mode_env.setenv("NORMD_COMPLETION", "event")
    assert normd.set_completion_mode("SYNC") is None
    assert normd.completion_mode() == "sync"
    assert normd.set_completion_mode(None) == "sync"
    assert normd.completion_mode() == "event"
    with pytest.raises(ValueError):
        normd.set_completion_mode("later")
    assert normd.completion_mode() == "event"
