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

A second operator, ``torch.ops.normd_eager.variant_norm``, does the same for
the residual add and the weight offset (normalization/variants.py's
FusedNormVariantFunction, job for job) through ``nc_job_enqueue_device_ext``;
it returns (y, s), s empty without residual.

The same file gives normd's torch.library ops (normalization/custom_ops.py,
what torch.compile calls) C++ kernels for CUDA tensors, which run the
enqueue mode's common case and hand every other call to the ops' Python
implementation.

It is on by default; ``NORMD_EAGER=0`` turns it off. A fresh build is
loaded only after a child process has seen it raise each of its errors as a
Python exception (``_self_test``); a build that fails is recorded and not
tried again. Where it cannot be built, loaded or trusted, normd warns once
(``NORMD_EAGER=0`` silences it) and the Python path runs instead
(``status()`` says why).
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
    _raise_recorded_failure(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():
            return path
        _raise_recorded_failure(path)
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
            _check_in_child(tmp, path)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path


def _failure_path(path):
    return path.with_suffix(".failed")


def _raise_recorded_failure(path):
    """A build whose self-test failed is not tried again (the key changes with the compiler)."""
    failed = _failure_path(path)
    if failed.is_file():
        raise RuntimeError(failed.read_text())


#: The child's command: _self_test on the freshly built library (argv[1]).
_CHILD_CODE = "import sys; from normd.eager import _self_test; _self_test(sys.argv[1])"


def _check_in_child(built, path):
    """Runs _self_test on the built library in a child process; a failure is recorded
    beside path and raised. A compiler whose code crashes when the operator raises an
    error (seen once on a GPU machine) must cost the Python path, never the process."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_HERE.parent), env.get("PYTHONPATH"))
                                        if p)
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD_CODE, str(built)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=300)
        if done.returncode == 0:
            return
        how, output = "exit %d" % done.returncode, done.stdout
    except subprocess.TimeoutExpired as e:
        how = "timed out after %d s" % e.timeout
        output = (e.output or b"").decode(errors="replace")  # bytes, text=True or not
    message = ("the built operator failed its self-test (%s; %s, built with %s; "
               "remove %s to try again):\n%s"
               % (how, built, _compiler(), _failure_path(path), output[-2000:]))
    _failure_path(path).write_text(message)
    raise RuntimeError(message)


def _self_test(built):
    """In a child process: the operator's errors reach Python as RuntimeErrors.

    Its library entry points are ctypes stand-ins, so no daemon is needed. The
    errors raised: a fallback, a closed client in forward, the library's
    refusal, and a closed client in backward, there from the main thread and
    from another (CUDA's backward runs on a thread of autograd's).
    """
    import torch

    torch.ops.load_library(built)
    ops = torch.ops.normd_eager
    answer = [0]
    enqueue = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_void_p)(lambda *args: answer[0])
    # The strings as addresses of buffers kept here (a c_char_p result would leak).
    texts = [ctypes.create_string_buffer(b"refused by the self-test"),
             ctypes.create_string_buffer(b"INVALID_ARGUMENT")]
    message = ctypes.CFUNCTYPE(ctypes.c_void_p)(lambda: ctypes.addressof(texts[0]))
    name = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_int)(lambda rc: ctypes.addressof(texts[1]))
    ops.bind(_address(enqueue), _address(message), _address(name), True)
    library_error = re.compile(r"normd error -?\d+ \(INVALID_ARGUMENT\): ")

    def expect(call, pattern):
        try:
            call()
        except RuntimeError as e:
            assert re.match(pattern, str(e)), "%r does not match %r" % (str(e)[:300], pattern)
        else:
            raise AssertionError("no error; expected %r" % pattern)

    x = torch.randn(4, 8, requires_grad=True)
    w = torch.ones(8, requires_grad=True)
    handle = 1

    def forward():
        return ops.norm(x, w, None, [8], 1e-5, True, False, handle)

    expect(lambda: ops.norm(x, w, None, [4], 1e-5, True, False, handle), re.escape(_FALLBACK))
    expect(forward, library_error)  # never opened
    ops.conn_opened(handle)
    answer[0] = 5
    expect(forward, library_error)
    answer[0] = 0
    outputs = [forward(), forward()]
    ops.conn_closed(handle)
    expect(lambda: outputs[0].sum().backward(), library_error)
    raised = []

    def backward_on_a_thread():
        try:
            expect(lambda: outputs[1].sum().backward(), library_error)
            raised.append(True)
        except AssertionError as e:
            raised.append(e)

    thread = threading.Thread(target=backward_on_a_thread)
    thread.start()
    thread.join()
    assert raised == [True], raised


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
    torch.ops.normd_eager.bind_variants(_address(lib.nc_job_enqueue_device_ext))
    _state["variant_op"] = torch.ops.normd_eager.variant_norm.default._op
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


def enabled():
    """Whether the operator is asked for: NORMD_EAGER unset or anything but 0."""
    return os.environ.get("NORMD_EAGER", "1").strip() != "0"


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
        if not enabled():
            _state["why"] = "off (NORMD_EAGER=0)"
        else:
            try:
                _state["op"] = _load(host_tensors)
                _state["why"] = "loaded from %s" % _state["path"]
            except Exception as e:  # noqa: BLE001 - any failure means the Python path
                _state["why"] = "cannot be used: %s" % e
                warnings.warn("normd: the compiled eager path %s; normd.normalization "
                              "runs its Python path instead (slower per call; "
                              "NORMD_EAGER=0 chooses it without this warning)"
                              % _state["why"], RuntimeWarning, stacklevel=3)
        _state["tried"] = True
    return _state["op"]


def variant_op():
    """The variants' operator (residual add, weight offset), or None where the operator is off."""
    return _state.get("variant_op") if norm_op() else None


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
