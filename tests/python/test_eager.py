"""The compiled eager operator (normd.eager), without a GPU.

What runs here: normd's operator built from bindings/python/normd/csrc
against the installed torch, bound to a C recorder instead of
nc_job_enqueue_device, on CPU tensors that pass for CUDA ones. Each call
is made twice, through the operator and through the package's Python path
(whose jobs the GPU tests check against float64), and the two must hand
the library the same jobs: the same fields, and pointers that name the same
tensors (the caller's input, parameters, output, gradients, or the same
temporaries between forward and backward). Then the operator's errors:
the library's refusals as NormdError, what it leaves to the Python path,
a client closed before backward, a second derivative.

Skipped without torch or a C++ compiler. The GPU side (the current stream,
real jobs) is tests/gpu/test_python.py (the operator is on by default).
"""

import ctypes
import gc
import importlib
import os
import shutil
import struct
import subprocess
import weakref

import pytest

import normd
from normd import NormdError, _lib

torch = pytest.importorskip("torch")
if not shutil.which(os.environ.get("CXX") or "c++"):
    pytest.skip("no C++ compiler to build the operator", allow_module_level=True)

from normd import eager  # noqa: E402
from normd import normalization as N  # noqa: E402
from normd.client import _EXPANDABLE_HINT  # noqa: E402

fln = importlib.import_module("normd.normalization.fused_layer_norm")

RECORDER = r"""
#include <string.h>
#include "normclient.h"
#define MAX 64
static struct nc_job jobs[MAX];
static const void *ptrs[MAX][NC_JOB_ALL_TENSORS];
static float offsets[MAX];
static void *streams[MAX];
static nc_conn *conns[MAX];
static int count, fail_rc;
static unsigned fail_ops;
static char message[256];
int rec_enqueue(nc_conn *conn, const struct nc_job *job, const void *const p[NC_JOB_TENSORS],
		void *stream)
{
	if (fail_rc && (fail_ops & (1u << job->op)))
		return fail_rc;
	if (count < MAX) {
		jobs[count] = *job;
		memset(ptrs[count], 0, sizeof(ptrs[0]));
		memcpy(ptrs[count], p, NC_JOB_TENSORS * sizeof(*p));
		offsets[count] = 0;
		streams[count] = stream;
		conns[count] = conn;
	}
	count++;
	return 0;
}
int rec_enqueue_ext(nc_conn *conn, const struct nc_job *job, const struct nc_job_ext *ext,
		    const void *const p[NC_JOB_ALL_TENSORS], void *stream)
{
	int rc = rec_enqueue(conn, job, p, stream);
	if (rc == 0 && count <= MAX) {
		memcpy(ptrs[count - 1], p, sizeof(ptrs[0]));
		offsets[count - 1] = ext->weight_offset;
	}
	return rc;
}
float rec_offset(int i) { return offsets[i]; }
const char *rec_last_error(void) { return message; }
void rec_fail(int rc, unsigned ops, const char *why)
{
	fail_rc = rc;
	fail_ops = ops;
	strncpy(message, why, sizeof(message) - 1);
}
void rec_reset(void) { count = 0; fail_rc = 0; }
int rec_count(void) { return count; }
const struct nc_job *rec_job(int i) { return &jobs[i]; }
const void *const *rec_ptrs(int i) { return ptrs[i]; }
void *rec_stream(int i) { return streams[i]; }
void *rec_conn(int i) { return conns[i]; }
"""


@pytest.fixture(scope="module")
def recorder(tmp_path_factory):
    """The recorder library (ctypes), compiled here."""
    folder = tmp_path_factory.mktemp("eager")
    src, lib = folder / "recorder.c", folder / "librecorder.so"
    src.write_text(RECORDER)
    header_dir = eager._header_dir()
    subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-I" + str(header_dir), "-o", str(lib),
                    str(src)], check=True)
    rec = ctypes.CDLL(str(lib))
    rec.rec_job.restype = ctypes.POINTER(_lib.NcJob)
    rec.rec_ptrs.restype = ctypes.POINTER(ctypes.c_void_p)
    rec.rec_stream.restype = ctypes.c_void_p
    rec.rec_conn.restype = ctypes.c_void_p
    rec.rec_fail.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_char_p]
    rec.rec_offset.restype = ctypes.c_float
    return rec


def _bind_recorder(recorder, host_tensors):
    """The operator's library calls go to the recorder; host tensors pass where asked."""
    torch.ops.normd_eager.bind(eager._address(recorder.rec_enqueue),
                               eager._address(recorder.rec_last_error),
                               eager._address(_lib.load().nc_status_name), host_tensors)
    torch.ops.normd_eager.bind_variants(eager._address(recorder.rec_enqueue_ext))


@pytest.fixture(scope="module")
def operator(recorder):
    """torch.ops.normd_eager, built for this torch and bound to the recorder."""
    torch.ops.load_library(str(eager.build()))
    _bind_recorder(recorder, True)
    yield torch.ops.normd_eager.norm.default._op
    lib = _lib.load()
    torch.ops.normd_eager.bind(eager._address(lib.nc_job_enqueue_device),
                               eager._address(lib.nc_last_error),
                               eager._address(lib.nc_status_name), False)
    torch.ops.normd_eager.bind_variants(eager._address(lib.nc_job_enqueue_device_ext))


def _as_cuda(client, monkeypatch):
    """CPU tensors pass for CUDA ones in the enqueue mode; returns the list the
    Python path's library calls (client._enqueue_device) are recorded in."""
    monkeypatch.delenv("NORMD_COMPLETION", raising=False)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(fln, "_capturing", lambda: False)
    monkeypatch.setattr(fln, "_raw_stream", lambda index: 0)  # the operator's host "stream"
    python_calls = []
    monkeypatch.setattr(client, "_enqueue_device", lambda job, ptrs, stream: python_calls.append(
        (_job_fields(job), _unpack(ptrs), stream)))
    return python_calls


def _jobs_of(call, client, recorder, python_calls):
    """(the call's jobs by name, how many went to the recorder, how many through Python)."""
    recorder.rec_reset()
    python_calls.clear()
    named = call(client)
    ours = [(_job_fields(recorder.rec_job(i).contents),
             tuple(recorder.rec_ptrs(i)[k] or 0 for k in range(_lib.JOB_TENSORS)),
             recorder.rec_stream(i) or 0) for i in range(recorder.rec_count())]
    # Each call goes one way: the recorder's jobs, then the Python path's, is the order.
    return _symbolic(ours + python_calls, named), len(ours), len(python_calls)


@pytest.fixture
def paths(operator, recorder, client, monkeypatch):
    """run(use_operator, call): the call's jobs, and how many each path sent.

    call(client) makes the call and returns a function giving its named
    tensors (for the pointers' names); the functional forms use `client`
    as the default client.
    """
    python_calls = _as_cuda(client, monkeypatch)
    old_mode = normd.set_completion_mode(None)
    normd.set_default_client(client)

    def run(use_operator, call):
        monkeypatch.setattr(fln, "_eager_op", operator if use_operator else False)
        return _jobs_of(call, client, recorder, python_calls)

    yield run
    normd.set_default_client(None)
    normd.set_completion_mode(old_mode)


def _unpack(ptrs):
    return struct.unpack("@%dP" % _lib.JOB_TENSORS, ptrs)


def _job_fields(job):
    return (int(job.op), job.rows, job.cols, round(job.eps, 9), int(job.dtype),
            int(job.weight_dtype), job.flags)


#: The caller's tensors a job role may name. Only these: the allocator may hand
#: a temporary's freed address to a gradient made later (input.grad over a
#: non-contiguous input's copy), which must not make the temporary "input.grad".
_ROLE_NAMES = {"x": ("input", "output"), "y": ("output",), "gamma": ("weight",),
               "beta": ("bias",), "dy": ("dy",), "dx": ("input.grad",),
               "dgamma": ("weight.grad",), "dbeta": ("bias.grad",)}


def _symbolic(jobs, named, all_roles=_lib.TENSOR_ROLES, role_names=_ROLE_NAMES):
    """Jobs with each pointer replaced by the name of the tensor it is, or its first use."""
    tensors = named()
    seen = {}
    out = []
    for i, (fields, ptrs, stream) in enumerate(jobs):
        roles = []
        for role, p in zip(all_roles, ptrs):
            names = [n for n in role_names.get(role, ())
                     if tensors.get(n) is not None and tensors[n].data_ptr() == p]
            if not p:
                roles.append(None)
            elif names:
                roles.append(names[0])
            else:
                roles.append(seen.setdefault(p, "job%d.%s" % (i, role)))
        out.append((fields, tuple(roles), stream))
    return out


def _fwd_bwd(module_factory, x_factory, backward=True):
    """A call: a module on a fresh input, forward and (optionally) backward."""

    def call(client):
        torch.manual_seed(7)
        module = module_factory()
        module.client = client
        x = x_factory().requires_grad_()
        y = module(x)
        dy = torch.randn_like(y)
        if backward:
            y.backward(dy)
        params = dict(module.named_parameters())
        w, b = params.get("weight"), params.get("bias")
        return lambda: {"input": x, "weight": w, "bias": b, "output": y, "dy": dy,
                        "input.grad": x.grad, "weight.grad": None if w is None else w.grad,
                        "bias.grad": None if b is None else b.grad}

    return call


CASES = {
    "layernorm bf16": (lambda: N.FusedLayerNorm(64).to(torch.bfloat16),
                       lambda: torch.randn(8, 64, dtype=torch.bfloat16)),
    "rmsnorm bf16": (lambda: N.FusedRMSNorm(64).to(torch.bfloat16),
                     lambda: torch.randn(8, 64, dtype=torch.bfloat16)),
    "layernorm f32 no affine": (lambda: N.FusedLayerNorm(32, elementwise_affine=False),
                                lambda: torch.randn(5, 32)),
    "rmsnorm f16 no affine": (lambda: N.FusedRMSNorm(32, elementwise_affine=False).half(),
                              lambda: torch.randn(5, 32).half()),
    "layernorm f32 weights, bf16 input": (lambda: N.FusedLayerNorm(64),
                                          lambda: torch.randn(4, 64, dtype=torch.bfloat16)),
    "layernorm memory_efficient": (lambda: N.FusedLayerNorm(64, memory_efficient=True),
                                   lambda: torch.randn(6, 64)),
    "rmsnorm memory_efficient f16": (
        lambda: N.FusedRMSNorm(64, memory_efficient=True).half(),
        lambda: torch.randn(6, 64).half()),
    "layernorm 2-d normalized shape": (lambda: N.FusedLayerNorm((4, 16)),
                                       lambda: torch.randn(3, 4, 16)),
    "rmsnorm non-contiguous input": (lambda: N.FusedRMSNorm(24),
                                     lambda: torch.randn(24, 10).t()),
    "mixed layernorm (Python path on both)": (
        lambda: N.MixedFusedLayerNorm(64), lambda: torch.randn(4, 64, dtype=torch.bfloat16)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_operator_hands_the_library_what_the_python_path_does(paths, case):
    module_factory, x_factory = CASES[case]
    call = _fwd_bwd(module_factory, x_factory)
    (ours, by_operator, _), (python, _, by_python) = paths(True, call), paths(False, call)
    assert by_python == 2
    assert by_operator == (0 if case.startswith("mixed") else 2)
    assert ours == python
    (_, fwd_roles, _), (_, bwd_roles, _) = ours
    assert fwd_roles[1] == "output"
    # Else autograd lays the gradient out like the input, or the mixed form converts it.
    if "non-contiguous" not in case and not case.startswith("mixed"):
        assert bwd_roles[7] == "input.grad"


def test_a_parameter_without_grad_gets_no_gradient_job_tensor(paths):
    def factory():
        m = N.FusedLayerNorm(32)
        m.weight.requires_grad_(False)
        return m

    call = _fwd_bwd(factory, lambda: torch.randn(4, 32))
    ours = paths(True, call)[0]
    assert ours == paths(False, call)[0]
    assert ours[1][1][8] is None and ours[1][1][9] == "bias.grad"  # dgamma absent, dbeta there


def test_calls_the_operator_leaves_to_the_python_path_raise_its_errors(paths, client):
    def wrong_shape(c):
        N.fused_rms_norm(torch.randn(4, 32), (16,), 1e-5)

    with pytest.raises(RuntimeError, match=r"expected input with shape \[\*, 16\]"):
        paths(True, wrong_shape)

    def bias_of_another_dtype(c):
        N.fused_layer_norm_affine(torch.randn(4, 32), torch.ones(32), torch.zeros(32).double(),
                                  (32,), 1e-5)

    with pytest.raises(TypeError, match="bias must have the weight's dtype"):
        paths(True, bias_of_another_dtype)


def test_library_refusals_are_normd_errors(paths, recorder):
    unsupported = _lib.STATUS_CODES["UNSUPPORTED"]
    call = _fwd_bwd(lambda: N.FusedRMSNorm(32), lambda: torch.randn(4, 32), backward=False)
    recorder_fail = recorder.rec_fail

    def failing(message, ops):
        def run(c):
            recorder_fail(unsupported, ops, message)
            return call(c)
        return run

    with pytest.raises(NormdError) as e:
        paths(True, failing(b"tensor x: pointer 0x10 is not exportable", 1 << 3))
    assert e.value.status == "UNSUPPORTED" and e.value.message.endswith(_EXPANDABLE_HINT)
    with pytest.raises(NormdError) as e:
        paths(True, failing(b"the stream is capturing a CUDA graph, and ...", 1 << 3))
    assert e.value.message == fln._CAPTURE_MESSAGE
    # From backward (the autograd engine's thread): a RuntimeError naming the status.
    def failing_backward(c):
        m = N.FusedRMSNorm(32)
        m.client = c
        y = m(torch.randn(4, 32, requires_grad=True))
        recorder_fail(unsupported, 1 << 4, b"no backward")
        y.sum().backward()

    with pytest.raises(RuntimeError, match=r"normd error -\d+ \(UNSUPPORTED\): no backward"):
        paths(True, failing_backward)


def test_a_client_closed_between_forward_and_backward(operator, recorder, daemon, monkeypatch):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(fln, "_eager_op", operator)
    monkeypatch.delenv("NORMD_COMPLETION", raising=False)
    recorder.rec_reset()
    c = normd.Client(daemon.socket, name="eager-closed")
    m = N.FusedLayerNorm(16)
    m.client = c
    x = torch.randn(3, 16, requires_grad=True)
    y = m(x)
    assert recorder.rec_count() == 1
    c.close()
    with pytest.raises(RuntimeError, match="the client is closed"):
        y.sum().backward()
    with pytest.raises(NormdError, match="closed") as e:
        m(x)
    assert e.value.status == "INVALID_ARGUMENT"
    assert recorder.rec_count() == 1


@pytest.mark.parametrize("use_operator", [True, False])
def test_differentiable_once_as_on_the_python_path(paths, use_operator):
    def twice(c):
        m = N.FusedRMSNorm(16)
        m.client = c
        x = torch.randn(3, 16, requires_grad=True)
        # A graph through the gradient: first order works, the second raises.
        (g,) = torch.autograd.grad((m(x) ** 2).sum(), x, create_graph=True)
        assert g.requires_grad
        g.sum().backward()

    with pytest.raises(RuntimeError, match="differentiate twice a function"):
        paths(use_operator, twice)


# ---- the C++ kernels of the torch.library ops (what torch.compile calls) ------------------


@pytest.fixture
def ops_paths(operator, recorder, client, monkeypatch):
    """run(use_kernels, call): the jobs of a call through the ops' C++ kernels or their Python.

    The kernels learn a client's key from the Python implementation's first
    call, so a call through them is made twice and the second one counts.
    """
    yield from _kernels_paths(operator, recorder, client, monkeypatch,
                              _as_cuda(client, monkeypatch), _jobs_of)


def _kernels_paths(operator, recorder, client, monkeypatch, python_calls, jobs_of):
    """ops_paths' run(use_kernels, call) with its jobs from jobs_of, then its teardown."""
    from normd import client as client_module

    old_mode = normd.set_completion_mode(None)
    monkeypatch.setitem(eager._state, "op", operator)
    monkeypatch.setitem(eager._state, "tried", True)
    monkeypatch.setattr(client_module, "_eager_listener", eager._listener)

    def run(use_kernels, call):
        _bind_recorder(recorder, use_kernels)
        if use_kernels:
            call(client)  # the Python implementation tells the kernels the client's key
        return jobs_of(call, client, recorder, python_calls)

    yield run
    torch.ops.normd_eager.client_key(client._key, 0)
    _bind_recorder(recorder, True)
    normd.set_completion_mode(old_mode)


def _through_ops(rms, memory_efficient, weight_dtype=None, dtype=torch.float32):
    from normd.normalization import custom_ops

    def call(client):
        torch.manual_seed(5)
        x = torch.randn(6, 64).to(dtype).requires_grad_()
        w = torch.randn(64).to(weight_dtype or dtype).requires_grad_()
        b = None if rms else torch.randn(64).to(weight_dtype or dtype).requires_grad_()
        y = custom_ops.norm(rms, False, x, w, b, (64,), 1e-5, memory_efficient, client)
        dy = torch.randn_like(y)
        y.backward(dy)
        return lambda: {"input": x, "weight": w, "bias": b, "output": y, "dy": dy,
                        "input.grad": x.grad, "weight.grad": w.grad,
                        "bias.grad": None if b is None else b.grad}

    return call


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("memory_efficient", [False, True], ids=["", "memory_efficient"])
@pytest.mark.parametrize("weights", ["same", "float32"])
def test_the_ops_kernels_hand_the_library_what_their_python_does(ops_paths, rms,
                                                                 memory_efficient, weights):
    call = _through_ops(rms, memory_efficient, torch.float32 if weights == "float32" else None,
                        torch.bfloat16)
    ours, by_kernels, _ = ops_paths(True, call)
    python, _, by_python = ops_paths(False, call)
    assert (by_kernels, by_python) == (2, 2)
    assert ours == python


def test_the_ops_kernels_leave_other_modes_to_python(ops_paths, client, monkeypatch):
    ran = []
    monkeypatch.setattr(client, "run", lambda *a, **k: ran.append(a[0]))
    normd.set_completion_mode("sync")
    ops_paths(True, _through_ops(True, False))  # two calls: all four jobs through Python
    assert ran == [normd.Op.RMSNORM_FWD, normd.Op.RMSNORM_BWD] * 2
    ran.clear()
    normd.set_completion_mode(None)
    monkeypatch.setenv("NORMD_COMPLETION", " Event ")
    _, by_kernels, _ = ops_paths(True, _through_ops(False, False))
    assert by_kernels == 0 and len(ran) == 4
    monkeypatch.setenv("NORMD_COMPLETION", "ENQUEUE")
    _, by_kernels, _ = ops_paths(True, _through_ops(False, False))
    assert by_kernels == 2


def test_the_ops_kernels_follow_the_default_client(ops_paths, recorder, daemon, client):
    """Key 0 names whichever client is the default now, never one set aside."""
    other = normd.Client(daemon.socket, name="eager-other")
    try:
        normd.set_default_client(client)
        call = _through_ops(True, False)

        def through_default(c):
            return call(None)

        _, by_kernels, _ = ops_paths(True, through_default)
        assert by_kernels == 2
        assert {recorder.rec_conn(i) for i in range(2)} == {client._conn.handle}
        normd.set_default_client(other)  # the kernels forget key 0 until Python tells them
        other_calls = []
        other._enqueue_device = lambda job, ptrs, stream: other_calls.append(job)
        assert ops_paths(True, through_default)[1] == 2
        # The warm-up's forward went through Python, to `other`, which told the
        # kernels key 0; its backward and the counted call ran in C++ on `other`.
        assert len(other_calls) == 1
        assert {recorder.rec_conn(i) for i in range(2)} == {other._conn.handle}
    finally:
        normd.set_default_client(None)
        other.close()


def test_a_client_dropped_between_forward_and_backward_stays_open(operator, recorder, daemon,
                                                                   monkeypatch):
    """The autograd node holds the client, as the Python path's ctx.client does."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(fln, "_eager_op", operator)
    monkeypatch.delenv("NORMD_COMPLETION", raising=False)
    recorder.rec_reset()
    c = normd.Client(daemon.socket, name="eager-dropped")
    handle, alive = c._conn.handle, weakref.ref(c)
    m = N.FusedLayerNorm(16)
    m.client = c
    del c
    y = m(torch.randn(3, 16, requires_grad=True))
    m.client = None
    gc.collect()
    assert alive() is not None, "the client was collected while its job's backward was pending"
    y.sum().backward()
    assert recorder.rec_count() == 2 and recorder.rec_conn(1) == handle
    del y
    gc.collect()
    assert alive() is None  # and released with the graph


def _refused_second_time(call, recorder, message):
    """A step that calls `call` twice, the library refusing the second forward as UNSUPPORTED
    with `message` (the first call teaches the operator the client's key)."""
    def step(c):
        call(c)
        recorder.rec_fail(_lib.STATUS_CODES["UNSUPPORTED"], 1 << 3, message)
        return call(c)
    return step


_CAPTURING = b"the stream is capturing a CUDA graph, and ..."


def test_the_ops_kernels_hand_a_capturing_stream_to_python_and_raise_other_refusals(
        ops_paths, recorder):
    """Python words the capture refusal for PyTorch users; other refusals are RuntimeErrors."""
    call = _through_ops(True, False)
    capturing = _refused_second_time(call, recorder, _CAPTURING)
    _, by_kernels, by_python = ops_paths(True, capturing)
    # In C++: the first call's forward and backward and the second's backward; the
    # refused forward went to the Python implementation (its library call recorded here).
    assert (by_kernels, by_python) == (3, 1)

    refused = _refused_second_time(call, recorder, b"tensor x: not exportable")
    with pytest.raises(RuntimeError, match=r"normd error -\d+ \(UNSUPPORTED\): tensor x"):
        ops_paths(True, refused)


# ---- the self-test of a fresh build -------------------------------------------------------


def test_a_build_that_fails_its_self_test_is_recorded_and_not_used(monkeypatch, tmp_path):
    # The library the operator fixture loaded passed the self-test: build() ran it.
    built = eager.build()
    assert not eager._failure_path(built).exists()
    # A child that crashes (as one compiler's build did when raising an error).
    monkeypatch.setattr(eager, "_CHILD_CODE", "import os; os.abort()")
    target = tmp_path / "normd_eager-test.so"
    with pytest.raises(RuntimeError, match="failed its self-test"):
        eager._check_in_child(built, target)
    with pytest.raises(RuntimeError, match="failed its self-test"):
        eager._raise_recorded_failure(target)
    # norm_op() warns and leaves every call to the Python path.
    monkeypatch.setenv("NORMD_EAGER", "1")
    monkeypatch.setattr(eager, "_state", {"op": None, "tried": False, "why": "", "path": None})
    monkeypatch.setattr(eager, "_library_path", lambda torch: (target, eager._header_dir()))
    with pytest.warns(RuntimeWarning, match="failed its self-test"):
        assert eager.norm_op() is None
    assert "failed its self-test" in eager.status()


# ---- the variants' operator (normd_eager::variant_norm) ------------------------------------

variants_module = importlib.import_module("normd.normalization.variants")

#: The caller's tensors a role of a variant job may name (see _ROLE_NAMES).
_VARIANT_NAMES = dict(_ROLE_NAMES, residual=("residual",), residual_out=("s",), ds=("ds",),
                      dx=("input.grad", "residual.grad"))


def _as_cuda_variants(client, monkeypatch):
    """_as_cuda, and the variants' Python path's library calls (_enqueue_device_ext) recorded."""
    python_calls = _as_cuda(client, monkeypatch)
    monkeypatch.setattr(variants_module, "_capturing", lambda: False)
    monkeypatch.setattr(variants_module, "_raw_stream", lambda index: 0)
    monkeypatch.setattr(client, "_enqueue_device_ext", lambda job, ext, ptrs, stream:
                        python_calls.append((_job_fields(job) + (round(ext.weight_offset, 6),),
                                             struct.unpack("@%dP" % _lib.ALL_JOB_TENSORS, ptrs),
                                             stream)))
    return python_calls


def _variant_jobs_of(call, client, recorder, python_calls):
    """_jobs_of over every role, with each job's weight offset."""
    recorder.rec_reset()
    python_calls.clear()
    named = call(client)
    ours = [(_job_fields(recorder.rec_job(i).contents) + (round(recorder.rec_offset(i), 6),),
             tuple(recorder.rec_ptrs(i)[k] or 0 for k in range(_lib.ALL_JOB_TENSORS)),
             recorder.rec_stream(i) or 0) for i in range(recorder.rec_count())]
    return (_symbolic(ours + python_calls, named, _lib.TENSOR_ROLES + _lib.EXT_TENSOR_ROLES,
                      _VARIANT_NAMES), len(ours), len(python_calls))


@pytest.fixture
def variant_paths(operator, recorder, client, monkeypatch):
    """As `paths`, for the variants: run(use_operator, call) -> (jobs, by operator, by Python)."""
    python_calls = _as_cuda_variants(client, monkeypatch)
    op = torch.ops.normd_eager.variant_norm.default._op
    monkeypatch.setattr(eager, "variant_op", lambda: op)
    old_mode = normd.set_completion_mode(None)
    normd.set_default_client(client)

    def run(use_operator, call):
        monkeypatch.setattr(fln, "_eager_op", operator if use_operator else False)
        return _variant_jobs_of(call, client, recorder, python_calls)

    yield run
    normd.set_default_client(None)
    normd.set_completion_mode(old_mode)


def _variant_call(factory, dtype, residual=True, grads=("y", "s")):
    """A call: a variant module on fresh inputs, forward and backward from the outputs in grads."""

    def call(client):
        torch.manual_seed(9)
        module = factory().to(dtype)
        module.client = client
        x = torch.randn(6, 32, dtype=dtype).requires_grad_()
        r = torch.randn(6, 32, dtype=dtype).requires_grad_() if residual else None
        y, s = module(x, r) if residual else (module(x), None)
        dy, ds = torch.randn_like(y), (torch.randn_like(s) if s is not None else None)
        outs = [(t, g) for name, t, g in (("y", y, dy), ("s", s, ds))
                if name in grads and t is not None]
        torch.autograd.backward([t for t, _ in outs], [g for _, g in outs])
        w, b = module.weight, getattr(module, "bias", None)
        return lambda: {"input": x, "residual": r, "weight": w, "bias": b, "output": y, "s": s,
                        "dy": dy, "ds": ds, "input.grad": x.grad,
                        "residual.grad": None if r is None else r.grad,
                        "weight.grad": w.grad, "bias.grad": None if b is None else b.grad}

    return call


VARIANT_CASES = {
    "add rmsnorm bf16": (lambda: N.FusedAddRMSNorm(32), torch.bfloat16, True, ("y", "s")),
    "add layernorm f32, zero-centered": (
        lambda: N.FusedAddLayerNorm(32, zero_centered_gamma=True), torch.float32, True,
        ("y", "s")),
    "add rmsnorm f16 memory_efficient": (
        lambda: N.FusedAddRMSNorm(32, memory_efficient=True), torch.float16, True, ("y", "s")),
    "add layernorm bf16, only y used": (lambda: N.FusedAddLayerNorm(32), torch.bfloat16, True,
                                        ("y",)),
    "rmsnorm with an offset": (lambda: N.FusedRMSNormOffset(32, offset=0.5), torch.float32,
                               False, ("y",)),
}


@pytest.mark.parametrize("case", sorted(VARIANT_CASES))
def test_the_variant_operator_hands_the_library_what_the_python_path_does(variant_paths, case):
    factory, dtype, residual, grads = VARIANT_CASES[case]
    call = _variant_call(factory, dtype, residual, grads)
    (ours, by_operator, _), (python, _, by_python) = variant_paths(True, call), \
        variant_paths(False, call)
    assert by_python == 2 and by_operator == 2
    assert ours == python
    (_, fwd_roles, _), (_, bwd_roles, _) = ours
    assert fwd_roles[1] == "output"
    if residual:
        assert fwd_roles[11] == "residual" and fwd_roles[12] == "s"
        assert bwd_roles[13] == ("ds" if "s" in grads else None)


def test_only_s_used_needs_no_backward_job(variant_paths):
    call = _variant_call(lambda: N.FusedAddRMSNorm(32), torch.float32, True, ("s",))
    (ours, by_operator, _), (python, _, by_python) = variant_paths(True, call), \
        variant_paths(False, call)
    assert by_operator == by_python == 1 and ours == python


def test_the_variant_operator_refusals_and_fallbacks(variant_paths, recorder):
    unsupported = _lib.STATUS_CODES["UNSUPPORTED"]

    def refused_forward(c):
        recorder.rec_fail(unsupported, 1 << 3, b"tensor residual: pointer 0x10 is not exportable")
        m = N.FusedAddRMSNorm(32)
        m.client = c
        m(torch.randn(4, 32), torch.randn(4, 32))

    with pytest.raises(NormdError) as e:
        variant_paths(True, refused_forward)
    assert e.value.status == "UNSUPPORTED" and "tensor residual" in e.value.message

    def refused_backward(c):
        m = N.FusedAddRMSNorm(32)
        m.client = c
        y, s = m(torch.randn(4, 32, requires_grad=True), torch.randn(4, 32))
        recorder.rec_fail(unsupported, 1 << 4, b"no backward")
        (y.sum() + s.sum()).backward()

    with pytest.raises(RuntimeError, match=r"normd error -\d+ \(UNSUPPORTED\): no backward"):
        variant_paths(True, refused_backward)

    def residual_of_another_shape(c):
        N.FusedAddLayerNorm(32)(torch.randn(4, 32), torch.randn(2, 32))

    # The operator leaves it to the Python path, whose check raises.
    with pytest.raises(RuntimeError, match="residual has shape"):
        variant_paths(True, residual_of_another_shape)


@pytest.mark.parametrize("use_operator", [True, False])
def test_the_variants_differentiable_once_as_on_the_python_path(variant_paths, use_operator):
    def twice(c):
        m = N.FusedAddRMSNorm(16)
        m.client = c
        x = torch.randn(3, 16, requires_grad=True)
        y, s = m(x, torch.randn(3, 16))
        (g,) = torch.autograd.grad((y ** 2).sum() + (s ** 2).sum(), x, create_graph=True)
        assert g.requires_grad
        g.sum().backward()

    with pytest.raises(RuntimeError, match="differentiate twice a function"):
        variant_paths(use_operator, twice)


# ---- the C++ kernels of the variants' torch.library ops ----------------------------------


@pytest.fixture
def variant_ops_paths(operator, recorder, client, monkeypatch):
    """As ops_paths, for normd::norm_variant_fwd / _bwd (their jobs with every role)."""
    yield from _kernels_paths(operator, recorder, client, monkeypatch,
                              _as_cuda_variants(client, monkeypatch), _variant_jobs_of)


def _through_variant_ops(rms, memory_efficient, residual, weight_offset, grads=("y", "s")):
    from normd.normalization import variant_ops

    def call(client):
        torch.manual_seed(5)
        x = torch.randn(6, 64, dtype=torch.bfloat16).requires_grad_()
        r = torch.randn(6, 64, dtype=torch.bfloat16).requires_grad_() if residual else None
        w = torch.randn(64, dtype=torch.bfloat16).requires_grad_()
        b = None if rms else torch.randn(64, dtype=torch.bfloat16).requires_grad_()
        y, s = variant_ops.norm(rms, x, r, w, b, (64,), 1e-5, weight_offset, memory_efficient,
                                client)
        dy, ds = torch.randn_like(y), (torch.randn_like(s) if s is not None else None)
        outs = [(t, g) for name, t, g in (("y", y, dy), ("s", s, ds))
                if name in grads and t is not None]
        torch.autograd.backward([t for t, _ in outs], [g for _, g in outs])
        return lambda: {"input": x, "residual": r, "weight": w, "bias": b, "output": y, "s": s,
                        "dy": dy, "ds": ds, "input.grad": x.grad,
                        "residual.grad": None if r is None else r.grad, "weight.grad": w.grad,
                        "bias.grad": None if b is None else b.grad}

    return call


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("memory_efficient", [False, True], ids=["", "memory_efficient"])
@pytest.mark.parametrize("residual, weight_offset, grads", [
    (True, 0.0, ("y", "s")), (True, 1.0, ("y",)), (False, 0.5, ("y",)), (True, 0.0, ("s",))],
    ids=["add", "add zero-centered, only y", "offset", "only s"])
def test_the_variant_ops_kernels_hand_the_library_what_their_python_does(
        variant_ops_paths, rms, memory_efficient, residual, weight_offset, grads):
    call = _through_variant_ops(rms, memory_efficient, residual, weight_offset, grads)
    ours, by_kernels, _ = variant_ops_paths(True, call)
    python, _, by_python = variant_ops_paths(False, call)
    # Two jobs even when only s is used: the op's autograd hands backward zeros for y.
    assert (by_kernels, by_python) == (2, 2)
    assert ours == python


def test_the_variant_ops_kernels_hand_a_capturing_stream_to_python(variant_ops_paths,
                                                                    recorder):
    call = _through_variant_ops(True, False, True, 0.0)
    capturing = _refused_second_time(call, recorder, _CAPTURING)
    # In C++: the first call's jobs and the second's backward; the refused forward went to
    # the Python implementation (its library call recorded here).
    _, by_kernels, by_python = variant_ops_paths(True, capturing)
    assert (by_kernels, by_python) == (3, 1)
