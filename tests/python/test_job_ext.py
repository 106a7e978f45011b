"""The norm variants through the binding's Client (struct nc_job_ext), with numpy.

Runs without torch. The layout of NcJobExt against the C header is
test_layout.py's (it walks normd._lib.STRUCTS); the feature bits are
checked here with a probe of their own.
"""

import os
import shutil
import subprocess

import numpy as np
import pytest
from conftest import REPO
from fp8_reference import check_codes
from test_ops import as_float64, assert_close, make_gamma, quantize, ref_backward, ref_forward

import normd
from normd import _lib

ALL_FEATURES = _lib.FEATURE_RESIDUAL | _lib.FEATURE_WEIGHT_OFFSET | _lib.FEATURE_FP8_OUTPUT


def test_feature_constants(tmp_path):
    cc = os.environ.get("CC", "cc")
    if not shutil.which(cc):
        pytest.fail("no C compiler (%s) to build the probe" % cc)
    names = {"NC_FEATURE_RESIDUAL": _lib.FEATURE_RESIDUAL,
             "NC_FEATURE_WEIGHT_OFFSET": _lib.FEATURE_WEIGHT_OFFSET,
             "NC_FEATURE_FP8_OUTPUT": _lib.FEATURE_FP8_OUTPUT}
    lines = ['#include <stdio.h>', '#include "normclient.h"', "int main(void) {"]
    lines += ['printf("%s %%d\\n", (int)(%s));' % (n, n) for n in names]
    lines += ["return 0;", "}"]
    (tmp_path / "probe.c").write_text("\n".join(lines) + "\n")
    subprocess.run([cc, "-std=c11", "-Wall", "-Werror", "-I", str(REPO / "client" / "include"),
                    str(tmp_path / "probe.c"), "-o", str(tmp_path / "probe")], check=True)
    out = subprocess.run([str(tmp_path / "probe")], check=True, capture_output=True,
                         text=True).stdout
    got = dict((k, int(v)) for k, v in (line.split() for line in out.splitlines()))
    assert got == names
    assert tuple(f for f, t in _lib.NcJobExt._fields_ if t is _lib.NcTensor) == \
        _lib.EXT_TENSOR_ROLES


def test_norm_features(client):
    """The CPU backend runs every variant."""
    assert client.norm_features == ALL_FEATURES


def _add_case(client, rng, dtype, wdtype, rows, cols):
    x, x64 = quantize(rng.normal(0.3, 2.0, (rows, cols)), dtype)
    r, r64 = quantize(rng.normal(0.0, 1.0, (rows, cols)), dtype)
    g, g64 = quantize(make_gamma(rng, cols) * 0.5, wdtype)
    # s as stored: the exact sum rounded once to dtype.
    s_store, s64 = quantize(x64 + r64, dtype)
    return client.host_copy(x), client.host_copy(r), client.host_copy(g), g64, s_store, s64


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype,wdtype", [("f32", "f32"), ("bf16", "bf16"), ("f16", "f32")])
@pytest.mark.parametrize("offset", [0.0, 1.0, -0.375])
def test_residual_forward_and_backward(client, rng, rms, dtype, wdtype, offset):
    rows, cols = 6, 80
    hx, hr, hg, g64, s_store, s64 = _add_case(client, rng, dtype, wdtype, rows, cols)
    hy, hs = client.host_array((rows, cols), dtype), client.host_array((rows, cols), dtype)
    hmean = None if rms else client.host_array(rows, "f32")
    hrstd = client.host_array(rows, "f32")
    fwd, bwd = ("RMSNORM_FWD", "RMSNORM_BWD") if rms else ("LAYERNORM_FWD", "LAYERNORM_BWD")
    res = client.run_ext(fwd, rows, cols, x=hx, y=hy, gamma=hg, mean=hmean, rstd=hrstd,
                         residual=hr, residual_out=hs, weight_offset=offset)
    assert res.status == "OK"
    assert np.array_equal(hs, s_store), "s is x + residual rounded once"
    w64 = g64 + offset
    y_ref, _, _ = ref_forward(rms, s64, w64, None)
    assert_close("y", as_float64(hy, dtype), y_ref, dtype)

    dy, dy64 = quantize(rng.normal(0, 1, (rows, cols)), dtype)
    ds, ds64 = quantize(rng.normal(0, 1, (rows, cols)), dtype)
    hdx = client.host_array((rows, cols), dtype)
    hdg = client.host_array(cols, wdtype)
    client.run_ext(bwd, rows, cols, x=hs, dy=client.host_copy(dy), mean=hmean, rstd=hrstd,
                   gamma=hg, dx=hdx, dgamma=hdg, ds=client.host_copy(ds), weight_offset=offset)
    dx_ref, dg_ref, _ = ref_backward(rms, dy64, s64, w64)
    assert_close("dx", as_float64(hdx, dtype), dx_ref + ds64, dtype, 2)
    assert_close("dgamma", as_float64(hdg, wdtype), dg_ref, wdtype, 4)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_fp8_forward(client, rng, fmt, dtype):
    rows, cols = 16, 96
    x, x64 = quantize(rng.normal(0.3, 2.0, (rows, cols)), dtype)
    g, g64 = quantize(make_gamma(rng, cols), dtype)
    x64[3, 5] = np.nan  # a NaN row: codes 0x7f, skipped by amax
    x = client.host_copy(x64.astype(np.float32) if dtype == "f32" else normd.to_bf16(x64))
    scale = client.host_copy(np.array([37.0], np.float32))
    amax = client.host_array(1, "f32")
    y8 = client.host_array((rows, cols), "f8" + fmt)
    client.run_ext("RMSNORM_FWD", rows, cols, x=x, gamma=client.host_copy(g), y=y8,
                   scale=scale, amax=amax, y_dtype="f8" + fmt)
    y_ref, _, _ = ref_forward(True, x64, g64, None)
    check_codes("y8", y8, y_ref * 37.0, fmt)
    assert np.all(y8[3] == 0x7F)
    finite = np.abs(y_ref[np.isfinite(y_ref)])
    assert abs(amax[0] - finite.max()) <= 1e-6 * finite.max()


def test_fp8_amax_is_the_max_of_the_fp32_output(client, rng):
    """amax is exactly max |y| of the float32 y the daemon scaled (its plain f32 output)."""
    rows, cols = 7, 300
    x = client.host_copy(rng.normal(0, 3, (rows, cols)).astype(np.float32))
    g = client.host_copy(make_gamma(rng, cols).astype(np.float32))
    y = client.host_array((rows, cols), "f32")
    client.run("LAYERNORM_FWD", rows, cols, x=x, y=y, gamma=g)
    y8 = client.host_array((rows, cols), "f8e4m3")
    amax = client.host_array(1, "f32")
    client.run_ext("LAYERNORM_FWD", rows, cols, x=x, y=y8, gamma=g, amax=amax, y_dtype="f8e4m3",
                   scale=client.host_copy(np.array([0.5], np.float32)))
    assert amax[0] == np.abs(y).max()


def test_in_place_and_refused_aliases(client, rng):
    """vLLM's form (y over x, s over residual) runs; a partial overlap is INVALID_ARGUMENT."""
    rows, cols = 4, 64
    region = client.host_region(3 * rows * cols * 4 + 1024)
    x = region.array((rows, cols), "f32")
    r = region.array((rows, cols), "f32")
    x[...] = rng.normal(0, 1, (rows, cols))
    r[...] = rng.normal(0, 1, (rows, cols))
    s64 = x.astype(np.float64) + r
    s_store = (x + r).astype(np.float32)
    g = client.host_copy(make_gamma(rng, cols).astype(np.float32))
    client.run_ext("RMSNORM_FWD", rows, cols, x=x, y=x, gamma=g, residual=r, residual_out=r)
    assert np.array_equal(r, s_store)
    y_ref, _, _ = ref_forward(True, s64, g.astype(np.float64), None)
    assert_close("y over x", x.astype(np.float64), y_ref, "f32")
    # y four bytes into x: refused, naming the tensors.
    shifted = (region, region.tensor(0).offset + 4)
    with pytest.raises(normd.NormdError, match="overlap") as err:
        client.run_ext("RMSNORM_FWD", rows, cols, dtype="f32", x=x, y=shifted, gamma=g,
                       residual=r, residual_out=client.host_array((rows, cols), "f32"))
    assert err.value.status == "INVALID_ARGUMENT"
    # y and residual_out on the same bytes: two outputs overlapping.
    with pytest.raises(normd.NormdError) as err:
        client.run_ext("RMSNORM_FWD", rows, cols, x=x, y=r, gamma=g, residual=x, residual_out=r)
    assert err.value.status == "INVALID_ARGUMENT"


def test_enqueue_and_submit(client, rng):
    rows, cols = 3, 40
    x = client.host_copy(rng.normal(0, 1, (rows, cols)).astype(np.float32))
    r = client.host_copy(rng.normal(0, 1, (rows, cols)).astype(np.float32))
    g = client.host_copy(make_gamma(rng, cols).astype(np.float32))
    y1, s1 = client.host_array((rows, cols), "f32"), client.host_array((rows, cols), "f32")
    client.enqueue_ext("RMSNORM_FWD", rows, cols, stream=5, x=x, y=y1, gamma=g, residual=r,
                       residual_out=s1, weight_offset=1.0)
    client.stream_wait(5)
    y2, s2 = client.host_array((rows, cols), "f32"), client.host_array((rows, cols), "f32")
    client.submit_ext("RMSNORM_FWD", rows, cols, x=x, y=y2, gamma=g, residual=r,
                      residual_out=s2, weight_offset=1.0).wait()
    assert np.array_equal(y1, y2) and np.array_equal(s1, s2)
    # The library checks an enqueued job's variants itself: refused synchronously.
    with pytest.raises(normd.NormdError, match="residual and residual_out"):
        client.enqueue_ext("RMSNORM_FWD", rows, cols, stream=5, x=x, y=y1, gamma=g, residual=r)
    client.check()


def test_make_job_ext_checks(client):
    rows, cols = 2, 8
    x = client.host_array((rows, cols), "f32")
    y8 = client.host_array((rows, cols), "f8e5m2")
    scale = client.host_copy(np.array([1.0], np.float32))
    with pytest.raises(TypeError, match="scale is F16"):
        client.make_job_ext("RMSNORM_FWD", rows, cols, x=x, y=y8, y_dtype="f8e5m2",
                            scale=client.host_copy(np.array([1.0], np.float16)))
    with pytest.raises(TypeError, match="one-byte elements"):
        client.make_job_ext("RMSNORM_FWD", rows, cols, x=x, y=client.host_array((rows, cols),
                                                                                "f32"),
                            y_dtype="e5m2", scale=scale)
    with pytest.raises(ValueError, match="residual holds"):
        client.make_job_ext("RMSNORM_FWD", rows, cols, x=x, y=x,
                            residual=client.host_array(rows, "f32"))
    with pytest.raises(TypeError, match="unknown tensor role"):
        client.make_job_ext("RMSNORM_FWD", rows, cols, x=x, y=x, skip=x)
    job, ext, keep = client.make_job_ext("RMSNORM_FWD", rows, cols, x=x, y=y8, scale=scale,
                                         y_dtype="f8e5m2", weight_offset=0.5)
    assert ext.y_dtype == _lib.DType.F8E5M2 and ext.weight_offset == 0.5
    assert job.y.region == client.region_of(y8).id and ext.scale.region != 0
    assert list(ext.reserved) == [0, 0, 0, 0]
