"""Where benchmark 3's step goes on a GPU (`python -m bench.gpu_profile --device cuda`): a diagnostic.

Runs `bench.engine.bench_overhead` under torch.profiler for a few steps per policy and prints, per step,
the kernels launched, the host waits for the device (synchronize and device-to-host copies), the host time
spent in torch calls and the GPU's busy time. The untimed parts of the benchmark's step (drawing the
attention and logits, copying them over, the pool's free list) are inside the profile too: a few ops a step.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.engine import bench_overhead


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--policies", nargs="+", default=["fifo", "token-pd-ewma", "token-pd"])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    # One sync and one tiny kernel on this machine: the unit every policy op pays at least once.
    x = torch.zeros(8, device=args.device)
    for _ in range(100):
        x.add_(1)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(1000):
        x.add_(1)
    torch.cuda.synchronize()
    launch_us = (time.perf_counter() - started) * 1e3
    started = time.perf_counter()
    for _ in range(1000):
        int(x[0].item())
    sync_us = (time.perf_counter() - started) * 1e3
    print(f"profile unit: one tiny in-place op {launch_us:.1f} us (queued), one .item() round trip {sync_us:.1f} us")
    for name in args.policies:
        bench_overhead(name, args.streams, args.tokens, 2, 1, device=args.device)  # warm the allocator
        steps = args.steps + 10  # bench_overhead runs 10 warm-up steps before the timed ones
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            bench_overhead(name, args.streams, args.tokens, args.steps, 1, device=args.device)
        events = prof.key_averages()
        count = {e.key: e.count for e in events}
        launches = sum(c for k, c in count.items() if k in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
        waits = sum(c for k, c in count.items() if k in ("cudaStreamSynchronize", "cudaDeviceSynchronize"))
        copies = sum(c for k, c in count.items() if k == "cudaMemcpyAsync")
        gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        print(f"profile {name:<14} per step (setup included once): {launches / steps:6.0f} kernel launches, "
              f"{waits / steps:5.1f} synchronizes, {copies / steps:5.1f} memcpy calls, "
              f"GPU busy {gpu_us / steps / 1000:6.3f} ms", flush=True)
        top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
        print("   host time by op: " + ", ".join(
            f"{e.key} {e.self_cpu_time_total / steps / 1000:.3f} ms x{e.count / steps:.0f}" for e in top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
