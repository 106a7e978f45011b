"""normd.Client: one connection to the daemon, its memory and its jobs."""

import ctypes
import itertools
import os
import sys
import threading
import weakref

from . import _lib
from . import job_ext as _job_ext
from .dtypes import ITEMSIZE, dtype_of, to_dtype
from .errors import NormdError, check, status_name
from .host import HostRegion, host_error, numpy_dtype, to_bf16

DEFAULT_SOCKET = "/run/normd/0.sock"
DEFAULT_TIMEOUT_MS = 30000

#: How normd.normalization completes jobs on CUDA tensors (see completion_mode()).
COMPLETION_MODES = ("enqueue", "sync", "event")
DEFAULT_COMPLETION = "enqueue"

_EXPANDABLE_HINT = (
    " -- PyTorch allocates such memory with PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync "
    "(memory pools), or with expandable_segments:True when its chunks cannot be exported as "
    "POSIX fds (TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC=0, or fabric handles); normd takes "
    "cudaMalloc memory (CUDA IPC) and expandable segments exportable as POSIX fds")


class JobResult:
    """What the daemon said about a job that succeeded.

    Attributes: status ("OK"), code (0), clamped_cols (memory-efficient
    backward: gamma entries clamped to eps), device_us, queue_us, variant (the
    kernel variant that ran), message.
    """

    __slots__ = ("status", "code", "clamped_cols", "device_us", "queue_us", "variant",
                 "message")

    def __init__(self, raw):
        self.code = int(raw.status)
        self.status = status_name(self.code)
        self.clamped_cols = int(raw.clamped_cols)
        self.device_us = int(raw.device_us)
        self.queue_us = int(raw.queue_us)
        self.variant = _lib.text(raw.variant)
        self.message = _lib.text(raw.message)

    def __repr__(self):
        return ("JobResult(status=%r, variant=%r, device_us=%d, queue_us=%d, clamped_cols=%d)"
                % (self.status, self.variant, self.device_us, self.queue_us, self.clamped_cols))


# This process's id, kept current across os.fork() by a hook: the job path
# compares it to a connection's owner on every call, and os.getpid() is a
# system call each time.
_pid = os.getpid()


def _after_fork_in_child():
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)


class _Conn:
    """The library's connection and what hangs off it.

    Kept apart from Client so that the finalizer that closes it does not
    keep the Client alive; host regions point here too.
    """

    def __init__(self, lib, handle):
        self.lib = lib
        self.handle = handle
        self.pid = _pid
        self.lock = threading.Lock()
        self.regions = {}    # region id -> HostRegion, registered and not yet freed
        self.abandoned = []  # tensors of jobs that timed out (the daemon may still use them)
        self.eager_bound = False  # the compiled eager operator knows this handle (normd.eager)
        self.norm_features = None  # the daemon's FEATURE_* bits, once asked (normalization)

    def checked_handle(self):
        """The library's handle; NormdError if closed or used by a forked child."""
        if self.handle is None:
            raise NormdError(_lib.STATUS_CODES["INVALID_ARGUMENT"], "the client is closed")
        if _pid != self.pid:
            raise NormdError(_lib.STATUS_CODES["INVALID_ARGUMENT"],
                             "this client was opened by process %d; a forked child must "
                             "open its own normd.Client" % self.pid)
        return self.handle

    def free_region(self, region):
        """Unregisters a HostRegion of this connection (no-op if already freed)."""
        with self.lock:
            live = self.regions.pop(region.id, None) is region
        if live and os.getpid() == self.pid:
            check(region._release())

    def close(self):
        with self.lock:
            handle, self.handle = self.handle, None
            regions, self.regions = list(self.regions.values()), {}
        if handle is None:
            return
        if os.getpid() != self.pid:
            # A forked child shares the parent's socket: saying Goodbye or
            # unregistering would end the parent's session. Leave it alone.
            return
        if self.eager_bound:
            from . import eager

            eager.conn_closed(handle)
        # nc_close() leaves host regions to the caller: free them first.
        for region in regions:
            region._release()
        self.lib.nc_close(handle)


def _socket_and_origin(socket):
    """The socket to connect to, as the C tools choose it, and where it came from.

    An explicit path, else $NORMD_SOCKET, else DEFAULT_SOCKET (normctl's rule).
    """
    if socket:
        return socket, "given"
    if os.environ.get("NORMD_SOCKET"):
        return os.environ["NORMD_SOCKET"], "$NORMD_SOCKET"
    return DEFAULT_SOCKET, "default"


def _connect_error(rc, socket, origin):
    """nc_connect's message; when no daemon answered, with where the socket came from."""
    message = _lib.text(_lib.load().nc_last_error())
    if rc not in (_lib.STATUS_CODES["IO"], _lib.STATUS_CODES["TIMEOUT"]):
        return message
    if socket not in message:
        message = "normd at %s: %s" % (socket, message)
    hint = {"given": "",
            "$NORMD_SOCKET": " (the socket named by $NORMD_SOCKET)",
            "default": " (the default socket; set $NORMD_SOCKET or pass socket= to use another)"}
    return "%s -- is normd running on that socket?%s" % (message, hint[origin])


def _to_op(op):
    if isinstance(op, str):
        try:
            return int(_lib.Op[op.upper()])
        except KeyError:
            raise ValueError("unknown op %r; one of %s" % (op, ", ".join(_lib.Op.__members__)))
    return int(op)


def _struct_to_dict(value):
    """A ctypes structure or array as plain Python values."""
    if isinstance(value, ctypes.Structure):
        return {name: _struct_to_dict(getattr(value, name)) for name, _ in value._fields_}
    if isinstance(value, ctypes.Array):
        if value._type_ is ctypes.c_char:
            return _lib.text(value.value)
        return [_struct_to_dict(v) for v in value]
    if isinstance(value, bytes):
        return _lib.text(value)
    return value


def _is_torch_tensor(obj):
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def _extent(obj):
    """(address, bytes, contiguous) of a numpy array or a torch tensor."""
    if _is_torch_tensor(obj):
        return obj.data_ptr(), obj.numel() * obj.element_size(), obj.is_contiguous()
    iface = getattr(obj, "__array_interface__", None)
    if iface is None:
        raise TypeError("cannot use a %s as a job tensor (numpy arrays, torch tensors, "
                        "NcTensor, HostRegion or (HostRegion, offset))" % type(obj).__name__)
    return iface["data"][0], obj.nbytes, obj.flags.c_contiguous


class PendingJob:
    """A job sent with Client.submit(); call wait() exactly once."""

    def __init__(self, client, request_id, keepalive):
        self._client = client
        self.request_id = request_id
        self._keepalive = keepalive
        self._done = False

    def wait(self, timeout_ms=None):
        """Waits for the reply; returns a JobResult or raises NormdError.

        After a TIMEOUT the job may still complete: wait() may be called again.
        """
        if self._done:
            raise ValueError("job %d was already waited for" % self.request_id)
        client = self._client
        result = _lib.NcJobResult()
        timeout = client.timeout_ms if timeout_ms is None else timeout_ms
        rc = client._lib.nc_job_wait(client._handle(), self.request_id, timeout,
                                     ctypes.byref(result))
        if rc == _lib.STATUS_CODES["TIMEOUT"]:
            raise NormdError(rc, _lib.text(result.message))
        self._done = True
        self._keepalive = None
        if rc:
            raise NormdError(rc, _lib.text(result.message))
        return JobResult(result)


class Client:
    """A connection to normd.

    Args:
        socket: the daemon's socket path (default: $NORMD_SOCKET, else
            /run/normd/0.sock).
        name: how the daemon's log names this client (default: "python:<program>").
        timeout_ms: the limit for connecting and, by default, for each job
            (a negative value: no limit).

    Memory: ``host_array()``/``host_region()`` give shared host memory (CPU
    backend); CUDA torch tensors are registered on first use, one
    registration per cudaMalloc allocation, or with
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` per run of up to
    32 mapped chunks around a tensor (``device_tensor()``), cached for the
    life of the connection (a chunk unmapped and mapped again is registered
    anew). Jobs: ``run()`` (waits; with ``stream=`` it
    orders the job after the work queued on that CUDA stream; with
    ``event=True`` it returns once the job is queued, through interprocess
    events), ``enqueue()`` (the enqueue mode: ordered with a CUDA stream on
    the GPU, returns once sent; ``check()`` and ``stream_wait()`` collect its
    errors) and ``submit()`` (returns a PendingJob). Every failure raises
    NormdError.

    A client may be used from several threads. Close it with ``close()`` or
    a ``with`` block; one that is garbage collected or still open at exit is
    closed then. A forked child must open its own client.
    """

    def __init__(self, socket=None, name=None, timeout_ms=DEFAULT_TIMEOUT_MS):
        self._lib = _lib.load()
        self.socket, origin = _socket_and_origin(socket)
        self.timeout_ms = int(timeout_ms)
        if name is None:
            name = "python:%s" % (os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0]
                                  else "python")
        handle = ctypes.c_void_p()
        rc = self._lib.nc_connect(os.fsencode(self.socket), name.encode(), self.timeout_ms,
                                  ctypes.byref(handle))
        if rc < 0:
            raise NormdError(rc, _connect_error(rc, self.socket, origin))
        self._conn = _Conn(self._lib, handle.value)
        self._enqueue_device_call = self._lib.nc_job_enqueue_device
        self._finalizer = weakref.finalize(self, self._conn.close)
        # torch.library ops take plain arguments: they name their client by this key.
        self._key = next(_client_keys)
        _clients[self._key] = self

    # ---- the connection ---------------------------------------------------------

    def _handle(self):
        return self._conn.checked_handle()

    @property
    def closed(self):
        """True after close()."""
        return self._conn.handle is None

    def close(self):
        """Frees this client's host regions, says Goodbye and closes. Idempotent.

        Call it when no other thread is using the client. Arrays made from
        host regions stay readable; CUDA registrations are released by the
        daemon once their jobs end.
        """
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return "<normd.Client %s%s>" % (self.socket, " closed" if self.closed else "")

    @property
    def server_info(self):
        """The daemon's HelloReply as a dict (version, backend, server_pid, limits, devices)."""
        info = _struct_to_dict(self._lib.nc_server_info(self._handle()).contents)
        info["device_index"] = info["device_index"][:info["device_count"]]
        return info

    @property
    def backend(self):
        """"cpu" or "cuda"."""
        return self.server_info["backend"]

    def ping(self, timeout_ms=None):
        """A round trip with no work; raises NormdError if the daemon does not answer."""
        timeout = self.timeout_ms if timeout_ms is None else timeout_ms
        check(self._lib.nc_ping(self._handle(), timeout))

    def stats(self, timeout_ms=None):
        """The daemon's counters (struct nc_stats) as a dict of plain values."""
        out = _lib.NcStats()
        timeout = self.timeout_ms if timeout_ms is None else timeout_ms
        check(self._lib.nc_stats_get(self._handle(), timeout, ctypes.byref(out)))
        stats = _struct_to_dict(out)
        stats["devices"] = stats["devices"][:stats["device_count"]]
        return stats

    def variants(self, timeout_ms=None):
        """The daemon's kernel-variant cache as a list of dicts (empty on the CPU backend)."""
        entries = ctypes.POINTER(_lib.NcVariantInfo)()
        count = ctypes.c_size_t()
        timeout = self.timeout_ms if timeout_ms is None else timeout_ms
        check(self._lib.nc_variants_get(self._handle(), timeout, ctypes.byref(entries),
                                        ctypes.byref(count)))
        try:
            return [_struct_to_dict(entries[i]) for i in range(count.value)]
        finally:
            self._lib.nc_variants_free(entries)

    # ---- the norm variants (struct nc_job_ext; normd.job_ext, docs/VARIANTS.md) ----

    norm_features = property(_job_ext.norm_features,
                             doc="The variants the daemon runs (normd._lib.FEATURE_* bits).")
    make_job_ext = _job_ext.make_job_ext
    run_ext = _job_ext.run_ext
    run_job_ext = _job_ext.run_job_ext
    enqueue_ext = _job_ext.enqueue_ext
    enqueue_job_ext = _job_ext.enqueue_job_ext
    submit_ext = _job_ext.submit_ext

    # ---- memory -----------------------------------------------------------------

    def host_region(self, size):
        """size bytes of zeroed shared host memory registered with the daemon."""
        region = HostRegion(self._conn, size)
        with self._conn.lock:
            self._conn.regions[region.id] = region
        return region

    def host_array(self, shape, dtype):
        """A zeroed numpy array of shape and dtype in a host region of its own.

        dtype: float32, float16 (numpy dtypes or names), or "bf16" (stored as
        uint16 bit patterns). The array is an ordinary ndarray whose memory
        the daemon reads and writes in place; free its region with
        ``free(array)`` (or let close() free it).
        """
        store = numpy_dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
        count = 1
        for d in shape:
            count *= d
        region = self.host_region(max(1, count * store.itemsize))
        return region.array(shape, store, 0)

    def host_copy(self, values, dtype=None):
        """A host_array holding a copy of `values`, converted to dtype if given.

        For dtype "bf16", float values are rounded to bf16 bit patterns
        (normd.to_bf16); uint16 values are taken as bf16 bits already.
        """
        import numpy

        values = numpy.asarray(values)
        store = numpy_dtype(values.dtype if dtype is None else dtype)
        if store == numpy.uint16 and values.dtype != numpy.uint16:
            values = to_bf16(values)
        out = self.host_array(values.shape, store)
        out[...] = values
        return out

    def region_of(self, obj):
        """The HostRegion holding a numpy array (or CPU torch tensor), or None."""
        address, nbytes, _ = _extent(obj)
        with self._conn.lock:
            for region in self._conn.regions.values():
                if region.contains(address, max(nbytes, 1)):
                    return region
        return None

    def free(self, obj):
        """Frees a HostRegion, or the region holding an array made by host_array()."""
        region = obj if isinstance(obj, HostRegion) else self.region_of(obj)
        if region is None:
            raise host_error("%s is not in a host region of this client" % type(obj).__name__)
        self._conn.free_region(region)

    def device_tensor(self, ptr, nbytes=1):
        """The job tensor for the `nbytes` bytes at CUDA device pointer `ptr` (ints).

        Registers the memory holding them on first use and reuses that
        registration afterwards (nc_tensor_device_range): the cudaMalloc
        allocation containing `ptr`, or, for VMM memory (PyTorch's
        expandable segments), the consecutive mappings covering the bytes,
        reused only while those mappings hold the memory they were
        registered with.
        """
        out = _lib.NcTensor()
        rc = self._lib.nc_tensor_device_range(self._handle(), ctypes.c_void_p(int(ptr)),
                                              max(1, int(nbytes)), ctypes.byref(out))
        if rc < 0:
            message = _lib.text(self._lib.nc_last_error())
            if rc == _lib.STATUS_CODES["UNSUPPORTED"]:
                message += _EXPANDABLE_HINT
            raise NormdError(rc, message)
        return out

    def tensor(self, obj):
        """The job tensor (NcTensor) naming `obj`.

        obj: None (absent), an NcTensor, a HostRegion (offset 0), a
        (HostRegion, offset) pair, a numpy array or CPU torch tensor inside
        one of this client's host regions, or a CUDA torch tensor.
        """
        if obj is None:
            return _lib.NcTensor(0, 0)
        if isinstance(obj, _lib.NcTensor):
            return obj
        if isinstance(obj, HostRegion):
            return obj.tensor(0)
        if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], HostRegion):
            return obj[0].tensor(obj[1])
        if _is_torch_tensor(obj) and obj.is_cuda:
            if obj.numel() == 0:
                raise ValueError("an empty tensor cannot be a job tensor")
            return self.device_tensor(obj.data_ptr(), obj.numel() * obj.element_size())
        address, nbytes, _ = _extent(obj)
        if nbytes == 0:
            raise ValueError("an empty array cannot be a job tensor")
        region = self.region_of(obj)
        if region is None:
            raise host_error(
                "the %s at 0x%x (%d bytes) is not inside a host region registered by this "
                "client; allocate it with client.host_array() or client.host_region()"
                % (type(obj).__name__, address, nbytes))
        return region.tensor(address - region.address)

    # ---- jobs -------------------------------------------------------------------

    def make_job(self, op, rows, cols, *, dtype=None, weight_dtype=None, eps=None,
                 memory_efficient=False, accumulate=False, overwrite=False, out_features=0,
                 deadline_us=0, **tensors):
        """Builds a struct nc_job; returns (job, objects to keep alive while it runs).

        op: an Op, its name ("LAYERNORM_FWD"...) or a number. rows, cols: the
        [rows, cols] view (WGRAD_ACCUM: rows = tokens, cols = in features,
        out_features = out). dtype: of x/y/dy/dx, inferred from x (or dy)
        when omitted. weight_dtype: of gamma/beta/dgamma/dbeta (WGRAD_ACCUM:
        main_grad), inferred from them when omitted; same as dtype, or
        float32. eps: None for the daemon's default 1e-5.

        Tensors by role (x, y, mean, rstd, gamma, beta, dy, dx, dgamma,
        dbeta, main_grad): anything tensor() accepts. numpy arrays and torch
        tensors are checked here (contiguous, dtype, enough elements) before
        anything is sent; NcTensor values are the daemon's to check.
        """
        unknown = set(tensors) - set(_lib.TENSOR_ROLES)
        if unknown:
            raise TypeError("unknown tensor role(s) %s; roles are %s"
                            % (", ".join(sorted(unknown)), ", ".join(_lib.TENSOR_ROLES)))
        op = _to_op(op)
        wgrad = op == _lib.Op.WGRAD_ACCUM
        dtype = self._job_dtype(dtype, tensors)
        weight_dtype = self._job_weight_dtype(weight_dtype, dtype, tensors, wgrad)
        job = _lib.NcJob()
        job.op, job.rows, job.cols = op, int(rows), int(cols)
        job.eps = 0.0 if eps is None else float(eps)
        job.dtype = int(dtype) if dtype is not None else 0
        job.weight_dtype = int(weight_dtype)
        job.flags = ((_lib.MEMORY_EFFICIENT if memory_efficient else 0) |
                     (_lib.ACCUMULATE if accumulate else 0) |
                     (_lib.OVERWRITE if overwrite else 0))
        job.deadline_us = int(deadline_us)
        job.out_features = int(out_features)
        keep = []
        for role, obj in tensors.items():
            if obj is None:
                continue
            if not isinstance(obj, (_lib.NcTensor, HostRegion, tuple)):
                self._check_tensor(role, obj, job, dtype, weight_dtype, wgrad)
            setattr(job, role, self.tensor(obj))
            keep.append(obj)
        return job, keep

    @staticmethod
    def _job_dtype(dtype, tensors):
        if dtype is not None:
            return to_dtype(dtype)
        for role in ("x", "dy", "y", "dx"):
            found = dtype_of(tensors.get(role))
            if found is not None:
                return found
        return None  # all tensors raw: the daemon refuses dtype 0

    @staticmethod
    def _job_weight_dtype(weight_dtype, dtype, tensors, wgrad):
        if weight_dtype is not None:
            return to_dtype(weight_dtype)
        roles = ("main_grad",) if wgrad else ("gamma", "beta", "dgamma", "dbeta")
        for role in roles:
            found = dtype_of(tensors.get(role))
            if found is not None:
                # 0 means "the same as dtype" (WGRAD_ACCUM: float32).
                return 0 if found == dtype and not wgrad else found
        return 0

    @staticmethod
    def _check_tensor(role, obj, job, dtype, weight_dtype, wgrad):
        """Refuses an array or tensor that cannot hold `role` of `job`."""
        rows, cols, out = job.rows, job.cols, job.out_features
        if wgrad:
            elems = {"x": rows * cols, "dy": rows * out, "main_grad": out * cols}.get(role, 0)
            want = (weight_dtype or _lib.DType.F32) if role == "main_grad" else dtype
        elif role in ("mean", "rstd"):
            elems, want = rows, _lib.DType.F32
        elif role in ("gamma", "beta", "dgamma", "dbeta"):
            elems, want = cols, weight_dtype or dtype
        else:
            elems, want = rows * cols, dtype
        have = dtype_of(obj)
        if want is not None and have is not None and have != want:
            raise TypeError("tensor %s is %s but the job needs %s there"
                            % (role, have.name, _lib.DType(want).name))
        _, nbytes, contiguous = _extent(obj)
        if not contiguous:
            raise ValueError("tensor %s must be contiguous (row-major)" % role)
        if want is not None and nbytes < elems * ITEMSIZE[_lib.DType(want)]:
            raise ValueError("tensor %s holds %d bytes; the job needs %d elements (%d bytes)"
                             % (role, nbytes, elems, elems * ITEMSIZE[_lib.DType(want)]))

    def _finish(self, rc, result, keep):
        if rc == _lib.STATUS_CODES["TIMEOUT"]:
            # The daemon may still read and write these: never let them be
            # freed and reused under it.
            with self._conn.lock:
                self._conn.abandoned.append(keep)
            raise NormdError(rc, _lib.text(result.message) +
                             " (the job may still complete; its tensors are kept alive)")
        if rc:
            raise NormdError(rc, _lib.text(result.message))
        return JobResult(result)

    def run(self, op, rows, cols, *, stream=None, timeout_ms=None, event=False, **job_args):
        """Runs one job and waits for it; returns a JobResult or raises NormdError.

        The arguments are make_job()'s. stream: a cudaStream_t as an int
        (``torch.cuda.current_stream().cuda_stream``): the job starts after
        the work queued on it and is complete when run() returns, so work
        queued afterwards sees its outputs (nc_job_run_on_stream). When the
        job names CUDA torch tensors and no stream is given, the current
        stream of their device is used. event=True (CUDA backend): the
        IPC-event mode (nc_job_run_event): run() returns once the daemon has
        queued the job, and work queued on `stream` afterwards runs after it;
        the result then has no device_us and no clamped_cols.
        """
        job, keep = self.make_job(op, rows, cols, **job_args)
        if stream is None:
            stream = _current_stream_of(keep)
        return self.run_job(job, stream=stream, timeout_ms=timeout_ms, keepalive=keep,
                            event=event)

    def run_job(self, job, *, stream=None, timeout_ms=None, keepalive=(), event=False):
        """Runs a prepared NcJob (see make_job); `keepalive` is kept if it times out.

        event=True uses nc_job_run_event on `stream` (None: the legacy
        default stream); see run().
        """
        result = _lib.NcJobResult()
        timeout = self.timeout_ms if timeout_ms is None else int(timeout_ms)
        handle = self._handle()
        if event:
            rc = self._lib.nc_job_run_event(handle, ctypes.byref(job),
                                            ctypes.c_void_p(int(stream or 0)), timeout,
                                            ctypes.byref(result))
        elif stream is None:
            rc = self._lib.nc_job_run(handle, ctypes.byref(job), timeout, ctypes.byref(result))
        else:
            rc = self._lib.nc_job_run_on_stream(handle, ctypes.byref(job),
                                                ctypes.c_void_p(int(stream)), timeout,
                                                ctypes.byref(result))
        return self._finish(rc, result, keepalive)

    # ---- the enqueue mode (docs/ENQUEUE.md) ---------------------------------------

    def enqueue(self, op, rows, cols, *, stream=None, **job_args):
        """Queues one job ordered with `stream` and returns once it is sent; returns None.

        The arguments are make_job()'s. stream: a cudaStream_t as an int; the
        job runs, on the GPU, after the work queued on it so far, and work
        queued on it afterwards sees the job's outputs (nc_job_enqueue). No
        CPU waits. When the job names CUDA torch tensors and no stream is
        given, the current stream of their device is used; else 0 (on the
        CPU backend, any int is a key naming an order: jobs with the same key
        run in order; stream_wait(key) waits for them).

        Memory: the call returns before the job ran, so its tensors must
        stay valid until `stream` reaches it. PyTorch's caching allocator
        reuses a freed block in the order of the stream it was allocated on,
        so tensors allocated on `stream` (e.g. while it is the current
        stream) are safe to drop at once; a tensor allocated on another
        stream needs ``tensor.record_stream(...)``, as for any kernel queued
        on `stream`. Host arrays stay mapped until their region is freed.

        Errors: what the library can check (op, shapes, dtypes, regions,
        bounds) raises NormdError here and queues nothing; a job the daemon
        refuses or fails later has its outputs filled with NaN and its error
        raised by a later enqueue() (one a millisecond or 32 requests after the
        reply came; it then queues nothing), check() or stream_wait().
        WGRAD_ACCUM cannot be enqueued (UNSUPPORTED). A daemon that dies:
        DISCONNECTED, and the streams are released.
        """
        job, keep = self.make_job(op, rows, cols, **job_args)
        if stream is None:
            stream = _current_stream_of(keep) or 0
        self.enqueue_job(job, stream=stream)

    def enqueue_job(self, job, *, stream=0):
        """Enqueues a prepared NcJob (see make_job and enqueue()) on `stream`."""
        check(self._lib.nc_job_enqueue(self._handle(), ctypes.byref(job),
                                       ctypes.c_void_p(int(stream or 0))))

    def _enqueue_device(self, job, ptrs, stream):
        """Enqueues `job` with CUDA tensors given as device pointers, in one library call.

        ptrs: _lib.pack_device_pointers() of one device pointer per role of
        _lib.TENSOR_ROLES, in that order (0: the job's own tensor there,
        usually absent); stream: a cudaStream_t as an int. For
        normd.normalization, whose callers have checked the tensors' dtypes,
        sizes, contiguity and devices; the library checks regions and bounds
        (nc_job_enqueue_device). Errors as enqueue()'s.
        """
        conn = self._conn
        handle = conn.handle
        if handle is None or conn.pid != _pid:
            handle = conn.checked_handle()  # raises the closed / forked-child error
        rc = self._enqueue_device_call(handle, job, ptrs, stream)
        if rc:
            raise enqueue_device_error(rc, _lib.text(self._lib.nc_last_error()))

    def _enqueue_device_ext(self, job, ext, ptrs, stream):
        """_enqueue_device() of a job with variants (nc_job_enqueue_device_ext).

        ext: an NcJobExt without tensors; ptrs: _lib.pack_all_device_pointers()
        of one device pointer per role of _lib.TENSOR_ROLES and then
        _lib.EXT_TENSOR_ROLES. Errors as enqueue()'s.
        """
        conn = self._conn
        handle = conn.handle
        if handle is None or conn.pid != _pid:
            handle = conn.checked_handle()  # raises the closed / forked-child error
        rc = self._lib.nc_job_enqueue_device_ext(handle, job, ext, ptrs, stream)
        if rc:
            raise enqueue_device_error(rc, _lib.text(self._lib.nc_last_error()))

    def check(self, timeout_ms=None):
        """Collects the enqueue mode's asynchronous errors (nc_conn_check).

        Waits at most timeout_ms (default: the client's timeout; negative: no
        limit) until the daemon has answered every job enqueued so far on
        this connection, then raises NormdError for the first error not yet
        reported (each is reported once), DISCONNECTED or TIMEOUT. The
        daemon answers a job when the caller's stream has reached it, so
        call it after synchronizing the streams (e.g.
        ``torch.cuda.synchronize()``), or with a short timeout.
        """
        timeout = self.timeout_ms if timeout_ms is None else int(timeout_ms)
        check(self._lib.nc_conn_check(self._handle(), timeout))

    def stream_wait(self, stream=0, timeout_ms=None):
        """Waits on the host until every job enqueued on `stream` has completed.

        stream: the cudaStream_t (as an int) or CPU-backend key that
        enqueue() was given (0: the legacy default stream / key 0). CUDA: until
        the stream is idle. Then raises as check() does (nc_stream_wait).
        timeout_ms: default the client's timeout; negative: no limit.
        """
        timeout = self.timeout_ms if timeout_ms is None else int(timeout_ms)
        check(self._lib.nc_stream_wait(self._handle(), ctypes.c_void_p(int(stream or 0)),
                                       timeout))

    def submit(self, op, rows, cols, **job_args):
        """Sends a job without waiting; returns a PendingJob to wait() on.

        Nothing orders the job with CUDA streams: for device memory prefer
        run(), which orders it after the current stream's work.
        """
        job, keep = self.make_job(op, rows, cols, **job_args)
        request_id = ctypes.c_uint64()
        check(self._lib.nc_job_submit(self._handle(), ctypes.byref(job),
                                      ctypes.byref(request_id)))
        return PendingJob(self, request_id.value, keep)


_UNSUPPORTED = _lib.STATUS_CODES["UNSUPPORTED"]

# Jobs without tensors by their fields; read-only once made, so threads share them.
_norm_jobs = {}
_NORM_JOBS_MAX = 1024


def enqueue_device_error(rc, message):
    """The NormdError of a failed nc_job_enqueue_device (Python or the compiled eager path)."""
    # The library names a tensor it could not register: "tensor x: pointer ...".
    if rc == _UNSUPPORTED and message.startswith("tensor "):
        message += _EXPANDABLE_HINT
    return NormdError(rc, message)


def norm_job(op, rows, cols, eps, dtype, weight_dtype, flags):
    """A struct nc_job of a LayerNorm/RMSNorm op without tensors, made once per shape.

    All arguments are plain ints (eps a float, 0 for the daemon's default).
    The job must not be changed: calls with the same arguments share it.
    """
    key = (op, rows, cols, eps, dtype, weight_dtype, flags)
    job = _norm_jobs.get(key)
    if job is None:
        if len(_norm_jobs) >= _NORM_JOBS_MAX:
            _norm_jobs.clear()  # many shapes (dynamic batch sizes): start over
        job = _lib.NcJob(op=op, rows=rows, cols=cols, eps=eps, dtype=dtype,
                         weight_dtype=weight_dtype, flags=flags)
        _norm_jobs[key] = job
    return job


def _current_stream_of(objects):
    """torch's current stream (as an int) for the first CUDA tensor among objects, or None."""
    for obj in objects:
        if _is_torch_tensor(obj) and obj.is_cuda:
            import torch

            return torch.cuda.current_stream(obj.device).cuda_stream
    return None


def latency_quantile_us(buckets, quantile):
    """nc_latency_quantile_us over a stats latency histogram (a list of 32 counts)."""
    array = (ctypes.c_uint64 * _lib.LATENCY_BUCKETS)(*buckets)
    return _lib.load().nc_latency_quantile_us(array, float(quantile))


# ---- the completion mode of normd.normalization --------------------------------------

_completion = None  # set_completion_mode()'s choice; None: $NORMD_COMPLETION
_completion_lock = threading.Lock()

# os.environ.get costs a key encoding and a value decoding at every call: the
# variable is read from os.environ's own storage (the same values) and parsed
# again only when that value object changes.
_environ_store = getattr(os.environ, "_data", None)
if isinstance(_environ_store, dict) and hasattr(os.environ, "encodekey") and \
        hasattr(os.environ, "decodevalue"):
    _COMPLETION_KEY = os.environ.encodekey("NORMD_COMPLETION")
    _environ_raw, _environ_text = _environ_store.get, os.environ.decodevalue
else:
    _COMPLETION_KEY = "NORMD_COMPLETION"
    _environ_raw, _environ_text = os.environ.get, str
_completion_env = (None, DEFAULT_COMPLETION)  # (the value last parsed, its mode)


def _checked_mode(mode, what):
    name = str(mode).strip().lower()
    if name not in COMPLETION_MODES:
        raise ValueError("%s=%r: the completion mode is one of %s"
                         % (what, mode, ", ".join(COMPLETION_MODES)))
    return name


def completion_mode():
    """How normd.normalization completes jobs on CUDA tensors: "enqueue", "sync" or "event".

    - "enqueue" (the default): nc_job_enqueue on the current stream; the call
      returns once the job is sent and the job runs in stream order, as a
      CUDA kernel would. A job the daemon refuses later fills its outputs
      with NaN and its error is raised by a later call (or Client.check()).
    - "sync": nc_job_run_on_stream; the call waits for the job (it
      synchronizes the current stream first).
    - "event": nc_job_run_event; interprocess CUDA events order the job
      with the current stream and the call returns once it is queued.

    set_completion_mode() decides for this process; until it is called (or
    after set_completion_mode(None)) $NORMD_COMPLETION does, read at each
    call. ValueError for any other value.
    """
    if _completion is not None:
        return _completion
    global _completion_env
    raw = _environ_raw(_COMPLETION_KEY)
    seen, mode = _completion_env
    if raw is seen:
        return mode
    env = "" if raw is None else _environ_text(raw).strip()
    mode = _checked_mode(env, "NORMD_COMPLETION") if env else DEFAULT_COMPLETION
    _completion_env = (raw, mode)
    return mode


def set_completion_mode(mode):
    """Sets the completion mode of this process (None: back to $NORMD_COMPLETION).

    Returns the previous setting (None if there was none), so that
    ``old = set_completion_mode("sync"); ...; set_completion_mode(old)``
    restores it.
    """
    global _completion
    new = None if mode is None else _checked_mode(mode, "completion mode")
    with _completion_lock:  # the setting and what normd.eager is told, in one order
        old, _completion = _completion, new
        if _eager_listener is not None:
            _eager_listener("mode", new)
    return old


#: normd.eager's, once its operator is loaded: told of a new completion-mode
#: setting ("mode", the mode or None) and of a new default client ("default", None).
_eager_listener = None


# ---- clients by key (normd.normalization's torch.library ops) --------------------

_client_keys = itertools.count(1)  # 0 names the default client
_clients = weakref.WeakValueDictionary()


def client_by_key(key):
    """The Client whose ``_key`` is `key`; 0 (or None) gives default_client()."""
    if not key:
        return default_client()
    client = _clients.get(int(key))
    if client is None:
        raise NormdError(_lib.STATUS_CODES["INVALID_ARGUMENT"],
                         "normd.Client #%d no longer exists (it was garbage collected); "
                         "keep a reference to the client a module uses" % key)
    return client


# ---- the default client ----------------------------------------------------------

_default_lock = threading.Lock()
_default = None


def default_client():
    """The process's shared Client, connected on first use.

    It connects to $NORMD_SOCKET (default /run/normd/0.sock). A forked
    child gets a fresh connection of its own. normd.normalization uses it.
    """
    global _default
    client = _default
    if client is not None and client._conn.handle is not None and client._conn.pid == _pid:
        return client  # the common case, without the lock
    with _default_lock:
        if _default is None or _default.closed or _default._conn.pid != _pid:
            _default = Client(name="python-default:%d" % _pid)
            if _eager_listener is not None:
                _eager_listener("default", None)
        return _default


def set_default_client(client):
    """Makes `client` the default (None: connect anew on next use); returns the old one."""
    global _default
    with _default_lock:
        old, _default = _default, client
        if _eager_listener is not None:
            _eager_listener("default", None)
        return old
