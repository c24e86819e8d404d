"""Idle cores kept from halting for a measurement, as latency benchmarks set up their machines.

At 50 requests/s the gateway's cores sit idle between requests. On this kind of virtual machine an idle core halts
(its `haltpoll` cpuidle state): the hypervisor takes the core back, and waking it again costs each hop of a request
(client to gateway, gateway to Redis, Redis back, gateway to the backend) a few hundred microseconds that a busy
core does not pay (`python -m bench.redis_round_trip`: a PING 20 ms after the last one against one right after).
Benchmark set-up guides steady the CPU for the same reason (Google Benchmark's "Reducing variance" fixes its
frequency), and tuned's `latency-performance` profile limits the cores' idle states. This does it the kernel's
documented way for one process: a PM QoS request of 0 us exit latency written to `/dev/cpu_dma_latency` and held
while the file stays open. Idle cores then poll instead of halting. The kernel drops the request when the file is
closed (also when the process dies), so nothing outlives the measurement. It costs power, and it changes the
machine for every target alike (direct, the gateways, LiteLLM), so the added latency still compares like with like.

    with idle_states("poll"):   # "halt": the machine as it is configured (nothing is written)
        ...
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterator
from pathlib import Path

PM_QOS_DEVICE = Path("/dev/cpu_dma_latency")
# Each mode, as a report describes the machine it measured.
MODES = {"halt": "halt as configured", "poll": "poll (a PM QoS request of 0 us held: bench/cpu_idle.py)"}


class IdleStatesUnavailable(RuntimeError):
    """The PM QoS device cannot be written (not root, not Linux, or no such device in this container)."""


def latency_limit_us(device: Path = PM_QOS_DEVICE) -> int:
    """The exit latency (us) idle states are held to now, every process's requests together (2,000,000,000 when
    nothing limits them)."""
    fd = os.open(device, os.O_RDONLY)
    try:
        return int(struct.unpack("i", os.read(fd, 4))[0])
    finally:
        os.close(fd)


@contextlib.contextmanager
def idle_states(mode: str, device: Path = PM_QOS_DEVICE) -> Iterator[None]:
    """`poll`: idle cores poll instead of halting while the block runs; `halt`: nothing changes."""
    if mode not in MODES:
        raise ValueError(f"idle states: {mode!r} is not one of {', '.join(MODES)}")
    if mode == "halt":
        yield
        return
    try:
        fd = os.open(device, os.O_WRONLY)
    except OSError as exc:
        raise IdleStatesUnavailable(f"cannot hold idle cores from halting: {device}: {exc.strerror}") from exc
    try:
        os.write(fd, struct.pack("i", 0))
        yield
    finally:
        os.close(fd)
