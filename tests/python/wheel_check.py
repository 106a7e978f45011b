"""The installed wheel on its own (run by tests/python/test_wheel.sh inside a fresh venv).

    VENV/bin/python -I tests/python/wheel_check.py REPO NORMD_BIN TREE_LIBRARY

Run with -I and without $NORMD_LIBRARY: the package must come from the
venv's site-packages and load the library it carries, with nothing of the
repository on sys.path. Then, against `NORMD_BIN --device cpu` on a private
socket, a LayerNorm and an RMSNorm forward through the package's own API
(host regions filled with struct, no numpy), checked against a float64
reference computed here; then the error when $NORMD_SOCKET names no daemon,
and $NORMD_LIBRARY overriding the bundled library. Prints one "ok:" line per
check; the first failure raises.
"""

import array
import math
import os
import signal
import struct
import subprocess
import sys
import tempfile
import time

REPO, NORMD_BIN, TREE_LIBRARY = (os.path.realpath(a) for a in sys.argv[1:4])
ROWS, COLS, EPS = 5, 96, 1e-5


def ok(what):
    print("ok: " + what, flush=True)


def check_isolation():
    inside = [p for p in sys.path if p and os.path.realpath(p).startswith(REPO + os.sep)]
    assert not inside, "repository paths on sys.path: %s" % inside
    assert "NORMD_LIBRARY" not in os.environ


def check_bundled_library(normd):
    package = os.path.dirname(os.path.realpath(normd.__file__))
    assert package.startswith(os.path.realpath(sys.prefix) + os.sep), \
        "normd imported from %s, not from the venv %s" % (package, sys.prefix)
    bundled = os.path.join(package, "libnormclient.so.0")
    assert os.path.realpath(normd.library_path()) == bundled, normd.library_path()
    with open("/proc/self/maps") as maps:
        mapped = {line.split(None, 5)[5].strip() for line in maps if len(line.split(None, 5)) == 6}
    clients = {m for m in mapped if "libnormclient" in m}
    assert clients == {bundled}, "libnormclient mapped from %s" % sorted(clients)
    protobuf = [m for m in mapped if "libprotobuf-c" in m]
    assert not protobuf, "libprotobuf-c was loaded: %s" % protobuf
    return bundled


def start_daemon(folder):
    """NORMD_BIN --device cpu on folder/normd.sock; returns (process, socket) once it answers."""
    import normd

    sock = os.path.join(folder, "normd.sock")
    log = open(os.path.join(folder, "normd.log"), "wb")
    proc = subprocess.Popen([NORMD_BIN, "--config", "/dev/null", "--device", "cpu", "--socket",
                             sock, "--state-dir", folder], stdin=subprocess.DEVNULL,
                            stdout=log, stderr=log)
    log.close()
    deadline = time.monotonic() + 10
    while True:
        try:
            normd.Client(sock, timeout_ms=1000).close()
            return proc, sock
        except normd.NormdError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("normd did not start; its log:\n" + daemon_log(folder))
            time.sleep(0.02)


def daemon_log(folder):
    with open(os.path.join(folder, "normd.log"), errors="replace") as f:
        return f.read()


def reference(x, gamma, beta, rms):
    """The norm of each row in float64: LayerNorm (y, mean, rstd) or RMSNorm (y, rstd)."""
    y, means, rstds = [], [], []
    for r in range(ROWS):
        row = x[r * COLS:(r + 1) * COLS]
        mean = 0.0 if rms else math.fsum(row) / COLS
        var = math.fsum((v - mean) ** 2 for v in row) / COLS
        rstd = 1.0 / math.sqrt(var + EPS)
        y += [(v - mean) * rstd * g + (0.0 if rms else b) for v, g, b in zip(row, gamma, beta)]
        means.append(mean)
        rstds.append(rstd)
    return y, means, rstds


def f32(value):
    """value rounded to float32, so that the reference sees what the daemon sees."""
    return struct.unpack("f", struct.pack("f", value))[0]


def run_norm(client, op, rms):
    """One forward job on host-region tensors; returns (its error against reference(), result)."""
    x = [f32(3.0 * math.sin(0.37 * i) + 0.5) for i in range(ROWS * COLS)]
    gamma = [f32(1.0 + 0.01 * (i % 7)) for i in range(COLS)]
    beta = [f32(0.125 * (i % 5) - 0.25) for i in range(COLS)]
    sizes = {"x": ROWS * COLS, "y": ROWS * COLS, "mean": ROWS, "rstd": ROWS, "gamma": COLS,
             "beta": COLS}
    offsets, end = {}, 0
    for role, count in sizes.items():
        offsets[role] = end
        end += -(-count * 4 // 64) * 64
    region = client.host_region(end)
    floats = region.buffer.cast("f")
    for role, values in (("x", x), ("gamma", gamma), ("beta", beta)):
        start = offsets[role] // 4
        floats[start:start + len(values)] = array.array("f", values)
    tensors = {role: (region, offsets[role]) for role in sizes}
    if rms:
        del tensors["mean"], tensors["beta"]
    result = client.run(op, ROWS, COLS, dtype="f32", eps=EPS, **tensors)
    want_y, want_mean, want_rstd = reference(x, gamma, beta, rms)

    def got(role, count):
        start = offsets[role] // 4
        return list(floats[start:start + count])

    errors = [max(abs(a - b) for a, b in zip(got("y", ROWS * COLS), want_y)),
              max(abs(a - b) / b for a, b in zip(got("rstd", ROWS), want_rstd))]
    if not rms:
        errors.append(max(abs(a - b) for a, b in zip(got("mean", ROWS), want_mean)))
    floats.release()
    region.free()
    return max(errors), result


def check_jobs(normd, sock):
    with normd.Client(sock, name="wheel-check") as client:
        assert client.backend == "cpu", client.server_info
        for op, rms in (("LAYERNORM_FWD", False), ("RMSNORM_FWD", True)):
            err, result = run_norm(client, op, rms)
            assert err < 1e-5, "%s: max error %g against the float64 reference" % (op, err)
            ok("%s through the wheel's library matches the float64 reference (max error %.2g, "
               "variant %s)" % (op, err, result.variant))
        assert client.stats()["jobs_ok"] >= 2


def check_no_daemon(normd, folder):
    nowhere = os.path.join(folder, "nothing.sock")
    os.environ["NORMD_SOCKET"] = nowhere
    try:
        normd.Client(timeout_ms=2000)
    except normd.NormdError as err:
        assert err.status == "IO", str(err)
        text = str(err)
        assert nowhere in text and "is normd running on that socket?" in text, text
        assert "$NORMD_SOCKET" in text, text
        ok("$NORMD_SOCKET naming no daemon: " + text)
    else:
        raise AssertionError("normd.Client() connected to %s" % nowhere)
    finally:
        del os.environ["NORMD_SOCKET"]


def check_override():
    env = dict(os.environ, NORMD_LIBRARY=TREE_LIBRARY)
    out = subprocess.run([sys.executable, "-I", "-c", "import normd; print(normd.library_path())"],
                         env=env, capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == TREE_LIBRARY, out.stdout
    ok("$NORMD_LIBRARY still overrides the bundled library")


def check_eager_source(normd):
    """The eager operator's source and the header it includes, as normd.eager finds them."""
    from normd import eager

    package = os.path.dirname(os.path.realpath(normd.__file__))
    assert os.path.realpath(eager.SOURCE) == os.path.join(package, "csrc", "eager_norm.cpp")
    assert os.path.isfile(eager.SOURCE), "the wheel has no csrc/eager_norm.cpp"
    header = os.path.join(str(eager._header_dir()), "normclient.h")
    assert os.path.realpath(header) == os.path.join(package, "csrc", "normclient.h"), header
    with open(header, "rb") as got, open(os.path.join(REPO, "client", "include",
                                                      "normclient.h"), "rb") as want:
        assert got.read() == want.read(), "the wheel's normclient.h is not the tree's"
    return header


def main():
    check_isolation()
    import normd

    bundled = check_bundled_library(normd)
    ok("normd %s imported from the venv, library %s (no libprotobuf-c loaded)"
       % (normd.__version__, bundled))
    ok("the eager operator's source and %s are in the package" % check_eager_source(normd))
    # In the caller's private folder (the current directory), which it removes.
    folder = os.path.abspath(tempfile.mkdtemp(prefix="normd-wheel.", dir="."))
    proc, sock = start_daemon(folder)
    try:
        check_jobs(normd, sock)
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(15)
    assert rc == 0, "normd exited %s on SIGTERM; its log:\n%s" % (rc, daemon_log(folder))
    check_no_daemon(normd, folder)
    check_override()


if __name__ == "__main__":
    main()
