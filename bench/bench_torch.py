"""PyTorch's own LayerNorm/RMSNorm on the shapes of bench/bench_norm.c.

F.layer_norm and F.rms_norm forward, and backward through autograd
(torch.autograd.grad of the output with respect to x and the weights), in
bf16 and fp32 at 2^28 elements per shape, affine (gamma, and beta for
LayerNorm), timed with CUDA events: the median of REPS calls after WARMUP.
Bytes are counted as bench_norm.c counts them (every tensor read or written
once), so the GB/s of both programs compare directly. PyTorch has no
memory-efficient backward; bench/run.sh compares ours with its standard one.

Prints one line per measurement:
  torch op=ln_fwd dtype=bf16 cols=C rows=R us=T gbps=G
"""
import sys

import torch
import torch.nn.functional as F

TOTAL = 1 << 28
COLS = [128, 512, 1024, 2048, 4096, 8192, 12288, 16384, 32768]
WARMUP = 3
REPS = 25
EPS = 1e-5


def median_us(fn):
    start = [torch.cuda.Event(enable_timing=True) for _ in range(REPS)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(REPS)]
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    for i in range(REPS):
        start[i].record()
        fn()
        end[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(start, end))
    return times[REPS // 2] * 1e3


def job_bytes(op, rows, cols, es):
    row, col, stat = rows * cols * es, cols * es, rows * 4
    if op == "ln_fwd":
        return 2 * row + 2 * col + 2 * stat
    if op == "rms_fwd":
        return 2 * row + col + stat
    if op == "ln_bwd":
        return 3 * row + 2 * stat + 3 * col
    return 3 * row + stat + 2 * col  # rms_bwd


def bench_shape(dtype, name, cols):
    rows = TOTAL // cols
    es = torch.finfo(dtype).bits // 8
    x = torch.empty(rows, cols, device="cuda", dtype=dtype).uniform_(-2.0, 2.6)
    dy = torch.empty_like(x).uniform_(-1.0, 1.0)
    w = torch.empty(cols, device="cuda", dtype=dtype).uniform_(0.5, 1.5)
    b = torch.empty(cols, device="cuda", dtype=dtype).uniform_(-0.5, 0.5)
    shape = (cols,)
    results = {}
    with torch.no_grad():
        results["ln_fwd"] = median_us(lambda: F.layer_norm(x, shape, w, b, EPS))
        results["rms_fwd"] = median_us(lambda: F.rms_norm(x, shape, w, EPS))
    xg, wg, bg = x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    y = F.layer_norm(xg, shape, wg, bg, EPS)
    results["ln_bwd"] = median_us(
        lambda: torch.autograd.grad(y, (xg, wg, bg), dy, retain_graph=True))
    del y
    y = F.rms_norm(xg, shape, wg, EPS)
    results["rms_bwd"] = median_us(
        lambda: torch.autograd.grad(y, (xg, wg), dy, retain_graph=True))
    del y, x, dy, xg
    for op, us in results.items():
        gbps = job_bytes(op, rows, cols, es) / (us * 1e-6) / 1e9
        print(f"torch op={op} dtype={name} cols={cols} rows={rows} us={us:.1f} gbps={gbps:.1f}",
              flush=True)
    torch.cuda.empty_cache()


def main():
    only = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    print(f"torch version={torch.__version__} device=\"{torch.cuda.get_device_name()}\"",
          flush=True)
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "f32")):
        for cols in COLS:
            if not only or cols == only:
                bench_shape(dtype, name, cols)


if __name__ == "__main__":
    main()
