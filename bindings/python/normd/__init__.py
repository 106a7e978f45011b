"""normd: Python bindings for the normd normalization service.

A pure-Python (ctypes) layer over libnormclient:

- ``normd.Client``: a connection to the daemon; shared host memory as numpy
  arrays (CPU backend), CUDA torch tensors registered on first use, jobs.
- ``normd.normalization``: apex.normalization's modules and functions
  (FusedLayerNorm, FusedRMSNorm, fused_layer_norm_affine, ...) computed by
  the daemon. Importing it imports torch; nothing else in this package does.
- ``normd.NormdError``: every failure, with ``.status`` (the status name),
  ``.code`` and ``.message``.
- ``normd.set_completion_mode()`` / ``$NORMD_COMPLETION``: how
  normd.normalization completes jobs on CUDA tensors, "enqueue" (default),
  "sync" or "event" (see normd.completion_mode).

The library is found through $NORMD_LIBRARY, the copy an installed wheel
carries, the source tree's build/, or the system's library path (see
normd._lib); the daemon's socket through $NORMD_SOCKET (default
/run/normd/0.sock).
"""

import importlib

from ._lib import ACCUMULATE, MEMORY_EFFICIENT, OVERWRITE, DType, NcJob, NcTensor, Op
from ._lib import library_path
from .client import (COMPLETION_MODES, DEFAULT_SOCKET, Client, JobResult, PendingJob,
                     completion_mode, default_client, latency_quantile_us,
                     set_completion_mode, set_default_client)
from .errors import NormdError, status_name
from .host import HostRegion, from_bf16, to_bf16

__version__ = "0.1.0"

__all__ = [
    "ACCUMULATE", "COMPLETION_MODES", "Client", "DEFAULT_SOCKET", "DType", "HostRegion",
    "JobResult", "MEMORY_EFFICIENT", "NcJob", "NcTensor", "NormdError", "OVERWRITE", "Op",
    "PendingJob", "completion_mode", "default_client", "from_bf16", "latency_quantile_us",
    "library_path", "normalization", "set_completion_mode", "set_default_client",
    "status_name", "to_bf16",
]


def __getattr__(name):
    # normd.normalization needs torch: import it only when asked for.
    if name == "normalization":
        return importlib.import_module(".normalization", __name__)
    raise AttributeError("module 'normd' has no attribute %r" % name)
