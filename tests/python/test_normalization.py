"""normd.normalization on a CPU-backend daemon (skipped where torch is not installed).

CI has no torch (it is large); these run wherever it is. CPU tensors are
sent to the daemon through shared-memory copies (NORMD_TORCH_CPU=daemon),
so the autograd Functions, dtype rules and saved tensors are the ones the
GPU path uses; tests/gpu/test_python.py runs the same checks on CUDA.
"""

import pytest

torch = pytest.importorskip("torch")

import normd  # noqa: E402
import torch_checks as checks  # noqa: E402


@pytest.fixture
def staged(client, monkeypatch):
    """Routes CPU tensors to the test daemon through the default client."""
    monkeypatch.setenv("NORMD_TORCH_CPU", "daemon")
    old = normd.set_default_client(client)
    yield client
    normd.set_default_client(old)


# The full matrix is for the GPU; here a slice of every dimension of it.
CASES = [c for c in checks.module_cases() if c[4] in ((8, 64), (3, 5, 12, 20), (7, 1))]


@pytest.mark.parametrize("case", CASES, ids=[checks.case_id(c) for c in CASES])
def test_module(staged, case):
    before = staged.stats()["jobs_ok"]
    checks.check_module(case, "cpu")
    assert staged.stats()["jobs_ok"] == before + 2  # the daemon ran forward and backward


@pytest.mark.parametrize("name", checks.MODULES)
def test_noncontiguous_input(staged, name):
    case = (name, torch.float32, False, True, (6, 5, 40), (5, 40))
    checks.check_module(case, "cpu", noncontiguous=True)


def test_functionals(staged):
    checks.check_functionals("cpu")


def test_signatures():
    checks.check_signatures()


def test_errors(staged):
    checks.check_errors("cpu")


def test_explicit_client(client, monkeypatch):
    """A module's client= is used instead of the default one."""
    monkeypatch.setenv("NORMD_TORCH_CPU", "daemon")
    old = normd.set_default_client(None)
    monkeypatch.setenv("NORMD_SOCKET", "/nonexistent/normd.sock")
    try:
        m = normd.normalization.FusedRMSNorm(16, client=client)
        y = m(torch.randn(3, 16))
        assert y.shape == (3, 16)
    finally:
        normd.set_default_client(old)


def test_cpu_tensors_fall_back_to_torch(client, monkeypatch):
    """Without NORMD_TORCH_CPU=daemon, CPU tensors never reach the daemon."""
    monkeypatch.delenv("NORMD_TORCH_CPU", raising=False)
    old = normd.set_default_client(client)
    try:
        before = client.stats()["jobs_ok"]
        m = normd.normalization.FusedLayerNorm(32)
        x = torch.randn(4, 32, requires_grad=True)
        y = m(x)
        y.sum().backward()
        ref = torch.nn.functional.layer_norm(x.detach(), (32,), eps=1e-5)
        assert torch.allclose(y, ref, atol=1e-6)
        mixed = normd.normalization.MixedFusedRMSNorm(32)(x.detach().bfloat16())
        assert mixed.dtype == torch.float32
        assert client.stats()["jobs_ok"] == before
    finally:
        normd.set_default_client(old)


def test_float64_falls_back_to_torch(staged):
    x = torch.randn(4, 32, dtype=torch.float64)
    y = normd.normalization.fused_rms_norm(x, (32,))
    assert y.dtype == torch.float64


def test_short_training_run(staged):
    """The GPU test's transformer, a few steps: curves within 1% of torch's."""
    _, _, worst = checks.check_training("cpu", steps=25, dim=32, heads=2, seq=16, batch=4,
                                        require_learning=False)
    assert worst <= 0.01


def test_client_run_with_torch_tensors(client):
    """torch tensors as job tensors (the path CUDA tensors take, here in host regions)."""
    rows, cols = 5, 48
    x = torch.from_numpy(client.host_array((rows, cols), "bf16")).view(torch.bfloat16)
    x.copy_(torch.randn(rows, cols) * 3)
    y = torch.from_numpy(client.host_array((rows, cols), "bf16")).view(torch.bfloat16)
    rstd = torch.from_numpy(client.host_array(rows, "f32"))
    res = client.run("RMSNORM_FWD", rows, cols, x=x, y=y, rstd=rstd)
    assert res.status == "OK"
    ref = checks.rms_reference(x.double(), (cols,), None, 1e-5)
    checks.expect_close("y", y, ref, checks.TOL[torch.bfloat16])
    with pytest.raises(TypeError, match="tensor y is F32 but the job needs BF16"):
        client.run("RMSNORM_FWD", rows, cols, x=x, y=torch.from_numpy(
            client.host_array((rows, cols), "f32")), rstd=rstd)
    with pytest.raises(normd.NormdError, match="not inside a host region"):
        client.run("RMSNORM_FWD", rows, cols, x=x, y=torch.empty_like(x), rstd=rstd)
