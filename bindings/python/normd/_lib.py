"""The ctypes layer: finding and loading libnormclient, and mirrors of its C types.

Everything here follows ``client/include/normclient.h`` field for field; the
test ``tests/python/test_layout.py`` compiles a probe against that header and
checks every size and offset below, so a change to the header that is not
mirrored here fails the tests instead of corrupting memory.

Where the library is looked for, in order:

1. ``$NORMD_LIBRARY``: a path to ``libnormclient.so`` (or any name the
   dynamic loader accepts).
2. The copy the wheel carries (``make wheel``), beside this file:
   ``normd/libnormclient.so.0`` (protobuf-c and the CUDA runtime linked in).
3. The build tree next to this package when it runs from the source tree:
   ``<repository>/build/lib/libnormclient.so``.
4. ``ctypes.util.find_library("normclient")`` (the ldconfig cache, e.g. after
   ``make install`` and ``ldconfig``).
5. ``libnormclient.so.0`` through the dynamic loader's own search
   (``LD_LIBRARY_PATH``, the default directories).

On a host without Debian's ``libprotobuf-c.so.1`` (the library's one shared
dependency), a copy next to the library or in ``gpu-host/`` beside it is
loaded first.
"""

import ctypes
import ctypes.util
import enum
import os
import struct
import threading
from pathlib import Path

# ---- the status table (NC_STATUS_MAP) ------------------------------------------

#: Status name -> the library's (negative) code, as in NC_STATUS_MAP.
STATUS_CODES = {
    "OK": 0,
    "INVALID_ARGUMENT": -1,
    "OUT_OF_RANGE": -2,
    "NOT_FOUND": -3,
    "ALREADY_EXISTS": -4,
    "RESOURCE_EXHAUSTED": -5,
    "UNSUPPORTED": -6,
    "PROTOCOL_ERROR": -7,
    "SHUTTING_DOWN": -8,
    "DEVICE_ERROR": -9,
    "INTERNAL": -10,
    "IO": -100,
    "TIMEOUT": -101,
    "NOMEM": -102,
    "DISCONNECTED": -103,  # the enqueue mode: the daemon died or dropped the connection
}


class Op(enum.IntEnum):
    """enum nc_op."""

    LAYERNORM_FWD = 1
    LAYERNORM_BWD = 2
    RMSNORM_FWD = 3
    RMSNORM_BWD = 4
    WGRAD_ACCUM = 5


class DType(enum.IntEnum):
    """enum nc_dtype. bf16 data lives in numpy as uint16 (see normd.host)."""

    F32 = 1
    F16 = 2
    BF16 = 3
    F8E4M3 = 4  # FP8 (OCP) for NcJobExt.y_dtype only: max 448, no infinities
    F8E5M2 = 5  # FP8 (OCP) for NcJobExt.y_dtype only: max finite 57344


# enum nc_job_flags
MEMORY_EFFICIENT = 1 << 0
ACCUMULATE = 1 << 1
OVERWRITE = 1 << 2

STATS_OPS = 8
STATS_DEVICES = 17
LATENCY_BUCKETS = 32

# ---- structures --------------------------------------------------------------
# C enums are int, `unsigned` is c_uint, bool is c_bool (one byte on x86-64).


class NcTensor(ctypes.Structure):
    """struct nc_tensor: a byte offset into a registered region (region 0: absent)."""

    _fields_ = [("region", ctypes.c_uint64), ("offset", ctypes.c_uint64)]

    def __repr__(self):
        return "NcTensor(region=%d, offset=%d)" % (self.region, self.offset)


class NcJob(ctypes.Structure):
    """struct nc_job."""

    _fields_ = [
        ("op", ctypes.c_int),
        ("rows", ctypes.c_uint64),
        ("cols", ctypes.c_uint64),
        ("eps", ctypes.c_float),
        ("dtype", ctypes.c_int),
        ("weight_dtype", ctypes.c_int),
        ("flags", ctypes.c_uint),
        ("deadline_us", ctypes.c_uint64),
        ("x", NcTensor),
        ("y", NcTensor),
        ("mean", NcTensor),
        ("rstd", NcTensor),
        ("gamma", NcTensor),
        ("beta", NcTensor),
        ("dy", NcTensor),
        ("dx", NcTensor),
        ("dgamma", NcTensor),
        ("dbeta", NcTensor),
        ("out_features", ctypes.c_uint64),
        ("main_grad", NcTensor),
    ]


#: The tensor fields of struct nc_job, in declaration order.
TENSOR_ROLES = ("x", "y", "mean", "rstd", "gamma", "beta", "dy", "dx", "dgamma", "dbeta",
                "main_grad")

#: NC_JOB_TENSORS: one device pointer per role for nc_job_enqueue_device.
JOB_TENSORS = len(TENSOR_ROLES)

#: pack_device_pointers(x, y, ..., main_grad) -> the bytes of nc_job_enqueue_device's
#: `const void *ptrs[NC_JOB_TENSORS]` (ints, 0 for NULL): cheaper than a ctypes array.
pack_device_pointers = struct.Struct("@%dP" % JOB_TENSORS).pack


class NcJobResult(ctypes.Structure):
    """struct nc_job_result."""

    _fields_ = [
        ("status", ctypes.c_int),
        ("clamped_cols", ctypes.c_uint32),
        ("device_us", ctypes.c_uint64),
        ("queue_us", ctypes.c_uint64),
        ("variant", ctypes.c_char * 64),
        ("message", ctypes.c_char * 256),
    ]


class NcServerInfo(ctypes.Structure):
    """struct nc_server_info."""

    _fields_ = [
        ("version", ctypes.c_char * 32),
        ("backend", ctypes.c_char * 16),
        ("server_pid", ctypes.c_uint32),
        ("max_frame", ctypes.c_uint32),
        ("max_regions", ctypes.c_uint32),
        ("max_jobs_in_flight", ctypes.c_uint32),
        ("max_mapped_bytes", ctypes.c_uint64),
        ("device_count", ctypes.c_uint32),
        ("device_index", ctypes.c_int * 16),
        ("mps", ctypes.c_bool),  # the daemon's CUDA contexts run under NVIDIA MPS
    ]


class NcOpStats(ctypes.Structure):
    """struct nc_op_stats."""

    _fields_ = [
        ("jobs_by_status", ctypes.c_uint64 * 16),
        ("bytes", ctypes.c_uint64),
        ("device_us", ctypes.c_uint64),
        ("latency_us_sum", ctypes.c_uint64),
        ("latency_buckets", ctypes.c_uint64 * LATENCY_BUCKETS),
    ]


class NcDeviceStats(ctypes.Structure):
    """struct nc_device_stats."""

    _fields_ = [
        ("index", ctypes.c_int32),
        ("jobs_ok", ctypes.c_uint64),
        ("jobs_failed", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
        ("busy_us", ctypes.c_uint64),
        ("has_variant_cache", ctypes.c_bool),
        ("variant_cache_hits", ctypes.c_uint64),
        ("variant_cache_misses", ctypes.c_uint64),
    ]


class NcLimits(ctypes.Structure):
    """struct nc_limits."""

    _fields_ = [
        ("max_clients", ctypes.c_uint32),
        ("max_frame", ctypes.c_uint32),
        ("max_regions", ctypes.c_uint32),
        ("max_jobs_in_flight", ctypes.c_uint32),
        ("max_mapped_bytes", ctypes.c_uint64),
        ("max_output_bytes", ctypes.c_uint64),
        ("max_cols", ctypes.c_uint64),
    ]


class NcStats(ctypes.Structure):
    """struct nc_stats."""

    _fields_ = [
        ("uptime_ms", ctypes.c_uint64),
        ("clients", ctypes.c_uint32),
        ("clients_total", ctypes.c_uint64),
        ("jobs_ok", ctypes.c_uint64),
        ("jobs_failed", ctypes.c_uint64),
        ("jobs_in_flight", ctypes.c_uint32),
        ("regions", ctypes.c_uint32),
        ("mapped_bytes", ctypes.c_uint64),
        ("rss_bytes", ctypes.c_uint64),
        ("bytes_processed", ctypes.c_uint64),
        ("errors_by_status", ctypes.c_uint64 * 16),
        ("backend", ctypes.c_char * 16),
        ("has_mps", ctypes.c_bool),  # CUDA backend: `mps` is reported
        ("mps", ctypes.c_bool),      # its contexts run under NVIDIA MPS
        ("ops", NcOpStats * STATS_OPS),
        ("device_count", ctypes.c_uint32),
        ("devices", NcDeviceStats * STATS_DEVICES),
        ("rejections", ctypes.c_uint64 * 32),  # by enum nc_reject_reason
        ("limits", NcLimits),
        ("heap_bytes", ctypes.c_uint64),  # last: added after the rest
    ]


class NcVariantInfo(ctypes.Structure):
    """struct nc_variant_info."""

    _fields_ = [
        ("device", ctypes.c_int),
        ("op", ctypes.c_int),
        ("dtype", ctypes.c_int),
        ("weight_dtype", ctypes.c_int),
        ("flags", ctypes.c_uint),
        ("cols", ctypes.c_uint64),
        ("variant", ctypes.c_char * 48),
        ("source", ctypes.c_char * 12),
        ("uses", ctypes.c_uint64),
    ]


#: Every mirrored structure, by its C name (the layout test walks this).
STRUCTS = {
    "nc_tensor": NcTensor,
    "nc_job": NcJob,
    "nc_job_result": NcJobResult,
    "nc_server_info": NcServerInfo,
    "nc_op_stats": NcOpStats,
    "nc_device_stats": NcDeviceStats,
    "nc_limits": NcLimits,
    "nc_stats": NcStats,
    "nc_variant_info": NcVariantInfo,
}

# ---- prototypes ----------------------------------------------------------------

_c_int, _c_void_p, _c_char_p = ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p
_out_ptr = ctypes.POINTER(ctypes.c_void_p)

# name: (restype, argtypes)
_PROTOTYPES = {
    "nc_strerror": (_c_char_p, [_c_int]),
    "nc_status_name": (_c_char_p, [_c_int]),
    "nc_last_error": (_c_char_p, []),
    "nc_connect": (_c_int, [_c_char_p, _c_char_p, _c_int, _out_ptr]),
    "nc_close": (None, [_c_void_p]),
    "nc_server_info": (ctypes.POINTER(NcServerInfo), [_c_void_p]),
    "nc_ping": (_c_int, [_c_void_p, _c_int]),
    "nc_region_alloc_host": (_c_int, [_c_void_p, ctypes.c_size_t, _out_ptr]),
    "nc_region_register_fd": (_c_int, [_c_void_p, _c_int, ctypes.c_size_t, _out_ptr]),
    "nc_region_free": (_c_int, [_c_void_p]),
    "nc_region_register_device": (_c_int, [_c_void_p, _c_void_p, _out_ptr]),
    "nc_region_register_device_range": (_c_int, [_c_void_p, _c_void_p, ctypes.c_size_t,
                                                 _out_ptr]),
    "nc_region_data": (_c_void_p, [_c_void_p]),
    "nc_region_size": (ctypes.c_size_t, [_c_void_p]),
    "nc_region_id": (ctypes.c_uint64, [_c_void_p]),
    "nc_tensor_at": (NcTensor, [_c_void_p, _c_void_p]),
    "nc_tensor_device": (_c_int, [_c_void_p, _c_void_p, ctypes.POINTER(NcTensor)]),
    "nc_tensor_device_range": (_c_int, [_c_void_p, _c_void_p, ctypes.c_size_t,
                                        ctypes.POINTER(NcTensor)]),
    "nc_job_submit": (_c_int, [_c_void_p, ctypes.POINTER(NcJob), ctypes.POINTER(ctypes.c_uint64)]),
    "nc_job_wait": (_c_int, [_c_void_p, ctypes.c_uint64, _c_int, ctypes.POINTER(NcJobResult)]),
    "nc_job_run": (_c_int, [_c_void_p, ctypes.POINTER(NcJob), _c_int, ctypes.POINTER(NcJobResult)]),
    "nc_job_run_on_stream": (_c_int, [_c_void_p, ctypes.POINTER(NcJob), _c_void_p, _c_int,
                                      ctypes.POINTER(NcJobResult)]),
    "nc_job_run_event": (_c_int, [_c_void_p, ctypes.POINTER(NcJob), _c_void_p, _c_int,
                                  ctypes.POINTER(NcJobResult)]),
    # The enqueue mode (docs/ENQUEUE.md).
    "nc_job_enqueue": (_c_int, [_c_void_p, ctypes.POINTER(NcJob), _c_void_p]),
    # ptrs: the bytes of pack_device_pointers (or a ctypes array of c_void_p).
    "nc_job_enqueue_device": (_c_int, [_c_void_p, ctypes.POINTER(NcJob), _c_void_p, _c_void_p]),
    "nc_conn_check": (_c_int, [_c_void_p, _c_int]),
    "nc_stream_wait": (_c_int, [_c_void_p, _c_void_p, _c_int]),
    "nc_stats_get": (_c_int, [_c_void_p, _c_int, ctypes.POINTER(NcStats)]),
    "nc_latency_quantile_us": (ctypes.c_double, [ctypes.POINTER(ctypes.c_uint64), ctypes.c_double]),
    "nc_variants_get": (_c_int, [_c_void_p, _c_int, ctypes.POINTER(ctypes.POINTER(NcVariantInfo)),
                                 ctypes.POINTER(ctypes.c_size_t)]),
    "nc_variants_free": (None, [ctypes.POINTER(NcVariantInfo)]),
}

# ---- the norm variants (protocol 3; docs/VARIANTS.md, normd.job_ext) --------------


class NcJobExt(ctypes.Structure):
    """struct nc_job_ext: a job's variants, given beside struct nc_job to the *_ext calls.

    A zeroed struct is the plain norm: residual add (residual, residual_out;
    ds in a backward), weight_offset (1.0: zero-centered gamma), FP8 output
    (y_dtype F8E4M3/F8E5M2 with scale, amax optional). reserved stays zero.
    """

    _fields_ = [
        ("residual", NcTensor),
        ("residual_out", NcTensor),
        ("ds", NcTensor),
        ("scale", NcTensor),
        ("amax", NcTensor),
        ("weight_offset", ctypes.c_float),
        ("y_dtype", ctypes.c_int),
        ("reserved", ctypes.c_uint64 * 4),
    ]


#: The tensor fields of struct nc_job_ext, in declaration order.
EXT_TENSOR_ROLES = ("residual", "residual_out", "ds", "scale", "amax")

# enum nc_norm_features: the variants a backend runs (nc_server_norm_features).
FEATURE_RESIDUAL = 1 << 0       # residual, residual_out, ds
FEATURE_WEIGHT_OFFSET = 1 << 1  # weight_offset
FEATURE_FP8_OUTPUT = 1 << 2     # y_dtype F8E4M3 / F8E5M2

STRUCTS["nc_job_ext"] = NcJobExt

#: NC_JOB_ALL_TENSORS: nc_job_enqueue_device_ext's pointers, struct nc_job's roles
#: (TENSOR_ROLES) and then struct nc_job_ext's (EXT_TENSOR_ROLES).
ALL_JOB_TENSORS = JOB_TENSORS + len(EXT_TENSOR_ROLES)

#: pack_all_device_pointers(x, ..., main_grad, residual, ..., amax): the bytes of
#: nc_job_enqueue_device_ext's `const void *ptrs[NC_JOB_ALL_TENSORS]` (0 for NULL).
pack_all_device_pointers = struct.Struct("@%dP" % ALL_JOB_TENSORS).pack

_ext_ptr = ctypes.POINTER(NcJobExt)
_PROTOTYPES.update({
    # ptrs: the bytes of pack_all_device_pointers.
    "nc_job_enqueue_device_ext": (_c_int, [_c_void_p, ctypes.POINTER(NcJob), _ext_ptr, _c_void_p,
                                           _c_void_p]),
    "nc_server_norm_features": (ctypes.c_uint32, [_c_void_p]),
    "nc_job_submit_ext": (_c_int, [_c_void_p, ctypes.POINTER(NcJob), _ext_ptr,
                                   ctypes.POINTER(ctypes.c_uint64)]),
    "nc_job_run_ext": (_c_int, [_c_void_p, ctypes.POINTER(NcJob), _ext_ptr, _c_int,
                                ctypes.POINTER(NcJobResult)]),
    "nc_job_run_on_stream_ext": (_c_int, [_c_void_p, ctypes.POINTER(NcJob), _ext_ptr, _c_void_p,
                                          _c_int, ctypes.POINTER(NcJobResult)]),
    "nc_job_run_event_ext": (_c_int, [_c_void_p, ctypes.POINTER(NcJob), _ext_ptr, _c_void_p,
                                      _c_int, ctypes.POINTER(NcJobResult)]),
    "nc_job_enqueue_ext": (_c_int, [_c_void_p, ctypes.POINTER(NcJob), _ext_ptr, _c_void_p]),
})

# ---- loading ---------------------------------------------------------------------

_lock = threading.Lock()
_lib = None
_lib_path = None


#: The library an installed wheel carries, beside this file (bindings/python/build_wheel.py).
BUNDLED_LIBRARY = "libnormclient.so.0"


def _bundled_library():
    """The wheel's own libnormclient.so.0 when this package was installed from it."""
    candidate = Path(__file__).resolve().with_name(BUNDLED_LIBRARY)
    return str(candidate) if candidate.exists() else None


def _source_tree_library():
    """<repository>/build/lib/libnormclient.so when this file is in the source tree."""
    here = Path(__file__).resolve()
    # <repo>/bindings/python/normd/_lib.py -> parents[3] is <repo>
    if len(here.parents) < 4:
        return None
    candidate = here.parents[3] / "build" / "lib" / "libnormclient.so"
    return str(candidate) if candidate.exists() else None


def _candidates():
    """(description, name-or-path) pairs in the order they are tried."""
    env = os.environ.get("NORMD_LIBRARY")
    if env:
        # An explicit choice is the only candidate: falling back silently
        # would hide a wrong path.
        return [("$NORMD_LIBRARY", env)]
    found = []
    bundled = _bundled_library()
    if bundled:
        found.append(("the library the wheel installed", bundled))
    tree = _source_tree_library()
    if tree:
        found.append(("the source tree's build", tree))
    system = ctypes.util.find_library("normclient")
    if system:
        found.append(("find_library('normclient')", system))
    found.append(("the dynamic loader's search path", "libnormclient.so.0"))
    return found


def _preload_protobuf_c(path):
    """Loads a libprotobuf-c.so.1 shipped beside `path`, if there is one."""
    folder = Path(path).parent
    for candidate in (folder / "libprotobuf-c.so.1", folder / "gpu-host" / "libprotobuf-c.so.1"):
        if candidate.exists():
            ctypes.CDLL(str(candidate), mode=ctypes.RTLD_GLOBAL)
            return True
    return False


def _open(path):
    try:
        return ctypes.CDLL(path)
    except OSError as err:
        if "libprotobuf-c" in str(err) and os.sep in path and _preload_protobuf_c(path):
            return ctypes.CDLL(path)
        raise


def _bind(lib):
    for name, (restype, argtypes) in _PROTOTYPES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


def load():
    """Returns the loaded libnormclient (loading it on first use).

    Raises OSError naming every place that was tried when none works.
    """
    global _lib, _lib_path
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        errors = []
        for what, path in _candidates():
            try:
                lib = _open(path)
            except OSError as err:
                errors.append("%s (%s): %s" % (what, path, err))
                continue
            _lib, _lib_path = _bind(lib), path
            return _lib
        raise OSError(
            "normd: cannot load libnormclient; tried:\n  " + "\n  ".join(errors) +
            "\nBuild it with `make` in the normd repository, or set NORMD_LIBRARY to the "
            "path of libnormclient.so")


def library_path():
    """The path (or name) libnormclient was loaded from, loading it if needed."""
    load()
    return _lib_path


def text(raw):
    """A C string from the library (bytes or None) as str."""
    return raw.decode("utf-8", "replace") if raw else ""
