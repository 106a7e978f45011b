#!/usr/bin/env python3
"""normd.normalization on PyTorch's expandable segments (CUDA_VMM_FD regions).

Run by tests/gpu/run.sh (make test-gpu) where python3 can import torch:

    python3 tests/gpu/test_vmm_torch.py BUILD_DIR

It starts a daemon (BUILD_DIR/bin/normd --device 0) and runs the checks in a
child interpreter whose environment has
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (and
TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC=1, PyTorch's default outside fbcode) set
before torch is imported, so every CUDA tensor lives in VMM chunks (20 MiB
in the large pool) exported to the daemon as POSIX fds:

- the allocator really made expandable segments (torch's memory snapshot);
- FusedLayerNorm and FusedRMSNorm (affine, fp32 and bf16, memory_efficient
  off and on), forward and backward, on inputs of 48 MiB (fp32) that span
  several chunks and start mid-chunk, in each completion mode (enqueue,
  sync, event), against torch's own F.layer_norm / F.rms_norm and autograd
  on the same inputs;
- after torch.cuda.empty_cache() unmaps the chunks and new tensors are
  allocated at the same addresses, the results are still right (the
  library registers the new chunks instead of serving stale registrations);
- once the client closes, the daemon holds no region.

Prints one line per check, then "N passed, N failed"; exits non-zero if
anything failed.
"""

import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHILD_FLAG = "--child"


def parent(build):
    sys.path[:0] = [str(REPO / "bindings" / "python"), str(REPO / "tests" / "python")]
    from normd_daemon import Daemon

    daemon = Daemon(build / "bin" / "normd", "0", log_level="info", start_timeout=60,
                    stop_timeout=30)
    env = dict(os.environ)
    env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    env["TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC"] = "1"
    env["NORMD_LIBRARY"] = str(build / "lib" / "libnormclient.so")
    env["NORMD_SOCKET"] = daemon.socket
    env.pop("NORMD_COMPLETION", None)
    try:
        child = subprocess.run([sys.executable, __file__, CHILD_FLAG, daemon.socket], env=env,
                               timeout=900)
        rc = child.returncode
    finally:
        status = daemon.stop()
        log = daemon.log()
        daemon.cleanup()
    passed, failed = 0, 0
    if status == 0:
        passed += 1
        print("PASS  daemon exited 0 on SIGTERM")
    else:
        failed += 1
        print("FAIL  daemon exited %s on SIGTERM" % status)
    if rc != 0:
        failed += 1
        print("FAIL  the checks under expandable_segments:True (exit %d)" % rc)
    if failed:
        print("---- the daemon's log, last 40 lines ----\n" + "\n".join(log.splitlines()[-40:]))
    print("test_vmm_torch (parent): %d passed, %d failed" % (passed, failed))
    return 1 if failed else 0


# ---- the child: expandable segments from the first allocation on ---------------------------


def child(socket):
    assert os.environ.get("PYTORCH_CUDA_ALLOC_CONF") == "expandable_segments:True"
    sys.path[:0] = [str(REPO / "bindings" / "python"), str(REPO / "tests" / "python")]
    import torch
    import torch.nn.functional as F

    import normd
    from normd import normalization as N

    device = "cuda:0"
    results = {"passed": 0, "failed": 0}

    def run(name, fn, *args):
        start = time.monotonic()
        try:
            fn(*args)
        except Exception as err:  # noqa: BLE001 -- every failure is reported, then counted
            results["failed"] += 1
            print("FAIL  %s: %s" % (name, err), flush=True)
            traceback.print_exc()
            return
        results["passed"] += 1
        print("PASS  %s (%.1f s)" % (name, time.monotonic() - start), flush=True)

    def rel_error(got, ref):
        ref = ref.double()
        scale = max(1.0, ref.abs().max().item())
        return (got.double() - ref).abs().max().item() / scale

    tol = {torch.float32: 5e-5, torch.bfloat16: 3.2e-2}

    def expandable_segments_in_use():
        x = torch.empty(12 << 20, dtype=torch.float32, device=device)  # 48 MiB
        segments = torch.cuda.memory_snapshot()
        expandable = [s for s in segments if s.get("is_expandable")]
        assert expandable, ("the allocator made no expandable segment (snapshot: %s)"
                            % [sorted(s) for s in segments[:1]])
        ptr = x.data_ptr()
        inside = [s for s in expandable
                  if s["address"] <= ptr < s["address"] + s["total_size"]]
        assert inside, "the test tensor is not in an expandable segment"
        print("      %d expandable segment(s), %d MiB" %
              (len(expandable), sum(s["total_size"] for s in expandable) >> 20))

    def one_case(rms, dtype, memory_efficient, seed):
        """Forward and backward through normd and through torch on the same inputs."""
        g = torch.Generator(device=device).manual_seed(seed)
        rows, cols = 3 * 1024 + 5, 4096  # 48 MiB of fp32 per [rows, cols] tensor
        # A large-pool block of 3 MiB + 4 KiB first, so that x starts inside a chunk.
        pad = torch.empty((3 << 20) + 4096, dtype=torch.uint8, device=device)
        x = (torch.randn(rows, cols, generator=g, device=device) * 2 + 0.5).to(dtype)
        x.requires_grad_(True)
        module_type = N.FusedRMSNorm if rms else N.FusedLayerNorm
        module = module_type(cols, memory_efficient=memory_efficient).to(device)
        with torch.no_grad():
            module.weight.copy_(torch.randn(cols, generator=g, device=device) * 0.5 + 1)
            if not rms:
                module.bias.copy_(torch.randn(cols, generator=g, device=device) * 0.1)
        module = module.to(dtype)
        dy = (torch.randn(rows, cols, generator=g, device=device)).to(dtype)
        # torch's own, on copies of the same leaves.
        xr = x.detach().clone().requires_grad_(True)
        wr = module.weight.detach().clone().requires_grad_(True)
        if rms:
            ref = F.rms_norm(xr, (cols,), wr, module.eps)
        else:
            br = module.bias.detach().clone().requires_grad_(True)
            ref = F.layer_norm(xr, (cols,), wr, br, module.eps)
        ref.backward(dy)
        y = module(x)
        y.backward(dy)
        torch.cuda.synchronize()
        normd.default_client().check()  # the enqueue mode's asynchronous errors
        checks = [("y", y, ref), ("dx", x.grad, xr.grad), ("dweight", module.weight.grad,
                                                            wr.grad)]
        if not rms:
            checks.append(("dbias", module.bias.grad, br.grad))
        worst = {}
        for what, got, want in checks:
            assert not torch.isnan(got).any(), "%s has NaN (a poisoned output?)" % what
            worst[what] = rel_error(got, want)
            limit = tol[dtype] * (4 if what in ("dweight", "dbias") else 1)
            assert worst[what] <= limit, "%s: relative error %.3g over %.3g" % (
                what, worst[what], limit)
        del pad
        return worst

    def matrix(mode):
        old = normd.set_completion_mode(mode)
        try:
            seed = 0
            for rms in (False, True):
                for dtype in (torch.float32, torch.bfloat16):
                    for me in (False, True):
                        seed += 1
                        worst = one_case(rms, dtype, me, seed)
                        print("      %s %s me=%d: %s" % (
                            "rms" if rms else "ln", str(dtype).split(".")[1], me,
                            " ".join("%s %.2g" % kv for kv in worst.items())), flush=True)
        finally:
            normd.set_completion_mode(old)

    def after_empty_cache():
        """Chunks unmapped and mapped again at the same addresses: still right."""
        torch.cuda.synchronize()
        before = [s["address"] for s in torch.cuda.memory_snapshot() if s.get("is_expandable")]
        torch.cuda.empty_cache()
        for mode in ("enqueue", "sync", "event"):
            old = normd.set_completion_mode(mode)
            try:
                one_case(True, torch.float32, False, 100)
                one_case(False, torch.bfloat16, True, 101)
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            finally:
                normd.set_completion_mode(old)
        after = [s["address"] for s in torch.cuda.memory_snapshot() if s.get("is_expandable")]
        print("      segments at %s before, %s after" % (
            [hex(a) for a in before[:2]], [hex(a) for a in after[:2]]))

    def released_on_close():
        client = normd.default_client()
        regions = client.stats()["regions"]
        assert regions > 0, "no region registered"
        normd.set_default_client(None)
        client.close()
        with normd.Client(socket, name="vmm-observer") as observer:
            for _ in range(200):
                if observer.stats()["regions"] == 0:
                    break
                time.sleep(0.05)
            left = observer.stats()["regions"]
        assert left == 0, "%d regions still registered after the client closed" % left
        print("      %d regions released" % regions)

    if not torch.cuda.is_available():
        print("FAIL  torch %s sees no CUDA device" % torch.__version__)
        return 1
    print("torch %s on %s; PYTORCH_CUDA_ALLOC_CONF=%s" % (
        torch.__version__, torch.cuda.get_device_name(0),
        os.environ["PYTORCH_CUDA_ALLOC_CONF"]), flush=True)
    normd.set_default_client(normd.Client(socket, name="test_vmm_torch"))
    run("expandable segments in use", expandable_segments_in_use)
    for mode in ("enqueue", "sync", "event"):
        run("FusedLayerNorm/FusedRMSNorm fwd+bwd, %s mode" % mode, matrix, mode)
    run("after empty_cache (chunks remapped)", after_empty_cache)
    run("regions released when the client closes", released_on_close)
    print("test_vmm_torch: %d passed, %d failed" % (results["passed"], results["failed"]))
    return 1 if results["failed"] else 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == CHILD_FLAG:
        sys.exit(child(sys.argv[2]))
    build_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "build"
    build_dir = build_dir if build_dir.is_absolute() else Path.cwd() / build_dir
    sys.exit(parent(build_dir))
