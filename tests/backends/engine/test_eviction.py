from __future__ import annotations

import math
import random

import pytest
import torch

from backends.engine import (
    BatchSchedulerConfig,
    CompletedEvent,
    CompletionReason,
    ContinuousBatchScheduler,
    PromptRequest,
    SamplingParams,
    TenantConfig,
    TokenEvent,
)
from backends.engine.eviction import (
    POLICIES,
    FixedStepTokenPDPolicy,
    H2OPolicy,
    PoolView,
    ProtectedTokens,
    TokenPDParams,
    TokenPDPolicy,
    TokenPDPredictorPolicy,
    lowest_scored,
    lowest_scored_per_owner,
    make_policy,
    same_flags,
    sparse_nonzero,
)
from backends.engine.runner import EngineRunner, RunnerConfig


def run_workload(
    model_dir,
    policy: str,
    budget: int,
    prompts: int = 12,
    batch: int = 8,
    max_tokens: int = 24,
    seed: int = 0,
):
    runner = EngineRunner(str(model_dir), policy, RunnerConfig(budget_tokens=budget, max_batch_size=batch))
    scheduler = ContinuousBatchScheduler(
        runner, BatchSchedulerConfig(max_batch_size=batch, max_pending_prompts=100)
    )
    tenants = ["a", "b", "c", "d"]
    for tenant in tenants:
        scheduler.register_tenant(TenantConfig(tenant, max_concurrent=3, max_blocks=1000))
    rng = random.Random(seed)
    vocab = runner.model.config.vocab_size
    for i in range(prompts):
        prompt = tuple(rng.randrange(3, vocab) for _ in range(rng.randrange(8, 40)))
        scheduler.submit(
            PromptRequest(
                tenants[i % 4], f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            )
        )
    events = []
    trace = []
    for _ in range(2000):
        if not scheduler.has_work():
            break
        events.extend(scheduler.step())
        pool = runner.model.pool
        view = runner.view()
        trace.append((pool.num_used, int(pool.live.sum()), runner.policy.gauges().get("token_pd_mu")))
        # Sinks of every cached sequence are still there: positions 0..3 are never evicted.
        for seq in runner.sequences.values():
            if seq.cached:
                held_positions = set(pool.position[seq.slots].tolist())
                assert set(range(min(4, seq.seen))) <= held_positions
                assert pool.position[seq.slots].tolist() == sorted(held_positions)  # order preserved
        assert int(view.live.sum()) == sum(seq.cached for seq in runner.sequences.values())
        # The view the runner reuses for the next cut-off protects exactly what a fresh one would.
        if runner.policy.evicts:
            reused = runner._current_view()
            assert torch.equal(reused.protected & reused.live, view.protected)
        # The incremental protected mask is the one a pass over the whole pool would compute.
        assert torch.equal(runner.protected.mask, runner.protected.from_scratch(runner._seen_by_row))
    else:
        raise AssertionError("workload did not finish")
    return runner, scheduler, events, trace


def test_token_pd_never_exceeds_the_kv_budget_and_finishes_every_request(tiny_model_dir):
    budget = 160  # 12 prompts of 8-40 tokens + 24 generated each would need about 600 slots
    runner, scheduler, events, trace = run_workload(tiny_model_dir, "token-pd", budget)
    assert max(used for used, _, _ in trace) <= budget
    assert all(used == live for used, live, _ in trace)
    completed = [e for e in events if isinstance(e, CompletedEvent)]
    assert len(completed) == 12
    assert {e.reason for e in completed} == {CompletionReason.MAX_TOKENS_REACHED}
    assert sum(isinstance(e, TokenEvent) for e in events) == 12 * 24
    assert runner.stats.tokens_evicted > 0
    mus = [mu for _, _, mu in trace]
    assert max(mus) > mus[0]  # the price rose under memory pressure
    assert runner.model.pool.num_used == 0


@pytest.mark.parametrize("policy", sorted(set(POLICIES) - {"token-pd"}))
def test_every_policy_respects_the_budget(tiny_model_dir, policy):
    budget = 160
    runner, _, events, trace = run_workload(tiny_model_dir, policy, budget, prompts=8, max_tokens=12)
    assert max(used for used, _, _ in trace) <= budget
    assert sum(isinstance(e, CompletedEvent) for e in events) == 8
    if policy == "none":
        assert runner.stats.tokens_evicted == 0 and runner.stats.preemptions > 0
    else:
        assert runner.stats.tokens_evicted > 0


def test_without_pressure_eviction_changes_nothing(tiny_model_dir):
    outputs = {}
    for policy in ("none", "token-pd", "h2o"):
        _, _, events, _ = run_workload(tiny_model_dir, policy, budget=4096, prompts=6, max_tokens=10)
        outputs[policy] = sorted(
            (e.request_id, e.position, e.token) for e in events if isinstance(e, TokenEvent)
        )
    assert outputs["none"] == outputs["token-pd"]


def synthetic_view(
    owner: list[int], position: list[int], seen: list[int], protected: list[bool], budget: int
) -> PoolView:
    owner_t = torch.tensor(owner)
    return PoolView(
        live=owner_t >= 0,
        protected=torch.tensor(protected),
        owner=owner_t,
        position=torch.tensor(position),
        birth=torch.arange(len(owner)),
        owner_seen=torch.tensor(seen),
        num_rows=4,
        running_rows=torch.tensor(sorted(set(o for o in owner if o >= 0))),
        budget_tokens=budget,
        step=1,
    )


def test_token_pd_prices_out_low_value_tokens_and_the_price_follows_demand():
    policy = TokenPDPolicy()
    policy.bind(num_slots=6, bytes_per_token=100, budget_tokens=4, max_batch_size=2)
    policy.on_insert(torch.arange(6), 1)
    view = synthetic_view([0, 0, 0, 1, 1, 1], [0, 1, 2, 0, 1, 2], [3, 3, 3, 3, 3, 3], [False] * 6, budget=4)
    everyone = torch.ones(6, dtype=torch.bool)
    policy.observe(view, torch.tensor([0.5, 0.01, 0.2, 0.002, 0.3, 0.05]), everyone)
    # EWMA: the first observation seeds R; later ones move it by alpha; a sequence that sits out keeps R.
    policy.observe(view, torch.tensor([0.5, 0.01, 0.2, 0.002, 0.3, 0.15]), torch.tensor([True] * 5 + [False]))
    assert policy.ret[5].item() == pytest.approx(0.05)
    policy.observe(view, torch.tensor([0.5, 0.01, 0.2, 0.002, 0.3, 0.15]), everyone)
    assert policy.ret[5].item() == pytest.approx(0.05 + 0.3 * 0.1)
    assert policy.risk()[5].item() == pytest.approx(0.3 * 0.05**2 + 0.3 * 0.15**2 - 0.08**2 + 0.4 * 0.05**2)
    start_mu = policy.mu
    policy.end_step(view, demand_tokens=6)  # 6 wanted, 4 fit: price rises
    assert policy.mu > start_mu
    policy.mu = 0.02 / 100  # price one token at 0.02 of attention mass
    victims = sorted(policy.voluntary_evictions(view).tolist())
    assert victims == [1, 3]  # mass 0.01 and 0.002 are below the price
    policy.end_step(view, demand_tokens=2)  # demand below budget: price falls
    assert policy.mu < 0.02 / 100
    # The exact cut-off takes the lowest-valued token first.
    assert policy.make_room(view, 1).tolist() == [3]


def test_h2o_keeps_recent_window_and_heavy_hitters_per_sequence():
    policy = H2OPolicy(per_sequence_budget=4)
    policy.bind(num_slots=8, bytes_per_token=1, budget_tokens=8, max_batch_size=2)
    policy.on_insert(torch.arange(8), 1)
    view = synthetic_view([0] * 8, list(range(8)), [8] * 8, [False] * 8, budget=8)
    policy.observe(
        view, torch.tensor([0.9, 0.05, 0.4, 0.01, 0.02, 0.1, 0.3, 0.3]), torch.ones(8, dtype=torch.bool)
    )
    victims = sorted(policy.voluntary_evictions(view).tolist())
    # Keep the two most recent (6, 7) and the two heaviest of the rest (0 and 2).
    assert victims == [1, 3, 4, 5]


def test_lowest_scored_per_owner_respects_each_owner_excess():
    score = torch.tensor([5.0, 1.0, 3.0, 2.0, 0.5, 4.0])
    owner = torch.tensor([0, 0, 0, 1, 1, 1])
    chosen = lowest_scored_per_owner(score, torch.ones(6, dtype=torch.bool), owner, torch.tensor([2, 1]))
    assert sorted(chosen.tolist()) == [1, 2, 4]


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("clairvoyant")


def test_return_predictor_learns_returns_from_logits_self_supervised():
    from backends.engine.eviction import ReturnPredictor

    vocab, slots = 32, 64
    generator = torch.Generator().manual_seed(0)
    predictor = ReturnPredictor(vocab, hidden=32, horizon=2, learning_rate=1e-2, examples_per_step=slots, seed=1)
    # Ground truth the predictor must discover: confident steps (peaked logits) produce heavy tokens.
    live = torch.ones(slots, dtype=torch.bool)
    birth = torch.arange(slots)

    def realised(logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits, dim=-1).max(dim=-1).values * 0.5

    probe = torch.randn(256, vocab, generator=generator) * torch.rand(256, 1, generator=generator) * 6
    before = torch.mean((predictor.predict(probe) - realised(probe)) ** 2).item()
    returns = torch.zeros(slots)
    for step in range(400):
        logits = (
            torch.randn(slots, vocab, generator=generator) * torch.rand(slots, 1, generator=generator) * 6
        )
        birth = birth + slots  # every step reuses the slots for new tokens
        predictor.remember(torch.arange(slots), birth, logits, step)
        returns = realised(logits)
        # Tell it `horizon` steps have passed, so this step's examples are ready, targets realised.
        predictor.train_step(returns, live, birth, step + predictor.horizon)
    after = torch.mean((predictor.predict(probe) - realised(probe)) ** 2).item()
    assert predictor.trained_examples == 400 * slots
    assert after < before / 4
    # An example whose slot was reused by a newer token before its horizon is dropped, not trained on.
    predictor.remember(torch.arange(slots), birth, probe[:slots], 1000)
    predictor.train_step(returns, live, birth + slots, 1000 + predictor.horizon)
    assert predictor.trained_examples == 400 * slots


def test_the_predictor_forecasts_every_new_token_and_trains_on_a_sample_of_them():
    from backends.engine.eviction import ReturnPredictor

    predictor = ReturnPredictor(16, hidden=8, horizon=1, examples_per_step=5)
    logits = torch.randn(12, 16, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():  # as the engine's forward produces them
        logits = logits.clone()
    slots, births = torch.arange(12), torch.arange(12)
    forecast = predictor.forecast(slots, births, logits, step=1)
    assert torch.equal(forecast, predictor.predict(logits))
    predictor.train_step(torch.rand(12), torch.ones(12, dtype=torch.bool), births, step=2)
    assert predictor.trained_examples == 5
    assert predictor.w1.grad is not None  # it trained through autograd on features of inference-mode logits


def test_the_seeds_token_pd_with_its_return_predictor_is_the_default():
    import argparse

    from backends.engine.server import add_engine_arguments
    from backends.engine.service import EngineSettings

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert EngineSettings.__dataclass_fields__["policy"].default == "token-pd"
    assert parser.parse_args(["--model", "m"]).policy == "token-pd"
    assert type(make_policy("token-pd")) is TokenPDPredictorPolicy
    # The ablations: observed returns only, and a constant step size.
    assert type(make_policy("token-pd-ewma")) is TokenPDPolicy
    assert make_policy("token-pd-fixed-step").params.learning_rate_horizon is None


def test_the_price_step_shrinks_as_one_over_sqrt_t_and_restarts_when_the_batch_empties():
    policy = TokenPDPolicy(TokenPDParams(learning_rate=2.0, learning_rate_horizon=4))
    policy.bind(num_slots=6, bytes_per_token=100, budget_tokens=4, max_batch_size=2)
    busy = synthetic_view([0, 0, 0, 1, 1, 1], [0, 1, 2, 0, 1, 2], [3] * 6, [False] * 6, budget=4)
    idle = synthetic_view([-1] * 6, [0] * 6, [0] * 6, [False] * 6, budget=4)
    sizes = []
    for _ in range(64):
        policy.end_step(busy, demand_tokens=4)  # at the budget: the price stays, the steps count
        sizes.append(policy.step_size())
    assert sizes[0] == sizes[3] == pytest.approx(2.0)  # the first H steps at the configured eta
    assert sizes[15] == pytest.approx(2.0 * (4 / 16) ** 0.5)
    assert sizes[63] == pytest.approx(2.0 * (4 / 64) ** 0.5)
    # The multiplicative update uses the step size of its step: log(mu'/mu) = eta_t * violation.
    before = policy.mu
    policy.end_step(busy, demand_tokens=6)  # 6 wanted, 4 fit: violation 0.5 at t = 65
    assert math.log(policy.mu / before) == pytest.approx(2.0 * (4 / 65) ** 0.5 * 0.5)
    policy.end_step(idle, demand_tokens=0)  # the batch emptied: a new busy period starts
    assert policy.step_size() == pytest.approx(2.0)
    fixed = FixedStepTokenPDPolicy()
    fixed.bind(num_slots=6, bytes_per_token=100, budget_tokens=4, max_batch_size=2)
    for _ in range(500):
        fixed.end_step(busy, demand_tokens=4)
    assert fixed.step_size() == fixed.params.learning_rate


def test_token_pd_with_predictor_runs_inside_the_engine(tiny_model_dir):
    runner, _, events, trace = run_workload(tiny_model_dir, "token-pd", 160, prompts=8, max_tokens=16)
    assert max(used for used, _, _ in trace) <= 160
    assert sum(isinstance(e, CompletedEvent) for e in events) == 8
    assert runner.policy.predictor is not None and runner.policy.predictor.trained_examples > 0


def test_per_owner_selection_fast_path_matches_the_sorting_path():
    generator = torch.Generator().manual_seed(4)
    for _ in range(20):
        owner = torch.randint(0, 6, (200,), generator=generator)
        score = torch.randint(0, 20, (200,), generator=generator).float()  # many ties on purpose
        candidates = torch.rand(200, generator=generator) > 0.3
        excess = torch.randint(0, 2, (6,), generator=generator)
        excess[0] = 1
        fast = lowest_scored_per_owner(score, candidates, owner, excess)
        # The sorting path, forced by asking for the same thing with a 2 somewhere it cannot matter.
        padded = torch.cat([excess, torch.tensor([2])])
        slow = lowest_scored_per_owner(score, candidates, owner, padded)
        assert sorted(owner[fast].tolist()) == sorted(owner[slow].tolist())  # one per owner in excess
        assert sorted(score[fast].tolist()) == sorted(score[slow].tolist())  # the same (lowest) scores
        assert len(set(owner[fast].tolist())) == fast.numel()


@pytest.mark.parametrize("host_paths", [None, False])  # False: the torch steps a GPU pool takes
@pytest.mark.parametrize("seed", range(4))
def test_incremental_protected_mask_equals_the_one_from_scratch(seed, host_paths):
    """Random admits (decode tokens and prefill chunks), evictions and finished sequences over a pool:
    after every change the incremental mask is exactly live & (sink | recent window)."""
    rng = random.Random(seed)
    slots, rows, sinks, recent = 203, 6, 4, 8
    owner = torch.full((slots,), -1, dtype=torch.long)
    position = torch.zeros(slots, dtype=torch.long)
    live = torch.zeros(slots, dtype=torch.bool)
    seen = torch.zeros(rows, dtype=torch.long)
    protected = ProtectedTokens(owner, position, live, sinks, recent, num_rows=2, host_paths=host_paths)  # grows
    held: dict[int, list[int]] = {row: [] for row in range(rows)}

    def free(victims: list[int]) -> None:
        index = torch.tensor(victims, dtype=torch.long)
        live[index] = False
        owner[index] = -1

    for _ in range(600):
        action = rng.random()
        if action < 0.6:  # one step: a few rows each take 1 token (decode) or a chunk (prefill)
            free_slots = (~live).nonzero().squeeze(1).tolist()
            rng.shuffle(free_slots)
            taken: list[int] = []
            for row in rng.sample(range(rows), rng.randint(1, rows)):
                count = 1 if rng.random() < 0.7 else rng.randint(2, 20)
                if count > len(free_slots):
                    break
                new = [free_slots.pop() for _ in range(count)]
                index = torch.tensor(new, dtype=torch.long)
                live[index] = True
                owner[index] = row
                position[index] = torch.arange(int(seen[row]), int(seen[row]) + count)
                seen[row] += count
                held[row] += new
                taken += new
            protected.admit(torch.tensor(taken, dtype=torch.long), seen)
        elif action < 0.85:  # evictions, as policies make them: unprotected tokens only (rarely any)
            evictable = (live & ~protected.mask).nonzero().squeeze(1).tolist()
            if rng.random() < 0.05:
                evictable = live.nonzero().squeeze(1).tolist()
            victims = rng.sample(evictable, min(len(evictable), rng.randint(1, 10)))
            if victims:
                free(victims)
                protected.forget(torch.tensor(victims, dtype=torch.long))
                for row in held:
                    held[row] = [slot for slot in held[row] if slot not in victims]
        else:  # a sequence finishes (or is preempted): its row is reused from scratch later
            row = rng.randrange(rows)
            if held[row]:
                free(held[row])
            protected.release_row(row, torch.tensor(held[row], dtype=torch.long))
            held[row] = []
            seen[row] = 0
        assert torch.equal(protected.mask, protected.from_scratch(seen))


def test_sparse_nonzero_and_lowest_scored_match_the_plain_versions():
    generator = torch.Generator().manual_seed(0)
    for count in (0, 5, 8, 4099, 65536, 65541):
        for density in (0.0, 0.001, 0.05, 0.5, 1.0):
            mask = torch.rand(count, generator=generator) < density
            assert torch.equal(sparse_nonzero(mask), mask.nonzero().squeeze(1))
            assert torch.equal(sparse_nonzero(mask[::2]), mask[::2].nonzero().squeeze(1))  # strided: torch's
    score = torch.rand(65536, generator=generator)
    birth = torch.randperm(65536, generator=generator)
    for excluded in (0.01, 0.5):  # few excluded slots (patched by index) and many (masked fill)
        candidates = torch.rand(65536, generator=generator) >= excluded
        for values in (score, birth):
            chosen = lowest_scored(values, candidates, 300)
            fill = float("inf") if values.is_floating_point() else torch.iinfo(values.dtype).max
            _, expected = torch.topk(values.masked_fill(~candidates, fill), 300, largest=False, sorted=False)
            assert torch.equal(chosen, expected)


def test_same_flags_compares_every_byte_whatever_the_size():
    for count in (1, 7, 8, 4096, 4099):  # word-wise compare when the size is a multiple of 8, else bytes
        base = torch.zeros(count, dtype=torch.bool)
        assert same_flags(base, base.clone())
        for at in {0, count // 2, count - 1}:
            other = base.clone()
            other[at] = True
            assert not same_flags(base, other)


class _DenseTokenPD(TokenPDPolicy):
    """Token-PD's observe as passes over the whole pool (the reference for the incremental one)."""

    def on_insert(self, slots: torch.Tensor, step: int) -> None:
        self.ret[slots] = 0.0
        self.ret_sq[slots] = 0.0
        self.observed[slots] = False

    def observe(self, view: PoolView, mass: torch.Tensor, stepped: torch.Tensor) -> None:
        alpha, lam = self.params.ewma_alpha, self.params.risk_aversion
        sat_out = (view.live & ~stepped).nonzero().squeeze(1)
        kept_ret, kept_sq = self.ret[sat_out], self.ret_sq[sat_out]
        self.ret.lerp_(mass, alpha)
        self.ret_sq.mul_(1 - alpha).addcmul_(mass, mass, value=alpha)
        self.ret[sat_out], self.ret_sq[sat_out] = kept_ret, kept_sq
        fresh = (stepped & ~self.observed).nonzero().squeeze(1)
        self.ret[fresh] = mass[fresh]
        self.ret_sq[fresh] = mass[fresh] * mass[fresh]
        self.observed |= stepped
        torch.addcmul(self.ret, self.ret, self.ret, value=lam, out=self._value).sub_(self.ret_sq, alpha=lam)


@pytest.mark.parametrize("slots", [96, 20000])  # below and above the size where the 8-byte scans start
def test_token_pd_observe_with_pending_unobserved_slots_matches_the_dense_passes(slots):
    """Random arrivals, sequences sitting steps out, evictions and reuse of freed slots: the incremental
    bookkeeping of unobserved slots gives bit-for-bit the averages and values of full passes."""
    rng = random.Random(slots)
    generator = torch.Generator().manual_seed(slots)
    fast, dense, on_device = TokenPDPolicy(), _DenseTokenPD(), TokenPDPolicy()
    for policy in (fast, dense, on_device):
        policy.bind(num_slots=slots, bytes_per_token=100, budget_tokens=slots, max_batch_size=8)
    on_device.host_paths = False  # the torch passes a policy bound to a GPU takes, here on the CPU
    owner = torch.full((slots,), -1, dtype=torch.long)
    for step in range(1, 60):
        free = (owner < 0).nonzero().squeeze(1)
        new = free[torch.randperm(free.numel(), generator=generator)[: rng.randint(0, slots // 10)]]
        owner[new] = torch.randint(0, 8, (new.numel(),), generator=generator)
        for policy in (fast, dense, on_device):
            policy.on_insert(new, step)
        live = owner >= 0
        sitting_out = torch.tensor(rng.sample(range(8), rng.choice([0, 0, 1, 3])), dtype=torch.long)
        stepped = live & ~torch.isin(owner, sitting_out)
        mass = torch.rand(slots, generator=generator).pow_(4) * stepped
        view = synthetic_view(owner.tolist(), [0] * slots, [0] * slots, [False] * slots, budget=slots)
        for policy in (fast, dense, on_device):
            policy.observe(view, mass, stepped)
        for name in ("ret", "ret_sq", "_value", "observed"):
            assert torch.equal(getattr(fast, name), getattr(dense, name)), (step, name)
            assert torch.equal(getattr(fast, name), getattr(on_device, name)), (step, name)
        assert torch.equal(fast.voluntary_evictions(view), on_device.voluntary_evictions(view)), step
        gone = live.nonzero().squeeze(1)
        owner[gone[torch.randperm(gone.numel(), generator=generator)[: rng.randint(0, slots // 8)]]] = -1
