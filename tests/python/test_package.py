"""The package itself: imports, finding the library, bf16 conversion, packaging."""

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO

import normd

PACKAGE_DIR = REPO / "bindings" / "python"


def run_python(code, **env):
    """Runs `code` in a fresh interpreter with the package on its path."""
    full_env = dict(os.environ, PYTHONPATH=str(PACKAGE_DIR), PYTHONDONTWRITEBYTECODE="1")
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True,
                          text=True, cwd="/")


def test_import_needs_neither_torch_nor_numpy():
    out = run_python("import sys, normd; normd.library_path(); "
                     "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_normalization_is_imported_lazily():
    out = run_python("import sys, normd; print('normd.normalization' in sys.modules)")
    assert out.stdout.strip() == "False"


def test_library_found_in_the_source_tree():
    assert normd.library_path() == str(REPO / "build" / "lib" / "libnormclient.so")


def test_library_from_environment():
    path = str(REPO / "build" / "lib" / "libnormclient.so.0")
    out = run_python("import normd; print(normd.library_path())", NORMD_LIBRARY=path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == path


def test_library_missing_is_a_clear_error():
    out = run_python("import normd; normd.Client('/tmp/x.sock')",
                     NORMD_LIBRARY="/nonexistent/libnormclient.so")
    assert out.returncode != 0
    assert "cannot load libnormclient" in out.stderr
    assert "$NORMD_LIBRARY (/nonexistent/libnormclient.so)" in out.stderr


@pytest.mark.parametrize("value,bits", [
    (1.0, 0x3F80), (-2.5, 0xC020), (0.0, 0x0000), (-0.0, 0x8000),
    (1.0 + 2.0 ** -8, 0x3F80),          # a tie rounds to even (down)
    (1.0 + 3 * 2.0 ** -8, 0x3F82),      # a tie rounds to even (up)
    (1.0 + 2.0 ** -8 + 2.0 ** -20, 0x3F81),  # above the tie rounds up
    (float("inf"), 0x7F80), (float("-inf"), 0xFF80),
    (3.4e38, 0x7F80),                   # rounds past the largest bf16: infinity
    (1e-40, 0x0001),                    # subnormal
])
def test_bf16_rounding(value, bits):
    assert int(normd.to_bf16(np.float32(value))) == bits


def test_bf16_nan_and_round_trip():
    nan = normd.to_bf16(np.array([np.nan], np.float32))
    assert np.isnan(normd.from_bf16(nan)).all()
    every = np.arange(0, 0x10000, dtype=np.uint32).astype(np.uint16)
    values = normd.from_bf16(every)
    finite = np.isfinite(values)
    assert np.array_equal(normd.to_bf16(values[finite]), every[finite])


def test_dtype_names():
    from normd.dtypes import to_dtype

    D = normd.DType
    assert to_dtype("bf16") == D.BF16 and to_dtype(np.uint16) == D.BF16
    assert to_dtype(np.dtype(np.float16)) == D.F16 and to_dtype(np.float32) == D.F32
    assert to_dtype("torch.bfloat16") == D.BF16 and to_dtype(3) == D.BF16
    with pytest.raises(TypeError):
        to_dtype(np.float64)


def test_pyproject_describes_the_package():
    tomllib = pytest.importorskip("tomllib")

    meta = tomllib.loads((PACKAGE_DIR / "pyproject.toml").read_text())
    assert meta["project"]["name"] == "normd"
    assert meta["project"]["version"] == normd.__version__
    packages = meta["tool"]["setuptools"]["packages"]
    for folder in (PACKAGE_DIR / "normd").rglob("__init__.py"):
        name = ".".join(folder.parent.relative_to(PACKAGE_DIR).parts)
        assert name in packages, "%s is missing from pyproject.toml" % name
