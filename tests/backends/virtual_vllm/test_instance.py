"""Exact small cases of the instance model under the fixed latency model (1 ms/prompt token, 2 ms/step),
run in virtual time by the simulator's event loop and cluster (the clock the instance has there)."""

from __future__ import annotations

import pytest

from apps.simulator.cluster import Cluster
from apps.simulator.engine import EventLoop
from backends.virtual_vllm.instance import Instance, SimRequest
from backends.virtual_vllm.latency import FixedLatency

LATENCY = FixedLatency(prefill_s_per_token=0.001, decode_s_per_token=0.002)


def make_cluster(instances: int = 1, **instance_options) -> tuple[EventLoop, Cluster]:
    loop = EventLoop()
    nodes = [Instance(i, loop, LATENCY, **instance_options) for i in range(instances)]
    return loop, Cluster(loop, nodes, routing=instance_options.pop("routing", "round-robin"))


def send(loop: EventLoop, cluster: Cluster, at: float, rid: int, prompt: int, output: int) -> SimRequest:
    request = SimRequest(rid, "t", prompt, output, at)
    loop.at(at, cluster.submit, request)
    return request


def test_lone_request_ttft_is_its_prefill_and_e2e_adds_one_step_per_further_token():
    loop, cluster = make_cluster()
    request = send(loop, cluster, 0.0, 1, prompt=10, output=5)
    loop.run()
    assert request.ttft == pytest.approx(0.010)
    assert request.e2e == pytest.approx(0.010 + 4 * 0.002)
    assert cluster.instances[0].output_tokens == 5


def test_one_slot_serialises_requests():
    loop, cluster = make_cluster(max_num_seqs=1)
    first = send(loop, cluster, 0.0, 1, 10, 5)
    second = send(loop, cluster, 0.0, 2, 10, 5)
    loop.run()
    assert first.finished_at == pytest.approx(0.018)
    assert second.first_token_at == pytest.approx(0.028)
    assert second.finished_at == pytest.approx(0.036)


def test_two_slots_prefill_together_then_decode_together():
    loop, cluster = make_cluster(max_num_seqs=2)
    requests = [send(loop, cluster, 0.0, rid, 10, 5) for rid in (1, 2)]
    loop.run()
    # The second arrival finds the first one's prefill step under way, so it is prefilled in the next step,
    # which also decodes the first sequence: 10 ms + (10 ms + 2 ms).
    assert requests[0].first_token_at == pytest.approx(0.010)
    assert requests[1].first_token_at == pytest.approx(0.022)
    assert requests[0].finished_at == pytest.approx(0.010 + 0.012 + 3 * 0.002)
    assert requests[1].finished_at == pytest.approx(0.022 + 4 * 0.002)


def test_an_arrival_joins_at_the_end_of_the_decode_step_in_progress():
    loop, cluster = make_cluster(max_num_seqs=4)
    long = send(loop, cluster, 0.0, 1, 10, 100)
    late = send(loop, cluster, 0.051, 2, 10, 3)
    loop.run()
    # Decode steps end at 10 ms + 2 ms * k; the one in progress at 51 ms ends at 52 ms, then the joint
    # step (10 prompt tokens + one decode) takes 12 ms.
    assert late.first_token_at == pytest.approx(0.064)
    assert late.finished_at == pytest.approx(0.064 + 2 * 0.002)
    # The long request lost no steps: it decoded in the joint step as well.
    assert long.finished_at == pytest.approx(0.010 + 99 * 0.002 + 0.010)


def test_kv_exhaustion_preempts_the_newest_sequence_and_recomputes_it():
    loop, cluster = make_cluster(max_num_seqs=4, kv_blocks=6, block_size=4, watermark=0.0)
    a = send(loop, cluster, 0.0, 1, 8, 9)
    b = send(loop, cluster, 0.0, 2, 8, 9)
    loop.run()
    instance = cluster.instances[0]
    assert instance.preemptions == 1
    assert b.preemptions == 1 and a.preemptions == 0
    assert a.completed if hasattr(a, "completed") else a.finished_at is not None
    # Both were served; the preempted one finished after the survivor, having kept its first-token time.
    assert b.first_token_at < a.finished_at < b.finished_at
    assert instance.used_blocks == 0
    assert cluster.stats.completed == 2


def test_kv_blocks_are_returned_after_every_request():
    loop, cluster = make_cluster(max_num_seqs=8, kv_blocks=40, block_size=16)
    for rid in range(30):
        send(loop, cluster, rid * 0.003, rid, 50 + rid, 20 + rid)
    loop.run()
    instance = cluster.instances[0]
    assert cluster.stats.completed == 30
    assert instance.used_blocks == 0
    assert sum(instance.phase_counts) == 0 and not instance.running


def test_a_prompt_larger_than_the_cache_is_dropped_as_unservable():
    loop, cluster = make_cluster(kv_blocks=4, block_size=4, watermark=0.0)
    send(loop, cluster, 0.0, 1, 100, 5)
    ok = send(loop, cluster, 0.0, 2, 4, 2)
    loop.run()
    assert cluster.stats.lost["unservable"] == 1
    assert ok.finished_at is not None


def test_aborting_mid_batch_returns_every_block_and_frees_the_slot():
    loop, cluster = make_cluster(max_num_seqs=1, kv_blocks=100, block_size=4, watermark=0.0)
    doomed = send(loop, cluster, 0.0, 1, 10, 200)
    waiter = send(loop, cluster, 0.0, 2, 10, 5)
    instance = cluster.instances[0]

    def abort_and_check() -> None:
        produced = instance.tokens_generated(doomed)
        assert 0 < produced < 200
        assert instance.abort(doomed)

    loop.at(0.101, abort_and_check)
    loop.run()
    assert waiter.finished_at is not None and doomed.finished_at is None
    assert instance.used_blocks == 0 and not instance.running


def test_tokens_generated_counts_decode_steps_of_the_batch_in_progress():
    loop, cluster = make_cluster()
    request = send(loop, cluster, 0.0, 1, 10, 100)
    seen: list[int] = []
    for when in (0.005, 0.0101, 0.0141, 0.05):
        loop.at(when, lambda: seen.append(cluster.instances[0].tokens_generated(request)))
    loop.run()
    # Prefill ends at 10 ms (1 token); each 2 ms decode step adds one; at 50 ms 21 steps are done.
    assert seen == [0, 1, 3, 21]
