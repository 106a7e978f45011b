"""The norm variants of a job: struct nc_job_ext beside struct nc_job (protocol 3).

docs/VARIANTS.md says what they compute. A job with variants is built and
run like a plain one, with more arguments (these functions are also the
Client methods of the same names: ``client.run_ext(...)``):

- ``residual``, ``residual_out`` (forward, together): s = x + residual,
  rounded once to dtype, is written to residual_out and normalized;
  ``ds`` (backward): the gradient arriving at s, added to dx. The backward
  of an add + norm takes s (residual_out) as ``x``.
- ``weight_offset``: the weight is weight_offset + gamma, formed in fp32
  (1.0: zero-centered gamma, Gemma's 1 + w). Needs gamma.
- ``y_dtype`` "f8e4m3" / "f8e5m2" (or DType.F8E4M3/F8E5M2, or
  torch.float8_e4m3fn/float8_e5m2) with ``scale`` ([1] float32) and
  optionally ``amax`` ([1] float32, written): FP8 output of a forward; ``y``
  then holds one byte per element (a uint8 numpy array or a float8 torch
  tensor).
- In-place forms: an output may be exactly the same array as a per-row
  input (y over x, residual_out over residual, dx over dy or ds); any other
  overlap is refused by the daemon (INVALID_ARGUMENT).

``norm_features(client)`` (``Client.norm_features``) says which variants
the daemon's backend runs (FEATURE_* bits of normd._lib); a job using
another is refused with UNSUPPORTED (by the library itself in the enqueue
mode). Nothing here imports torch or numpy.
"""

import ctypes

from . import _lib
from . import client as _client
from .dtypes import ITEMSIZE, dtype_of, to_dtype
from .errors import NormdError, check
from .host import HostRegion

_FP8_TORCH = {"float8_e4m3fn": _lib.DType.F8E4M3, "float8_e5m2": _lib.DType.F8E5M2}

#: Feature bit -> the name messages use.
FEATURE_NAMES = {_lib.FEATURE_RESIDUAL: "residual add",
                 _lib.FEATURE_WEIGHT_OFFSET: "weight offset",
                 _lib.FEATURE_FP8_OUTPUT: "FP8 output"}


def feature_names(mask):
    """The variants of a FEATURE_* mask as words ("residual add, FP8 output")."""
    return ", ".join(name for bit, name in FEATURE_NAMES.items() if mask & bit) or "none"


def norm_features(client):
    """The variants the daemon runs: FEATURE_* bits of normd._lib (0 before protocol 3)."""
    return int(client._lib.nc_server_norm_features(client._handle()))


def to_y_dtype(spec):
    """The y_dtype of a job: 0 (None: y has dtype), a DType, or FP8 by name or torch dtype."""
    if spec is None or (isinstance(spec, int) and not isinstance(spec, bool) and spec == 0):
        return 0
    return to_dtype(spec)


def is_fp8(y_dtype):
    return y_dtype in (_lib.DType.F8E4M3, _lib.DType.F8E5M2)


def _check_array(role, obj, elems, itemsize, want=None):
    """Refuses an array or tensor that cannot hold `elems` elements of `itemsize` bytes."""
    _, nbytes, contiguous = _client._extent(obj)
    if want is not None:
        have = dtype_of(obj)
        if have is not None and have != want:
            raise TypeError("tensor %s is %s but the job needs %s there"
                            % (role, have.name, _lib.DType(want).name))
    if not contiguous:
        raise ValueError("tensor %s must be contiguous (row-major)" % role)
    if nbytes < elems * itemsize:
        raise ValueError("tensor %s holds %d bytes; the job needs %d elements (%d bytes)"
                         % (role, nbytes, elems, elems * itemsize))


def _check_fp8_y(obj, y_dtype, elems):
    """An FP8 y: one byte an element (uint8 numpy, or the matching float8 torch dtype)."""
    size = obj.element_size() if hasattr(obj, "element_size") else getattr(obj, "itemsize", 0)
    if size != 1:
        raise TypeError("tensor y of an FP8 job must have one-byte elements (uint8 in numpy, "
                        "torch.float8_e4m3fn / float8_e5m2 in torch); got %s" % obj.dtype)
    name = str(obj.dtype).replace("torch.", "")
    if name in _FP8_TORCH and _FP8_TORCH[name] != y_dtype:
        raise TypeError("tensor y is %s but the job's y_dtype is %s"
                        % (name, _lib.DType(y_dtype).name))
    _check_array("y", obj, elems, 1)


def _raw(obj):
    return obj is None or isinstance(obj, (_lib.NcTensor, HostRegion, tuple))


def make_job_ext(client, op, rows, cols, *, weight_offset=0.0, y_dtype=None, **tensors):
    """Builds struct nc_job and struct nc_job_ext; returns (job, ext, objects to keep alive).

    The arguments are Client.make_job()'s, plus weight_offset, y_dtype and
    the tensors residual, residual_out, ds, scale and amax (anything
    Client.tensor() accepts). Arrays and torch tensors are checked here
    (dtype, size, contiguity): residual, residual_out and ds are [rows, cols]
    of dtype, scale and amax one float32, an FP8 y one byte an element.
    """
    ext_tensors = {role: tensors.pop(role) for role in _lib.EXT_TENSOR_ROLES if role in tensors}
    y_code = to_y_dtype(y_dtype)
    fp8_y = tensors.pop("y", None) if is_fp8(y_code) else None
    job, keep = client.make_job(op, rows, cols, **tensors)
    ext = _lib.NcJobExt()
    ext.weight_offset = float(weight_offset)
    ext.y_dtype = int(y_code)
    if fp8_y is not None:
        if not _raw(fp8_y):
            _check_fp8_y(fp8_y, y_code, job.rows * job.cols)
        job.y = client.tensor(fp8_y)
        keep.append(fp8_y)
    for role, obj in ext_tensors.items():
        if obj is None:
            continue
        if not _raw(obj):
            if role in ("scale", "amax"):
                _check_array(role, obj, 1, 4, _lib.DType.F32)
            elif job.dtype:
                _check_array(role, obj, job.rows * job.cols, ITEMSIZE[_lib.DType(job.dtype)],
                             _lib.DType(job.dtype))
        setattr(ext, role, client.tensor(obj))
        keep.append(obj)
    return job, ext, keep


def run_job_ext(client, job, ext, *, stream=None, timeout_ms=None, keepalive=(), event=False):
    """Client.run_job() with the job's variants (nc_job_run_ext / _on_stream_ext / _event_ext)."""
    result = _lib.NcJobResult()
    timeout = client.timeout_ms if timeout_ms is None else int(timeout_ms)
    handle, lib = client._handle(), client._lib
    job_p, ext_p, res_p = ctypes.byref(job), ctypes.byref(ext), ctypes.byref(result)
    if event:
        rc = lib.nc_job_run_event_ext(handle, job_p, ext_p, ctypes.c_void_p(int(stream or 0)),
                                      timeout, res_p)
    elif stream is None:
        rc = lib.nc_job_run_ext(handle, job_p, ext_p, timeout, res_p)
    else:
        rc = lib.nc_job_run_on_stream_ext(handle, job_p, ext_p, ctypes.c_void_p(int(stream)),
                                          timeout, res_p)
    return client._finish(rc, result, keepalive)


def run_ext(client, op, rows, cols, *, stream=None, timeout_ms=None, event=False, **job_args):
    """Client.run() of a job with variants (see make_job_ext); returns a JobResult."""
    job, ext, keep = make_job_ext(client, op, rows, cols, **job_args)
    if stream is None:
        stream = _client._current_stream_of(keep)
    return run_job_ext(client, job, ext, stream=stream, timeout_ms=timeout_ms, keepalive=keep,
                       event=event)


def enqueue_job_ext(client, job, ext, *, stream=0):
    """Client.enqueue_job() with the job's variants (nc_job_enqueue_ext)."""
    check(client._lib.nc_job_enqueue_ext(client._handle(), ctypes.byref(job), ctypes.byref(ext),
                                         ctypes.c_void_p(int(stream or 0))))


def enqueue_ext(client, op, rows, cols, *, stream=None, **job_args):
    """Client.enqueue() of a job with variants (see make_job_ext); returns None.

    The library also refuses here, synchronously, variants the daemon does
    not run (UNSUPPORTED) and aliases between tensors of one region.
    """
    job, ext, keep = make_job_ext(client, op, rows, cols, **job_args)
    if stream is None:
        stream = _client._current_stream_of(keep) or 0
    enqueue_job_ext(client, job, ext, stream=stream)


def submit_ext(client, op, rows, cols, **job_args):
    """Client.submit() of a job with variants; returns a PendingJob to wait() on."""
    job, ext, keep = make_job_ext(client, op, rows, cols, **job_args)
    request_id = ctypes.c_uint64()
    check(client._lib.nc_job_submit_ext(client._handle(), ctypes.byref(job), ctypes.byref(ext),
                                        ctypes.byref(request_id)))
    return _client.PendingJob(client, request_id.value, keep)


def missing_features_error(client, missing):
    """The NormdError UNSUPPORTED for variants the daemon does not run."""
    return NormdError(_lib.STATUS_CODES["UNSUPPORTED"],
                      "the daemon's %s backend does not run %s jobs (nc_server_norm_features "
                      "0x%x)" % (client.backend, feature_names(missing), norm_features(client)))
