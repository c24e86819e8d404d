"""The simulator's cluster over instances: routing (round-robin, least-loaded, KV-aware) and capacity events,
under the fixed latency model (1 ms/prompt token, 2 ms/step)."""

from __future__ import annotations

import pytest

from apps.simulator.cluster import Cluster
from apps.simulator.engine import EventLoop
from backends.virtual_vllm.instance import Instance, SimRequest
from backends.virtual_vllm.latency import FixedLatency

LATENCY = FixedLatency(prefill_s_per_token=0.001, decode_s_per_token=0.002)


def make_cluster(instances: int = 1) -> tuple[EventLoop, Cluster]:
    loop = EventLoop()
    return loop, Cluster(loop, [Instance(i, loop, LATENCY) for i in range(instances)], routing="round-robin")


def send(loop: EventLoop, cluster: Cluster, at: float, rid: int, prompt: int, output: int) -> SimRequest:
    request = SimRequest(rid, "t", prompt, output, at)
    loop.at(at, cluster.submit, request)
    return request


def test_round_robin_alternates_and_least_loaded_prefers_the_idle_instance():
    loop, cluster = make_cluster(instances=2)
    requests = [send(loop, cluster, 0.0, rid, 10, 5) for rid in range(4)]
    loop.run()
    assert sorted(r.instance for r in requests) == [0, 0, 1, 1]
    assert requests[0].instance != requests[1].instance

    loop = EventLoop()
    nodes = [Instance(i, loop, LATENCY) for i in range(2)]
    cluster = Cluster(loop, nodes, routing="least-loaded")
    busy = [SimRequest(rid, "t", 10, 50, 0.0) for rid in range(3)]
    for request in busy:
        nodes[0].enqueue(request)
    newcomer = SimRequest(9, "t", 10, 5, 0.0)
    cluster.submit(newcomer)
    assert newcomer.instance == 1


def test_removing_an_instance_loses_its_requests_and_restoring_serves_again():
    loop, cluster = make_cluster(instances=1)
    lost = send(loop, cluster, 0.0, 1, 10, 100)
    loop.at(0.05, cluster.remove_instance, 0)
    after = send(loop, cluster, 0.06, 2, 10, 5)  # no instance online
    loop.at(0.1, cluster.restore_instance, 0)
    served = send(loop, cluster, 0.2, 3, 10, 5)
    loop.run()
    assert lost.outcome == "lost:instance_removed"
    assert after.outcome == "lost:no_instance"
    assert served.finished_at == pytest.approx(0.2 + 0.018)
    assert cluster.stats.completed == 1


def test_kv_aware_routing_prefers_the_instance_with_the_emptier_cache():
    loop = EventLoop()
    nodes = [Instance(i, loop, LATENCY, kv_blocks=100, block_size=4) for i in range(2)]
    cluster = Cluster(loop, nodes, routing="kv-aware")
    nodes[0].enqueue(SimRequest(1, "t", 200, 50, 0.0))  # 50 blocks on instance 0
    newcomer = SimRequest(2, "t", 8, 5, 0.0)
    cluster.submit(newcomer)
    assert nodes[0].kv_utilization > 0.4
    assert newcomer.instance == 1
