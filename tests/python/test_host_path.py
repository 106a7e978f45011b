"""The per-call host path of normd.normalization's enqueue mode, without a GPU.

What runs here: nc_job_enqueue_device through the binding
(Client._enqueue_device) on a CPU-backend daemon, with a host-region job and
no pointers, and its refusals; what the normalization layer hands it for
CUDA tensors (job fields and device pointers in role order, checked on CPU
tensors that pass for CUDA ones, with a client that records the call); and
the caches of the path (jobs by shape, normalized shapes, the
NORMD_COMPLETION variable), each giving a fresh answer when its input
changes. The allocation cache behind the pointers lives in the library and
is tested on the GPU (tests/gpu/test_enqueue.c, tests/gpu/test_python.py).
"""

import struct

import numpy as np
import pytest
from test_ops import assert_close, ref_forward

import normd
from normd import NormdError, _lib
from normd.client import _NORM_JOBS_MAX, _norm_jobs, norm_job

ROWS, COLS = 6, 96
NO_POINTERS = _lib.pack_device_pointers(*[0] * _lib.JOB_TENSORS)


@pytest.fixture
def rms_arrays(client, rng):
    """(x values, x, y, rstd) host arrays of an RMSNORM_FWD job."""
    values = rng.normal(0, 2, (ROWS, COLS)).astype(np.float32)
    return (values.astype(np.float64), client.host_copy(values),
            client.host_array((ROWS, COLS), np.float32), client.host_array(ROWS, np.float32))


# ---- nc_job_enqueue_device through the binding ------------------------------------------


def test_enqueue_device_without_pointers_runs_the_job(client, rms_arrays):
    values, x, y, rstd = rms_arrays
    job, _ = client.make_job("RMSNORM_FWD", ROWS, COLS, x=x, y=y, rstd=rstd)
    client._enqueue_device(job, NO_POINTERS, 3)
    client.stream_wait(3)
    ref_y, _, ref_rstd = ref_forward(True, values, None, None)
    assert_close("y", y.astype(np.float64), ref_y, "f32")
    assert_close("rstd", rstd.astype(np.float64), ref_rstd, "f32")


def test_enqueue_device_names_the_tensor_it_cannot_resolve(client, rms_arrays):
    _, x, y, rstd = rms_arrays
    job, _ = client.make_job("RMSNORM_FWD", ROWS, COLS, x=x, y=y, rstd=rstd)
    host_address = x.__array_interface__["data"][0]
    ptrs = _lib.pack_device_pointers(0, 0, 0, 0, host_address, 0, 0, 0, 0, 0, 0)
    with pytest.raises(NormdError) as err:
        client._enqueue_device(job, ptrs, 3)
    assert err.value.status == "INVALID_ARGUMENT", err.value
    assert err.value.message.startswith("tensor gamma: "), err.value.message
    assert "expandable_segments" not in err.value.message  # the hint is for UNSUPPORTED only
    client.check(1000)  # nothing was queued


def test_enqueue_device_on_a_closed_client(daemon):
    c = normd.Client(daemon.socket, name="pytest-closed")
    c.close()
    with pytest.raises(NormdError, match="closed") as err:
        c._enqueue_device(norm_job(3, 1, 1, 0.0, 1, 0, 0), NO_POINTERS, 0)
    assert err.value.status == "INVALID_ARGUMENT"


def test_pointer_layout_is_the_c_array():
    ptrs = _lib.pack_device_pointers(*range(1, _lib.JOB_TENSORS + 1))
    assert len(ptrs) == _lib.JOB_TENSORS * struct.calcsize("P")
    assert struct.unpack("@%dP" % _lib.JOB_TENSORS, ptrs) == tuple(range(1, 12))


# ---- jobs by shape ------------------------------------------------------------------------


def test_norm_job_is_shared_per_shape_and_new_per_change():
    key = (int(normd.Op.LAYERNORM_FWD), 8, 1024, 1e-5, int(normd.DType.BF16), 0, 0)
    job = norm_job(*key)
    assert norm_job(*key) is job
    assert (job.op, job.rows, job.cols, job.dtype, job.weight_dtype, job.flags) == \
        (1, 8, 1024, 3, 0, 0)
    assert job.eps == pytest.approx(1e-5)
    assert job.x.region == job.gamma.region == job.main_grad.region == 0  # no tensors
    changes = [(2, 8, 1024, 1e-5, 3, 0, 1), (1, 9, 1024, 1e-5, 3, 0, 0),
               (1, 8, 512, 1e-5, 3, 0, 0), (1, 8, 1024, 1e-6, 3, 0, 0),
               (1, 8, 1024, 1e-5, 1, 0, 0), (1, 8, 1024, 1e-5, 3, 1, 0)]
    for other in changes:
        made = norm_job(*other)
        assert made is not job
        assert (made.op, made.rows, made.cols, made.dtype, made.weight_dtype, made.flags) == \
            (other[0], other[1], other[2], other[4], other[5], other[6])
        assert made.eps == pytest.approx(other[3])


def test_norm_job_cache_stays_bounded():
    for rows in range(1, 2 * _NORM_JOBS_MAX + 2):
        assert norm_job(3, rows, 64, 0.0, 1, 0, 0).rows == rows
    assert 0 < len(_norm_jobs) <= _NORM_JOBS_MAX


# ---- NORMD_COMPLETION, read at each call --------------------------------------------------


@pytest.fixture
def mode_env(monkeypatch):
    monkeypatch.delenv("NORMD_COMPLETION", raising=False)
    old = normd.set_completion_mode(None)
    yield monkeypatch
    normd.set_completion_mode(old)


def test_completion_mode_follows_every_change_of_the_variable(mode_env):
    for value, mode in [("sync", "sync"), ("sync", "sync"), ("event", "event"),
                        ("", "enqueue"), ("sync", "sync")]:
        mode_env.setenv("NORMD_COMPLETION", value)
        assert normd.completion_mode() == mode
        assert normd.completion_mode() == mode  # the remembered answer
    mode_env.delenv("NORMD_COMPLETION")
    assert normd.completion_mode() == "enqueue"
    mode_env.setenv("NORMD_COMPLETION", "later")
    for _ in range(2):  # a bad value is never remembered
        with pytest.raises(ValueError, match="NORMD_COMPLETION"):
            normd.completion_mode()
    mode_env.setenv("NORMD_COMPLETION", "event")
    assert normd.completion_mode() == "event"


# ---- what normalization hands the library for CUDA tensors ---------------------------------


class RecordingClient:
    """Stands for a Client: records _enqueue_device's arguments."""

    def __init__(self):
        self.calls = []

    def _enqueue_device(self, job, ptrs, stream):
        self.calls.append((job, struct.unpack("@%dP" % _lib.JOB_TENSORS, ptrs), stream))


@pytest.fixture
def as_cuda(monkeypatch, mode_env):
    """CPU tensors pass for CUDA tensors; the stream and capture queries are constants."""
    torch = pytest.importorskip("torch")
    import importlib

    fln = importlib.import_module("normd.normalization.fused_layer_norm")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(fln, "_capturing", lambda: False)
    monkeypatch.setattr(fln, "_raw_stream", lambda index: 0x5EED)
    # The Python path, whose library call the stand-in client records.
    monkeypatch.setattr(fln, "_eager_op", False)
    return torch, fln


def _ptr(t):
    return 0 if t is None else t.data_ptr()


@pytest.mark.parametrize("rms", [False, True])
def test_forward_and_backward_jobs_name_the_right_tensors(as_cuda, rms):
    torch, fln = as_cuda
    client = RecordingClient()
    x = torch.randn(3, 4, 16, dtype=torch.bfloat16)
    w = torch.randn(4, 16, dtype=torch.float32)  # float32 weights: the mixed kernels
    b = None if rms else torch.randn(4, 16, dtype=torch.float32)
    y, mean, invvar, upcast, wdt, xc, wc, bc = fln._forward(client, rms, x, w, b, (4, 16),
                                                            1e-5, False)
    assert not upcast and wdt == normd.DType.F32
    (job, ptrs, stream), = client.calls
    op = normd.Op.RMSNORM_FWD if rms else normd.Op.LAYERNORM_FWD
    assert (job.op, job.rows, job.cols, job.dtype, job.weight_dtype, job.flags) == \
        (op, 3, 64, normd.DType.BF16, normd.DType.F32, 0)
    assert stream == 0x5EED
    assert ptrs == (x.data_ptr(), y.data_ptr(), _ptr(mean), invvar.data_ptr(), w.data_ptr(),
                    _ptr(b), 0, 0, 0, 0, 0)

    class Ctx:
        normalized_shape, eps, memory_efficient, upcast = (4, 16), 1e-5, True, False
        weight_dtype, input_dtype = wdt, torch.bfloat16
        needs_weight_grad, needs_bias_grad = True, not rms

    ctx = Ctx()
    ctx.client = client
    dy = torch.randn(3, 4, 16, dtype=torch.bfloat16)
    dx, dgamma, dbeta = fln._backward(ctx, rms, dy, y, wc, bc, None, invvar)
    job, ptrs, _ = client.calls[1]
    op = normd.Op.RMSNORM_BWD if rms else normd.Op.LAYERNORM_BWD
    assert (job.op, job.rows, job.cols, job.flags) == (op, 3, 64, normd.MEMORY_EFFICIENT)
    assert ptrs == (y.data_ptr(), 0, 0, invvar.data_ptr(), wc.data_ptr(), _ptr(bc),
                    dy.data_ptr(), dx.data_ptr(), dgamma.data_ptr(), _ptr(dbeta), 0)


def test_a_new_storage_is_a_new_pointer(as_cuda):
    """Nothing about a tensor's memory is remembered between calls."""
    torch, fln = as_cuda
    client = RecordingClient()
    x = torch.randn(2, 8)
    fln._forward(client, True, x, None, None, (8,), 1e-5, False)
    x.data = torch.randn(2, 8)  # the same tensor object, another storage
    fln._forward(client, True, x, None, None, (8,), 1e-5, False)
    assert client.calls[1][1][0] == x.data_ptr() != client.calls[0][1][0]


# ---- normalized shapes ---------------------------------------------------------------------


def test_normalized_shape_cache(as_cuda):
    torch, fln = as_cuda
    for given, want in [(torch.Size([4, 8]), (4, 8)), ((np.int64(3),), (3,)), ([2, 5], (2, 5)),
                        (7, (7,)), ((True, 2), (1, 2))]:
        for _ in range(2):  # computed, then remembered
            got = fln._cached_normalized_shape(given)
            assert got == want and type(got) is tuple
            assert all(type(d) is int for d in got), given
    for n in range(1, 2 * fln._SHAPES_MAX + 2):
        assert fln._cached_normalized_shape((n,)) == (n,)
    assert 0 < len(fln._shapes) <= fln._SHAPES_MAX


def test_backward_ops_refuse_inputs_that_do_not_fit(client):
    """Called directly, the backward ops check what the autograd Functions' forward made."""
    torch = pytest.importorskip("torch")
    import normd.normalization  # noqa: F401  (defines the ops)
    from normd.normalization import custom_ops

    if not custom_ops.AVAILABLE:
        pytest.skip("this torch has no torch.library.custom_op")
    saved = torch.randn(4, 32)
    good = dict(grad_output=torch.randn(4, 32), invvar=torch.rand(4), weight=torch.ones(32))
    cases = [(dict(grad_output=torch.randn(3, 32)), ValueError, "grad_output holds 96"),
             (dict(invvar=torch.rand(4).half()), TypeError, "invvar is torch.float16"),
             (dict(invvar=torch.rand(2)), ValueError, "invvar holds 2"),
             (dict(weight=torch.ones(16)), ValueError, "weight holds 16")]
    for change, error, message in cases:
        args = dict(good, **change)
        with pytest.raises(error, match=message):
            torch.ops.normd.rms_norm_bwd(args["grad_output"], saved, args["weight"],
                                         args["invvar"], [32], 1e-5, False, False,
                                         torch.float32, True, client._key)
