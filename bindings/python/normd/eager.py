"""The compiled eager path of normd.normalization (csrc/eager_norm.cpp).

In the enqueue mode an eager LayerNorm or RMSNorm call costs its caller's
CPU about what PyTorch's own ``F.layer_norm`` does only when the autograd
node, the output allocation and the job's encoding happen in C++: a Python
``torch.autograd.Function`` alone costs half of ``F.layer_norm``. So
normd.normalization calls one PyTorch operator, ``torch.ops.normd_eager.norm``,
whose autograd is C++ and which calls libnormclient's
``nc_job_enqueue_device`` itself (through the function pointers of the
library the package loaded, so the operator links nothing of normd's).

PyTorch's operator API is C++ only, and a compiled operator is tied to the
torch it was built against, so the source ships with the package and is
compiled on first use against the torch that is imported (a C++17 compiler,
``$CXX`` or ``c++``, and torch's headers, which its wheels carry; no Python
headers). The build takes about 20-60 s once and is kept in
``$NORMD_CACHE_DIR`` (default ``$XDG_CACHE_HOME/normd`` or ``~/.cache/normd``)
under a key of the source, the header, torch's version and the compiler.
``python3 -m normd.eager`` builds it ahead of time and says where.

The same file gives normd's torch.library ops (normalization/custom_ops.py,
what torch.compile calls) C++ kernels for CUDA tensors, which run the
enqueue mode's common case and hand every other call to the ops' Python
implementation.

``NORMD_EAGER=1`` turns it on. It is off by default until it has passed
the GPU tests (tests/gpu/run.sh runs test_python.py both ways; it was
written in a session without GPU time). Where it cannot be built or
loaded, normd warns once and the Python path runs instead (``status()``
says why).
Everything the operator does not take (other completion modes, mixed
dtypes, CPU tensors, autocast, torch.compile, any argument the Python path
would refuse or convert) goes to the Python path as before, which also
raises the errors.
"""

import contextlib
import ctypes
import fcntl
import hashlib
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

from . import _lib

_HERE = Path(__file__).resolve().parent
SOURCE = _HERE / "csrc" / "eager_norm.cpp"
_HEADER_NAME = "normclient.h"

_lock = threading.Lock()
_state = {"op": None, "tried": False, "why": "not tried yet", "path": None}
_ERROR = re.compile(r"normd error (-?\d+) \([A-Z_?]+\): (.*)", re.S)
_FALLBACK = "normd-eager fallback: "


def _header_dir():
    """Where normclient.h is: beside the source in a wheel, client/include in the tree."""
    for d in (SOURCE.parent, _HERE.parents[2] / "client" / "include"):
        if (d / _HEADER_NAME).is_file():
            return d
    raise FileNotFoundError("%s is neither in %s nor in the source tree"
                            % (_HEADER_NAME, SOURCE.parent))


def cache_dir():
    """The directory the built operator is kept in."""
    base = os.environ.get("NORMD_CACHE_DIR")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                               ".cache")
        base = os.path.join(xdg, "normd")
    return Path(base)


def _compiler():
    return os.environ.get("CXX") or "c++"


def _build_command(torch, header_dir, out):
    # torch's headers and libraries as its wheels lay them out (what
    # torch.utils.cpp_extension would find, without importing it).
    root = os.path.dirname(torch.__file__)
    lib_dir = os.path.join(root, "lib")
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    return [_compiler(), "-O2", "-std=c++17", "-shared", "-fPIC",
            "-D_GLIBCXX_USE_CXX11_ABI=%d" % abi, "-isystem" + os.path.join(root, "include"),
            "-I" + str(header_dir), str(SOURCE), "-o", str(out), "-L" + lib_dir, "-lc10",
            "-ltorch", "-ltorch_cpu", "-Wl,-rpath," + lib_dir]


def _identity(path):
    """A file's path, size and modification time (a reinstall changes them), or its name."""
    found = shutil.which(path) if os.sep not in path else path
    try:
        st = os.stat(found)
    except (OSError, TypeError):
        return path
    return "%s:%d:%d" % (os.path.realpath(found), st.st_size, st.st_mtime_ns)


def _library_path(torch):
    """The built operator's path: a key of the source, header, command, torch and compiler."""
    header_dir = _header_dir()
    libtorch = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), (header_dir / _HEADER_NAME).read_bytes(),
                 " ".join(_build_command(torch, header_dir, "OUT")), torch.__version__,
                 str(getattr(torch.version, "git_version", "")), _identity(libtorch),
                 _identity(_compiler()), sys.platform):
        key.update(part if isinstance(part, bytes) else part.encode())
        key.update(b"\0")
    return cache_dir() / ("normd_eager-%s.so" % key.hexdigest()[:16]), header_dir


def build(verbose=False):
    """Compiles the operator unless the cache has it; returns its path.

    Raises RuntimeError with the compiler's output when the build fails.
    Several processes may build at once: one does, under a lock file.
    """
    import torch

    path, header_dir = _library_path(torch)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():
            return path
        fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
        os.close(fd)
        try:
            cmd = _build_command(torch, header_dir, tmp)
            if verbose:
                print(" ".join(cmd), file=sys.stderr)
            done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
            if done.returncode != 0:
                raise RuntimeError("building %s failed (exit %d):\n%s"
                                   % (SOURCE.name, done.returncode, done.stdout[-4000:]))
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path


def _address(function):
    return ctypes.cast(function, ctypes.c_void_p).value


def _load(host_tensors=False):
    import torch

    path = build()
    torch.ops.load_library(str(path))
    lib = _lib.load()
    torch.ops.normd_eager.bind(_address(lib.nc_job_enqueue_device),
                               _address(lib.nc_last_error), _address(lib.nc_status_name),
                               host_tensors)
    _state["path"] = path
    from . import client

    with client._completion_lock:
        client._eager_listener = _listener
        _listener("mode", client._completion)
    # The overload's C++ callable: OpOverload.__call__ is one Python frame more.
    return torch.ops.normd_eager.norm.default._op


def _listener(what, value):
    """What normd.client tells the operator (its kernels of the torch.library ops)."""
    import torch

    if what == "mode":
        torch.ops.normd_eager.completion_mode(value or "")
    elif what == "default":
        torch.ops.normd_eager.client_key(0, 0)  # relearned from the next Python call


def bind_key(key, client):
    """Tells the operator's kernels which connection a client key (0: the default) names."""
    import torch

    from . import client as client_module

    handle = conn_key(client._conn)
    if key:
        torch.ops.normd_eager.client_key(int(key), handle)
        return
    # Under the lock that set_default_client takes to tell us of a new default:
    # a client set aside meanwhile is never bound.
    with client_module._default_lock:
        if client_module._default is client:
            torch.ops.normd_eager.client_key(0, handle)


def norm_op(host_tensors=False):
    """The operator (a callable), or None where it is off or cannot be built.

    host_tensors: host tensors pass for device ones (the no-GPU stub of
    bench/bench_host_path.py, whose library calls do nothing).
    """
    if _state["tried"]:
        return _state["op"]
    with _lock:
        if _state["tried"]:
            return _state["op"]
        if os.environ.get("NORMD_EAGER", "0").strip() != "1":
            _state["why"] = "off (NORMD_EAGER=1 turns it on)"
        else:
            try:
                _state["op"] = _load(host_tensors)
                _state["why"] = "loaded from %s" % _state["path"]
            except Exception as e:  # noqa: BLE001 - any failure means the Python path
                _state["why"] = "cannot be used: %s" % e
                warnings.warn("normd: the compiled eager path %s; normd.normalization "
                              "runs its Python path instead (slower per call)"
                              % _state["why"], RuntimeWarning, stacklevel=3)
        _state["tried"] = True
    return _state["op"]


def jobs():
    """Jobs the operator has enqueued in this process (0 while it is not loaded)."""
    if not _state["op"]:
        return 0
    import torch

    return int(torch.ops.normd_eager.jobs())


@contextlib.contextmanager
def paused():
    """Inside the block eager calls take the Python path (benchmarks time both paths)."""
    fln = importlib.import_module("normd.normalization.fused_layer_norm")
    saved, fln._eager_op = fln._eager_op, False
    try:
        yield
    finally:
        fln._eager_op = saved


def status():
    """One line: whether the compiled eager path is in use, and why not."""
    return "normd eager path: " + _state["why"]


def conn_key(conn):
    """The operator's key for a connection (normd.client._Conn), registered on first use."""
    if not conn.eager_bound:
        import torch

        torch.ops.normd_eager.conn_opened(conn.checked_handle())
        conn.eager_bound = True
    return conn.handle


def conn_closed(handle):
    """Before nc_close: the operator refuses the handle from now on."""
    import torch

    try:
        torch.ops.normd_eager.conn_closed(handle)
    except Exception:  # noqa: BLE001 - torch torn down at exit: nothing calls the operator
        if not sys.is_finalizing():
            raise


def error(exc):
    """What a RuntimeError from the operator means.

    Returns None (not the operator's), "fallback" (the Python path takes
    the call), or a NormdError for the library's refusal.
    """
    from .client import enqueue_device_error

    text = str(exc)
    if text.startswith(_FALLBACK):
        return "fallback"
    m = _ERROR.match(text)
    if m is None:
        return None
    message = m.group(2).split("\nException raised from")[0].strip()
    return enqueue_device_error(int(m.group(1)), message)


if __name__ == "__main__":
    print(build(verbose=True))
