"""Every job through the binding, against a numpy float64 reference.

Inputs are rounded to the job's dtype first, so the reference sees exactly
what the daemon sees; the daemon computes in float32 and rounds its outputs
to the dtype. Errors are measured against the largest reference value of
each output (max_abs_err / max|ref|) and held to a few units in the last
place of the output dtype.
"""

import numpy as np
import pytest

import normd

EPS = 1e-5

# Relative tolerance per output dtype: 2^-21 for float32 (the daemon sums in
# float32), about two ulps for float16 and bfloat16.
TOL = {"f32": 1e-5, "f16": 2e-3, "bf16": 1.6e-2}

# (x dtype, weight dtype): the three dtypes, and bf16/fp16 data with fp32
# weights (apex's "mixed" variants).
DTYPES = [("f32", "f32"), ("f16", "f16"), ("bf16", "bf16"), ("bf16", "f32"), ("f16", "f32")]
# (x dtype, weight dtype, affine): without weights only the plain dtypes.
CASES = [(d, w, True) for d, w in DTYPES] + [(d, d, False) for d in ("f32", "f16", "bf16")]
CASE_IDS = ["%s-%s-%s" % (d, w, "affine" if a else "plain") for d, w, a in CASES]
SHAPES = [(1, 1), (5, 33), (64, 1024)]


def quantize(values, dtype):
    """(storage array in dtype, its exact float64 values)."""
    if dtype == "f32":
        stored = np.asarray(values, dtype=np.float32)
        return stored, stored.astype(np.float64)
    if dtype == "f16":
        stored = np.asarray(values, dtype=np.float16)
        return stored, stored.astype(np.float64)
    stored = normd.to_bf16(values)
    return stored, normd.from_bf16(stored).astype(np.float64)


def as_float64(stored, dtype):
    return normd.from_bf16(stored).astype(np.float64) if dtype == "bf16" else \
        stored.astype(np.float64)


def assert_close(name, got, ref, dtype, factor=1.0):
    scale = max(1.0, float(np.max(np.abs(ref)))) if ref.size else 1.0
    err = float(np.max(np.abs(got - ref))) if ref.size else 0.0
    assert err <= TOL[dtype] * factor * scale, \
        "%s: max error %.3g over %.3g (max |ref| %.3g)" % (name, err, TOL[dtype] * factor * scale,
                                                           scale)


# ---- the float64 reference, written from the math -----------------------------------


def ref_forward(rms, x, gamma, beta, eps=EPS):
    """(y, mean, rstd) of LayerNorm (rms False) or RMSNorm over the rows of x."""
    if rms:
        mean = np.zeros(x.shape[0])
        rstd = 1.0 / np.sqrt(np.mean(x * x, axis=1) + eps)
        xhat = x * rstd[:, None]
    else:
        mean = np.mean(x, axis=1)
        rstd = 1.0 / np.sqrt(np.mean((x - mean[:, None]) ** 2, axis=1) + eps)
        xhat = (x - mean[:, None]) * rstd[:, None]
    y = xhat * (gamma if gamma is not None else 1.0) + (beta if beta is not None else 0.0)
    return y, mean, rstd


def ref_backward(rms, dy, x, gamma, eps=EPS):
    """(dx, dgamma, dbeta) of the forward above, from the input x."""
    _, mean, rstd = ref_forward(rms, x, None, None, eps)
    xhat = (x - mean[:, None]) * rstd[:, None]
    g = dy * (gamma if gamma is not None else 1.0)
    proj = np.mean(g * xhat, axis=1, keepdims=True)
    centre = 0.0 if rms else np.mean(g, axis=1, keepdims=True)
    dx = rstd[:, None] * (g - centre - xhat * proj)
    return dx, np.sum(dy * xhat, axis=0), np.sum(dy, axis=0)


def make_gamma(rng, cols):
    """Weights of both signs, away from zero (memory_efficient divides by them)."""
    return rng.uniform(0.5, 1.5, cols) * rng.choice([-1.0, 1.0], cols)


# ---- forward -----------------------------------------------------------------------------


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype,wdtype,affine", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=["%dx%d" % s for s in SHAPES])
def test_forward(client, rng, rms, dtype, wdtype, affine, shape):
    rows, cols = shape
    x, x64 = quantize(rng.normal(0.3, 2.0, shape), dtype)
    g, g64 = quantize(make_gamma(rng, cols), wdtype) if affine else (None, None)
    b, b64 = quantize(rng.normal(0, 1, cols), wdtype) if affine and not rms else (None, None)
    hx = client.host_copy(x)
    hy = client.host_array(shape, dtype)
    hmean = None if rms else client.host_array(rows, "f32")
    hrstd = client.host_array(rows, np.float32)
    hg = client.host_copy(g) if g is not None else None
    hb = client.host_copy(b) if b is not None else None
    op = "RMSNORM_FWD" if rms else "LAYERNORM_FWD"
    res = client.run(op, rows, cols, dtype=dtype, x=hx, y=hy, mean=hmean, rstd=hrstd, gamma=hg,
                     beta=hb)
    assert res.status == "OK" and res.code == 0 and res.variant
    y_ref, mean_ref, rstd_ref = ref_forward(rms, x64, g64, b64)
    assert_close("y", as_float64(hy, dtype), y_ref, dtype)
    assert_close("rstd", hrstd.astype(np.float64), rstd_ref, "f32")
    if not rms:
        assert_close("mean", hmean.astype(np.float64), mean_ref, "f32")


def test_forward_eps(client, rng):
    """eps reaches the daemon: with a huge eps, rstd is about 1/sqrt(eps)."""
    x = client.host_copy(rng.normal(0, 1e-3, (3, 8)).astype(np.float32))
    y = client.host_array((3, 8), np.float32)
    rstd = client.host_array(3, np.float32)
    client.run("RMSNORM_FWD", 3, 8, eps=100.0, x=x, y=y, rstd=rstd)
    _, _, rstd_ref = ref_forward(True, x.astype(np.float64), None, None, eps=100.0)
    assert_close("rstd", rstd.astype(np.float64), rstd_ref, "f32")


# ---- backward ----------------------------------------------------------------------------


def run_backward(client, rms, dtype, wdtype, x, dy, g, b, memory_efficient, rows, cols):
    """Forward (for y, mean, rstd), then backward; returns the host arrays of the results."""
    hx = client.host_copy(x)
    hy = client.host_array((rows, cols), dtype)
    hmean = None if rms else client.host_array(rows, np.float32)
    hrstd = client.host_array(rows, np.float32)
    hg = client.host_copy(g) if g is not None else None
    hb = client.host_copy(b) if b is not None else None
    fwd, bwd = ("RMSNORM_FWD", "RMSNORM_BWD") if rms else ("LAYERNORM_FWD", "LAYERNORM_BWD")
    client.run(fwd, rows, cols, dtype=dtype, x=hx, y=hy, mean=hmean, rstd=hrstd, gamma=hg,
               beta=hb)
    hdy = client.host_copy(dy)
    hdx = client.host_array((rows, cols), dtype)
    hdg = client.host_array(cols, wdtype) if g is not None else None
    hdb = client.host_array(cols, wdtype) if b is not None else None
    res = client.run(bwd, rows, cols, dtype=dtype, memory_efficient=memory_efficient,
                     x=hy if memory_efficient else hx, dy=hdy,
                     mean=None if memory_efficient else hmean, rstd=hrstd, gamma=hg, beta=hb,
                     dx=hdx, dgamma=hdg, dbeta=hdb)
    assert res.status == "OK"
    return hdx, hdg, hdb, res


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype,wdtype,affine", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("memory_efficient", [False, True], ids=["x", "memeff"])
@pytest.mark.parametrize("shape", SHAPES, ids=["%dx%d" % s for s in SHAPES])
def test_backward(client, rng, rms, dtype, wdtype, affine, memory_efficient, shape):
    rows, cols = shape
    x, x64 = quantize(rng.normal(0.3, 2.0, shape), dtype)
    dy, dy64 = quantize(rng.normal(0, 1, shape), dtype)
    g, g64 = quantize(make_gamma(rng, cols), wdtype) if affine else (None, None)
    b, b64 = quantize(rng.normal(0, 1, cols), wdtype) if affine and not rms else (None, None)
    hdx, hdg, hdb, res = run_backward(client, rms, dtype, wdtype, x, dy, g, b, memory_efficient,
                                      rows, cols)
    assert res.clamped_cols == 0
    dx_ref, dg_ref, db_ref = ref_backward(rms, dy64, x64, g64)
    # memory_efficient recomputes x from y, which was rounded to dtype:
    # allow for that rounding once more.
    factor = 2.0 if memory_efficient else 1.0
    assert_close("dx", as_float64(hdx, dtype), dx_ref, dtype, factor)
    # dgamma sums dy * x_hat: with memory_efficient, x_hat carries y's
    # rounding to dtype, which can be coarser than the weights' dtype.
    if g is not None:
        coarser = dtype if memory_efficient and TOL[dtype] > TOL[wdtype] else wdtype
        assert_close("dgamma", as_float64(hdg, wdtype), dg_ref, coarser, factor)
    if b is not None:
        assert_close("dbeta", as_float64(hdb, wdtype), db_ref, wdtype)


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_backward_accumulate(client, rng, rms):
    """accumulate=True adds to dgamma/dbeta instead of overwriting them."""
    rows, cols = 16, 48
    x = rng.normal(0, 1, (rows, cols)).astype(np.float32)
    dy = rng.normal(0, 1, (rows, cols)).astype(np.float32)
    g = make_gamma(rng, cols).astype(np.float32)
    b = None if rms else rng.normal(0, 1, cols).astype(np.float32)
    hx, hdy, hg = client.host_copy(x), client.host_copy(dy), client.host_copy(g)
    hb = None if rms else client.host_copy(b)
    hmean = None if rms else client.host_array(rows, np.float32)
    hrstd = client.host_array(rows, np.float32)
    fwd, bwd = ("RMSNORM_FWD", "RMSNORM_BWD") if rms else ("LAYERNORM_FWD", "LAYERNORM_BWD")
    client.run(fwd, rows, cols, x=hx, y=client.host_array((rows, cols), np.float32), mean=hmean,
               rstd=hrstd, gamma=hg, beta=hb)
    start_g = rng.normal(0, 1, cols).astype(np.float32)
    start_b = rng.normal(0, 1, cols).astype(np.float32)
    hdg = client.host_copy(start_g)
    hdb = None if rms else client.host_copy(start_b)
    client.run(bwd, rows, cols, accumulate=True, x=hx, dy=hdy, mean=hmean, rstd=hrstd, gamma=hg,
               beta=hb, dx=client.host_array((rows, cols), np.float32), dgamma=hdg, dbeta=hdb)
    _, dg_ref, db_ref = ref_backward(rms, dy.astype(np.float64), x.astype(np.float64),
                                     g.astype(np.float64))
    assert_close("dgamma", hdg.astype(np.float64), start_g + dg_ref, "f32")
    if not rms:
        assert_close("dbeta", hdb.astype(np.float64), start_b + db_ref, "f32")


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_memory_efficient_clamps_small_gamma(client, rng, rms):
    """Weights smaller than eps in magnitude are clamped, and the reply counts them."""
    rows, cols = 4, 32
    g = make_gamma(rng, cols)
    g[[3, 7, 20]] = [0.0, 1e-7, -1e-8]
    x = rng.normal(0, 1, (rows, cols))
    dy = rng.normal(0, 1, (rows, cols))
    b = None if rms else rng.normal(0, 1, cols)
    f32 = np.float32
    _, _, _, res = run_backward(client, rms, "f32", "f32", x.astype(f32), dy.astype(f32),
                                g.astype(f32), None if b is None else b.astype(f32), True,
                                rows, cols)
    assert res.clamped_cols == 3


# ---- WGRAD_ACCUM -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,gdtype", [("f32", "f32"), ("bf16", "f32"), ("f16", "f32"),
                                          ("bf16", "bf16")])
def test_wgrad_accum(client, rng, dtype, gdtype):
    """main_grad[out, in] += dy^T x, then = dy^T x with overwrite."""
    tokens, n_in, n_out = 37, 24, 19
    x, x64 = quantize(rng.normal(0, 1, (tokens, n_in)), dtype)
    dy, dy64 = quantize(rng.normal(0, 1, (tokens, n_out)), dtype)
    start, start64 = quantize(rng.normal(0, 1, (n_out, n_in)), gdtype)
    hx, hdy, hgrad = client.host_copy(x), client.host_copy(dy), client.host_copy(start)
    product = dy64.T @ x64
    client.run("WGRAD_ACCUM", tokens, n_in, out_features=n_out, dtype=dtype, x=hx, dy=hdy,
               main_grad=hgrad)
    # The sum of `tokens` products: allow float32 accumulation error.
    assert_close("main_grad (accumulate)", as_float64(hgrad, gdtype), start64 + product, gdtype,
                 factor=4.0)
    client.run("WGRAD_ACCUM", tokens, n_in, out_features=n_out, dtype=dtype, overwrite=True,
               x=hx, dy=hdy, main_grad=hgrad)
    assert_close("main_grad (overwrite)", as_float64(hgrad, gdtype), product, gdtype, factor=4.0)


# ---- submission ---------------------------------------------------------------------------


def test_submit_many_wait_out_of_order(client, rng):
    """Jobs in flight at once; waited for in reverse order; each result is its own."""
    rows, cols = 8, 64
    jobs = []
    for i in range(12):
        x = client.host_copy(rng.normal(i, 1 + i, (rows, cols)).astype(np.float32))
        y = client.host_array((rows, cols), np.float32)
        jobs.append((client.submit("LAYERNORM_FWD", rows, cols, x=x, y=y), x, y))
    for pending, x, y in reversed(jobs):
        assert pending.wait().status == "OK"
        ref, _, _ = ref_forward(False, x.astype(np.float64), None, None)
        assert_close("y", y.astype(np.float64), ref, "f32")
    with pytest.raises(ValueError):
        jobs[0][0].wait()


def test_region_offsets_and_tuples(client, rng):
    """Several tensors in one region, named by arrays or by (region, offset)."""
    rows, cols = 6, 40
    region = client.host_region(1 << 16)
    x = region.array((rows, cols), np.float32)
    y = region.array((rows, cols), np.float32)
    rstd = region.array(rows, np.float32)
    x[...] = rng.normal(0, 1, (rows, cols))
    y_offset = y.__array_interface__["data"][0] - region.address
    assert y_offset % normd.host.ALIGNMENT == 0
    client.run("RMSNORM_FWD", rows, cols, x=x, y=(region, y_offset), rstd=rstd)
    ref, _, rstd_ref = ref_forward(True, x.astype(np.float64), None, None)
    assert_close("y", y.astype(np.float64), ref, "f32")
    assert_close("rstd", rstd.astype(np.float64), rstd_ref, "f32")


def test_stats_count_jobs(client, rng):
    before = client.stats()
    x = client.host_copy(rng.normal(0, 1, (2, 8)).astype(np.float32))
    client.run("LAYERNORM_FWD", 2, 8, x=x, y=client.host_array((2, 8), np.float32))
    after = client.stats()
    assert after["backend"] == "cpu"
    assert after["jobs_ok"] == before["jobs_ok"] + 1
    op_stats = after["ops"][int(normd.Op.LAYERNORM_FWD)]
    assert sum(op_stats["latency_buckets"]) >= 1
    assert normd.latency_quantile_us(op_stats["latency_buckets"], 0.5) > 0
    assert client.variants() == []
    assert client.server_info["backend"] == "cpu"
    client.ping()
