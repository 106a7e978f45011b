"""bench/bench_peers.py without a GPU: its plan, the byte accounting, the join and the table.

The bytes of every row come from build/bench/bench_norm --plan (bench_norm.c's
job_bytes); bench_peers checks them against its own list of the tensors each
row reads and writes (MOVES). These tests run that check over every row of
the default plan, pin a few rows to numbers worked out by hand, and feed a
made-up bench_norm log through the join, the table and the targets.
"""

import os
import subprocess
import sys

import pytest
from conftest import REPO, normd_bin

BUILD = normd_bin().parent.parent
BENCH_NORM = BUILD / "bench" / "bench_norm"
SCRIPT = REPO / "bench" / "bench_peers.py"

pytestmark = pytest.mark.skipif(not os.access(BENCH_NORM, os.X_OK),
                                reason="%s not built (make gpu-progs)" % BENCH_NORM)


def peers(*argv):
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, str(SCRIPT), "--build", str(BUILD), *argv],
                          capture_output=True, text=True, env=env, timeout=120)


def plan(*words):
    out = subprocess.run([str(BENCH_NORM), "--plan", *words], capture_output=True, text=True,
                         check=True).stdout
    rows = {}
    for line in out.splitlines():
        f = dict(p.split("=", 1) for p in line.split()[1:])
        rows[(f["op"], f["dtype"], int(f["cols"]))] = (int(f["rows"]), int(f["bytes"]))
    return rows


def test_dry_run_checks_every_row_of_the_full_plan():
    out = peers("--dry-run")
    assert out.returncode == 0, out.stdout + out.stderr
    # 3 dtypes x 9 widths x (6 plain + 6 add + 6 offset + 2 fp8) rows.
    assert "byte accounting: 540 rows from bench_norm --plan, all as MOVES lists them" \
        in out.stdout
    assert "| ln_bwd_memeff+add | f16 | 12288 | 21845 |" in out.stdout
    assert "Liger-Kernel has no fused add + LayerNorm" in out.stdout


def test_bytes_worked_out_by_hand():
    rows = plan("bf16", "f32", "variants", "plain", "1024")
    n, r = 1 << 28, 262144  # elements and rows at 1024 columns
    # x + y (2 bytes each), gamma + beta (1024 x 2), mean + rstd (4 bytes a row).
    assert rows[("ln_fwd", "bf16", 1024)] == (r, 2 * 2 * n + 2 * 2048 + 2 * 4 * r)
    # Adding the residual reads it and writes s: two more row tensors.
    assert rows[("ln_fwd+add", "bf16", 1024)][1] == 4 * 2 * n + 2 * 2048 + 2 * 4 * r
    # Backward with a residual: s, dy, ds in, dx out; rstd; gamma in, dgamma out.
    assert rows[("rms_bwd+add", "f32", 1024)][1] == 4 * 4 * n + 4 * r + 2 * 4096
    # FP8 output: x in (bf16), y out at one byte, gamma, rstd, scale and amax.
    assert rows[("rms_fwd+fp8_e4m3", "bf16", 1024)][1] == 2 * n + n + 2048 + 4 * r + 8
    # A weight offset moves nothing more than the plain norm.
    assert rows[("ln_bwd_memeff+zero_centered", "bf16", 1024)][1] == \
        rows[("ln_bwd_memeff", "bf16", 1024)][1]


def test_run_sh_plan_is_unchanged_by_default():
    """bench/run.sh's bench_norm call (no words) still measures bf16 and f32 plain rows only."""
    rows = plan()
    assert len(rows) == 2 * 9 * 6
    assert {dtype for _, dtype, _ in rows} == {"bf16", "f32"}
    assert all("+" not in op for op, _, _ in rows)


def test_table_and_targets_from_a_made_up_log(tmp_path):
    words = ["bf16", "2048", "plain", "add", "offset", "fp8"]
    lines = ['device name="H100 (made up)" sms=132 l2_mb=50', "copy gbps=3000.0"]
    for (op, dtype, cols), (rows, nbytes) in plan(*words).items():
        slow = "+offset" in op or "+zero_centered" in op  # these miss "within 1% of plain"
        pct = 90.0 if slow else 96.0
        us = nbytes / (pct / 100 * 3000e9) * 1e6
        lines.append("normd op=%s dtype=%s cols=%d rows=%d bytes=%d us=%.3f gbps=%.1f "
                     "pct=%.1f variant=v tuned_gbps=1 tuned_pct=%.1f tuned_variant=t"
                     % (op, dtype, cols, rows, nbytes, us, pct * 30, pct, pct))
    log = tmp_path / "normd.log"
    log.write_text("\n".join(lines) + "\n")
    out = peers("--impls", "normd", "--normd-log", str(log), "--dtypes", "bf16", "--cols",
                "2048", "--json", str(tmp_path / "out.json"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "| rms_fwd+add | bf16 | 2048 | 2148 | 2880.0 | 96.0 | 96.0 | - | - |" in out.stdout
    assert "16-bit forward >= 99% copy: 0 of 2 rows" in out.stdout
    assert "weight offset within 1% of plain: 0 of 6 rows; missed: ln_fwd+zero_centered " \
        "bf16 2048" in out.stdout
    assert "FP8 forward >= 95% copy: 2 of 2 rows" in out.stdout
    assert (tmp_path / "out.json").stat().st_size > 0


def test_a_log_whose_bytes_differ_is_refused(tmp_path):
    log = tmp_path / "normd.log"
    log.write_text("copy gbps=3000.0\nnormd op=ln_fwd dtype=bf16 cols=2048 rows=131072 "
                   "bytes=5 us=1 gbps=1 pct=1 variant=v tuned_gbps=1 tuned_pct=1 "
                   "tuned_variant=t\n")
    out = peers("--impls", "normd", "--normd-log", str(log), "--dtypes", "bf16", "--cols",
                "2048", "--families", "plain")
    assert out.returncode != 0
    assert "counts 5 bytes for ln_fwd bf16 2048" in out.stderr
