"""Failures become NormdError with the right status, code and message.

Daemon refusals are provoked with raw NcTensor values (which the binding
passes through unchecked) or impossible job fields; the binding's own
checks on numpy arrays are tested separately. After every refusal the
connection still works.
"""

import os
import socket

import numpy as np
import pytest

import normd
from normd import NcTensor, NormdError

ROWS, COLS = 4, 16


@pytest.fixture
def arrays(client, rng):
    """x, y, rstd for a small RMSNorm forward that succeeds."""
    x = client.host_copy(rng.normal(0, 1, (ROWS, COLS)).astype(np.float32))
    return x, client.host_array((ROWS, COLS), np.float32), client.host_array(ROWS, np.float32)


def refused(client, status, fragment, *args, **kwargs):
    """Runs a job that must fail with `status`; checks the error and that the client still works."""
    with pytest.raises(NormdError) as info:
        client.run(*args, **kwargs)
    err = info.value
    assert err.status == status, str(err)
    assert err.code == normd._lib.STATUS_CODES[status]
    assert fragment in err.message, err.message
    assert str(err) == "%s: %s" % (status, err.message)
    assert isinstance(err, RuntimeError)
    client.ping()
    return err


def test_bad_op(client, arrays):
    x, y, _ = arrays
    refused(client, "INVALID_ARGUMENT", "op 99 is not a known operation", 99, ROWS, COLS,
            x=x, y=y)


def test_unknown_op_name(client, arrays):
    x, y, _ = arrays
    with pytest.raises(ValueError, match="unknown op"):
        client.run("LAYERNORM_SIDEWAYS", ROWS, COLS, x=x, y=y)


def test_unregistered_region(client, arrays):
    _, y, _ = arrays
    refused(client, "NOT_FOUND", "region 9999 is not registered on this connection",
            "LAYERNORM_FWD", ROWS, COLS, dtype="f32", x=NcTensor(9999, 0), y=y)


def test_out_of_range_offset(client, arrays):
    x, y, _ = arrays
    region = client.region_of(x)
    refused(client, "OUT_OF_RANGE", "runs past region", "LAYERNORM_FWD", ROWS, COLS,
            dtype="f32", x=region.tensor(region.size - 4), y=y)
    refused(client, "OUT_OF_RANGE", "runs past region", "LAYERNORM_FWD", ROWS, COLS,
            dtype="f32", x=region.tensor(2 ** 63), y=y)


def test_rows_zero(client, arrays):
    x, y, _ = arrays
    refused(client, "INVALID_ARGUMENT", "rows must be at least 1", "LAYERNORM_FWD", 0, COLS,
            x=x, y=y)


def test_bad_eps(client, arrays):
    x, y, _ = arrays
    refused(client, "INVALID_ARGUMENT", "eps must be positive and finite", "LAYERNORM_FWD",
            ROWS, COLS, eps=-1.0, x=x, y=y)


def test_stray_tensor(client, arrays):
    """RMSNorm has no mean: naming one is refused, so typos are caught."""
    x, y, rstd = arrays
    refused(client, "INVALID_ARGUMENT", "tensor mean is not used by RMSNORM_FWD", "RMSNORM_FWD",
            ROWS, COLS, x=x, y=y, rstd=rstd, mean=client.host_array(ROWS, np.float32))


def test_missing_tensor(client, arrays):
    x, _, _ = arrays
    refused(client, "INVALID_ARGUMENT", "needs tensor y", "RMSNORM_FWD", ROWS, COLS, x=x)


def test_memory_efficient_forward(client, arrays):
    x, y, _ = arrays
    refused(client, "INVALID_ARGUMENT", "apply to backward ops", "LAYERNORM_FWD", ROWS, COLS,
            memory_efficient=True, x=x, y=y)


def test_unsupported_weight_dtype(client, rng):
    """bf16 data with fp16 weights: weights must match or be fp32."""
    x = client.host_copy(rng.normal(0, 1, (ROWS, COLS)), "bf16")
    y = client.host_array((ROWS, COLS), "bf16")
    g = client.host_copy(np.ones(COLS, np.float16))
    refused(client, "UNSUPPORTED", "weights must match dtype or be f32", "RMSNORM_FWD", ROWS,
            COLS, x=x, y=y, gamma=g)


# ---- checks made by the binding before anything is sent ---------------------------------


def test_array_outside_regions(client, arrays):
    _, y, _ = arrays
    with pytest.raises(NormdError) as info:
        client.run("LAYERNORM_FWD", ROWS, COLS, x=np.zeros((ROWS, COLS), np.float32), y=y)
    assert info.value.status == "NOT_FOUND"
    assert "not inside a host region" in info.value.message


def test_wrong_dtype_array(client, arrays):
    x, _, _ = arrays
    with pytest.raises(TypeError, match="tensor y is F16 but the job needs F32"):
        client.run("LAYERNORM_FWD", ROWS, COLS, x=x, y=client.host_array((ROWS, COLS), np.float16))


def test_short_array(client, arrays):
    x, _, _ = arrays
    with pytest.raises(ValueError, match="tensor y holds 64 bytes"):
        client.run("LAYERNORM_FWD", ROWS, COLS, x=x, y=client.host_array(COLS, np.float32))


def test_non_contiguous_array(client, rng):
    x = client.host_copy(rng.normal(0, 1, (COLS, ROWS)).astype(np.float32))
    y = client.host_array((ROWS, COLS), np.float32)
    with pytest.raises(ValueError, match="must be contiguous"):
        client.run("LAYERNORM_FWD", ROWS, COLS, x=x.T, y=y)


def test_unknown_role(client, arrays):
    x, y, _ = arrays
    with pytest.raises(TypeError, match="unknown tensor role"):
        client.run("LAYERNORM_FWD", ROWS, COLS, x=x, y=y, gama=x)


def test_unsupported_dtype_name(client):
    with pytest.raises(TypeError, match="float32, float16 and bfloat16"):
        client.host_array(4, np.float64)


def test_device_pointer_without_gpu(client, arrays):
    """On a host without the CUDA driver (or for host memory) registration is refused."""
    x, _, _ = arrays
    with pytest.raises(NormdError) as info:
        client.device_tensor(x.ctypes.data)
    assert info.value.status in ("INVALID_ARGUMENT", "UNSUPPORTED")
    assert "pointer" in info.value.message


# ---- the connection ---------------------------------------------------------------------


def test_connect_failure(tmp_path):
    with pytest.raises(NormdError) as info:
        normd.Client(str(tmp_path / "no-daemon.sock"), timeout_ms=2000)
    assert info.value.status == "IO"
    assert "no-daemon.sock" in info.value.message
    assert "is normd running on that socket?" in info.value.message


def test_connect_socket_from_environment(tmp_path, monkeypatch):
    """No socket given: $NORMD_SOCKET, and the error says that is where it came from."""
    path = str(tmp_path / "env.sock")
    monkeypatch.setenv("NORMD_SOCKET", path)
    with pytest.raises(NormdError) as info:
        normd.Client(timeout_ms=2000)
    assert info.value.status == "IO"
    assert info.value.message == ("cannot connect to normd at %s: No such file or directory -- "
                                  "is normd running on that socket? (the socket named by "
                                  "$NORMD_SOCKET)" % path)


def test_connect_default_socket(monkeypatch):
    """Neither a socket nor $NORMD_SOCKET (nor an empty one): /run/normd/0.sock, as normctl."""
    if os.path.exists(normd.DEFAULT_SOCKET):
        pytest.skip("a daemon may serve %s on this host" % normd.DEFAULT_SOCKET)
    for value in (None, ""):
        if value is None:
            monkeypatch.delenv("NORMD_SOCKET", raising=False)
        else:
            monkeypatch.setenv("NORMD_SOCKET", value)
        with pytest.raises(NormdError) as info:
            normd.Client(timeout_ms=2000)
        assert info.value.status == "IO"
        assert "at /run/normd/0.sock:" in info.value.message
        assert "the default socket; set $NORMD_SOCKET" in info.value.message


def test_connect_socket_that_never_answers(tmp_path):
    """A socket that accepts but never answers Hello: TIMEOUT, naming the socket."""
    path = str(tmp_path / "silent.sock")
    with socket.socket(socket.AF_UNIX) as silent:
        silent.bind(path)
        silent.listen()
        with pytest.raises(NormdError) as info:
            normd.Client(path, timeout_ms=200)
    assert info.value.status == "TIMEOUT"
    assert info.value.message.startswith("normd at %s: " % path)
    assert "is normd running on that socket?" in info.value.message


def test_status_names_match_library():
    for name, code in normd._lib.STATUS_CODES.items():
        assert normd.status_name(code) == name
    assert normd.status_name(-55) == "UNKNOWN"
    assert NormdError(-3, "").message == "not found"
