from __future__ import annotations

import random

import pytest

from backends.engine import (
    BatchSchedulerConfig,
    CompletedEvent,
    ContinuousBatchScheduler,
    PrefillStrategy,
    PromptRequest,
    SamplingParams,
    TenantConfig,
    TokenEvent,
)
from backends.engine.runner import EngineRunner, RunnerConfig

TENANTS = ("alpha", "beta", "gamma", "delta")


def decode(
    model_dir, requests: list[PromptRequest], strategy: PrefillStrategy, batch: int
) -> dict[str, list[int]]:
    runner = EngineRunner(str(model_dir), "none", RunnerConfig(budget_tokens=4096, max_batch_size=batch))
    scheduler = ContinuousBatchScheduler(
        runner, BatchSchedulerConfig(max_batch_size=batch, prefill_strategy=strategy, prefill_chunk_tokens=7)
    )
    for tenant in TENANTS:
        scheduler.register_tenant(TenantConfig(tenant, max_concurrent=2, max_blocks=1000))
    for request in requests:
        assert scheduler.submit(request) is None
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    completed = 0
    while scheduler.has_work():
        for event in scheduler.step():
            if isinstance(event, TokenEvent):
                tokens[event.request_id].append(event.token)
            elif isinstance(event, CompletedEvent):
                completed += 1
    assert completed == len(requests)
    assert runner.model.pool.num_used == 0
    return tokens


@pytest.mark.parametrize("strategy", list(PrefillStrategy))
def test_batched_greedy_of_four_tenants_is_token_identical_to_each_alone(tiny_model_dir, strategy):
    rng = random.Random(5)
    requests = [
        PromptRequest(
            tenant,
            f"{tenant}-{i}",
            tuple(rng.randrange(3, 1000) for _ in range(rng.randrange(4, 30))),
            SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        )
        for i, tenant in enumerate(TENANTS)
    ]
    batched = decode(tiny_model_dir, requests, strategy, batch=4)
    for request in requests:
        alone = decode(tiny_model_dir, [request], PrefillStrategy.BLOCKING_BEFORE_DECODE, batch=1)
        assert batched[request.request_id] == alone[request.request_id]
    assert all(len(tokens) == 10 for tokens in batched.values())


def test_seeded_sampling_is_reproducible(tiny_model_dir):
    request = PromptRequest(
        "alpha", "s", (5, 6, 7), SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    )
    first = decode(tiny_model_dir, [request], PrefillStrategy.CHUNKED, batch=1)
    second = decode(tiny_model_dir, [request], PrefillStrategy.CHUNKED, batch=1)
    other = decode(
        tiny_model_dir,
        [
            PromptRequest(
                "alpha",
                "s",
                (5, 6, 7),
                SamplingParams(max_tokens=8, temperature=1.0, seed=4, ignore_eos=True),
            )
        ],
        PrefillStrategy.CHUNKED,
        batch=1,
    )
    assert first == second
    assert first != other


def test_forty_prompts_of_four_tenants_at_quota_two_all_finish_on_the_real_model(tiny_model_dir):
    runner = EngineRunner(str(tiny_model_dir), "token-pd", RunnerConfig(budget_tokens=256, max_batch_size=6))
    scheduler = ContinuousBatchScheduler(
        runner, BatchSchedulerConfig(max_batch_size=6, max_pending_prompts=64, block_size=8)
    )
    for tenant in TENANTS:
        scheduler.register_tenant(TenantConfig(tenant, max_concurrent=2, max_blocks=8))
    rng = random.Random(9)
    for i in range(40):
        prompt = tuple(rng.randrange(3, 1000) for _ in range(rng.randrange(4, 40)))
        request = PromptRequest(
            TENANTS[i % 4], f"r{i}", prompt, SamplingParams(max_tokens=6, ignore_eos=True)
        )
        assert scheduler.submit(request) is None
    finished: dict[str, int] = dict.fromkeys(TENANTS, 0)
    while scheduler.has_work():
        for event in scheduler.step():
            if isinstance(event, CompletedEvent):
                finished[event.tenant_id] += 1
        for tenant in TENANTS:
            snap = scheduler.tenant_state(tenant)
            assert snap.active_count <= 2 and snap.allocated_blocks <= 8
        assert runner.model.pool.num_used <= 256
    assert finished == dict.fromkeys(TENANTS, 10)
