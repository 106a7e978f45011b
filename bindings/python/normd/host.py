"""Host memory shared with the daemon (CPU backend), and bf16 helpers for numpy.

A HostRegion is a memfd that this process maps with Python's ``mmap`` and
registers with the daemon (``nc_region_register_fd``), which maps the same
pages: numpy arrays built on it are read and written by jobs in place.

The Python mapping belongs to the region object and to every array made
from it, not to the daemon registration: ``free()`` unregisters the memory
from the daemon (later jobs naming it are refused with ``NOT_FOUND``) but
arrays already handed out stay valid Python memory until they are garbage
collected. No use of this module can make the process touch unmapped memory.

bf16 has no numpy dtype: bf16 data is held in ``uint16`` arrays (the bit
pattern), and ``to_bf16``/``from_bf16`` convert to and from float32.
"""

import ctypes
import fcntl
import mmap
import os

from . import _lib
from .errors import NormdError, check

#: Offsets of arrays carved from one region are aligned to this many bytes
#: (the daemon's fast paths want 16; 64 keeps rows on cache lines).
ALIGNMENT = 64


def _numpy():
    import numpy

    return numpy


def numpy_dtype(dtype):
    """The numpy storage dtype for any dtype spec normd accepts (bf16 -> uint16, FP8 -> uint8).

    Raises TypeError for dtypes normd does not compute in.
    """
    from .dtypes import to_dtype

    np = _numpy()
    if str(getattr(dtype, "name", dtype)) == "uint8":
        return np.dtype(np.uint8)  # FP8 bit patterns (either format)
    return {_lib.DType.F32: np.dtype(np.float32), _lib.DType.F16: np.dtype(np.float16),
            _lib.DType.BF16: np.dtype(np.uint16), _lib.DType.F8E4M3: np.dtype(np.uint8),
            _lib.DType.F8E5M2: np.dtype(np.uint8)}[to_dtype(dtype)]


class HostRegion:
    """Shared host memory registered with the daemon.

    Create one with ``Client.host_region(size)``. ``array()`` carves numpy
    arrays out of it, ``tensor()`` names a byte offset in a job, ``free()``
    (or leaving a ``with`` block) unregisters it.
    """

    def __init__(self, conn, size):
        if size <= 0:
            raise ValueError("a host region needs a positive size (got %r)" % (size,))
        # The connection's state (normd.client._Conn), not the Client: a
        # region must not keep its Client from being garbage collected.
        self._conn = conn
        self.size = int(size)
        fd = os.memfd_create("normd-python", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, self.size)
            # The daemon demands a memfd that cannot shrink under a running job.
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
            self._mmap = mmap.mmap(fd, self.size, mmap.MAP_SHARED,
                                   mmap.PROT_READ | mmap.PROT_WRITE)
            handle = ctypes.c_void_p()
            check(conn.lib.nc_region_register_fd(conn.checked_handle(), fd, self.size,
                                                 ctypes.byref(handle)))
        finally:
            os.close(fd)
        self._region = handle.value
        self.id = int(conn.lib.nc_region_id(self._region))
        # A ctypes view pins the mapping (mmap refuses to close while it is
        # exported) and gives its address.
        self._view = (ctypes.c_char * self.size).from_buffer(self._mmap)
        self.address = ctypes.addressof(self._view)
        self._next_offset = 0

    @property
    def freed(self):
        """True once the region is unregistered (free() or the client's close())."""
        return self._region is None

    @property
    def buffer(self):
        """A writable memoryview of the whole region."""
        return memoryview(self._mmap)

    def tensor(self, offset=0):
        """The job tensor naming `offset` bytes into this region.

        The offset is not checked here: the daemon checks every tensor
        against the region's size and refuses with ``OUT_OF_RANGE``.
        """
        return _lib.NcTensor(self.id, int(offset))

    def array(self, shape, dtype, offset=None):
        """A numpy array of `shape` and `dtype` at byte `offset` of this region.

        Without an offset the next free, ALIGNMENT-aligned bytes are used. A
        bf16 array is a uint16 array (``dtype="bf16"`` gives one). The array
        shares the region's memory: jobs write into it in place.
        """
        np = _numpy()
        store = numpy_dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
        count = 1
        for d in shape:
            count *= d
        nbytes = count * store.itemsize
        if offset is None:
            offset = -(-self._next_offset // ALIGNMENT) * ALIGNMENT
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError("%d bytes at offset %d do not fit in a %d-byte region"
                             % (nbytes, offset, self.size))
        self._next_offset = max(self._next_offset, offset + nbytes)
        return np.frombuffer(self._mmap, dtype=store, count=count, offset=offset).reshape(shape)

    def contains(self, address, nbytes):
        """Whether [address, address + nbytes) lies inside this region's mapping."""
        return self.address <= address and address + nbytes <= self.address + self.size

    def free(self):
        """Unregisters the region from the daemon. Idempotent.

        Jobs already submitted on it still complete (the daemon keeps its
        mapping until they end); later jobs naming it are refused with
        ``NOT_FOUND``. Arrays made from it stay readable here.
        """
        self._conn.free_region(self)

    def _release(self):
        """Frees the library's handle; returns its status. Called by the client."""
        region, self._region = self._region, None
        if region is None:
            return 0
        return self._conn.lib.nc_region_free(region)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()

    def __repr__(self):
        return "<normd.HostRegion id=%d size=%d%s>" % (self.id, self.size,
                                                      " freed" if self.freed else "")


# ---- bf16 ------------------------------------------------------------------------


def to_bf16(values):
    """float values -> bf16 bit patterns (uint16), rounding to nearest, ties to even.

    float64 input is first rounded to float32 (so a value can round twice).
    NaN stays NaN (quiet), infinities stay infinite, overflow rounds to infinity.
    """
    np = _numpy()
    given = np.asarray(values, dtype=np.float32)
    f = np.ascontiguousarray(given).reshape(-1)
    bits = f.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    out = rounded.astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        out[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
    return out.reshape(given.shape)


def from_bf16(bits):
    """bf16 bit patterns (uint16) -> float32 (exact)."""
    np = _numpy()
    b = np.asarray(bits, dtype=np.uint16)
    return (b.astype(np.uint32) << 16).view(np.float32).reshape(b.shape)


def host_error(message, status="NOT_FOUND"):
    """A NormdError raised by the binding itself (no library call failed)."""
    return NormdError(_lib.STATUS_CODES[status], message)
