"""The seed's experiments in miniature, driven through the ledger in virtual time.

These check the shape (who is protected, who is throttled, which way debt moves), not the paper's
absolute figures; the simulator reproduces the full experiments.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from apps.policy import AdmissionLedger, AdmissionRequest, EntitlementLimits, ManualClock, priority_weight

SERVICE_S = 1.0
STEP_S = 0.1


@dataclass
class ClosedLoop:
    """`clients` users per entitlement, each sending the next request when the last one ends."""

    ledger: AdmissionLedger
    clients: dict[str, int]
    clock: ManualClock = field(default_factory=ManualClock)
    started_at: dict[str, float] = field(default_factory=dict)
    owner: dict[str, tuple[str, int]] = field(default_factory=dict)
    busy: set[tuple[str, int]] = field(default_factory=set)
    next_send: dict[tuple[str, int], float] = field(default_factory=dict)
    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)
    running_samples: dict[str, list[int]] = field(default_factory=dict)
    sequence: int = 0

    def _started(self, request_ids: tuple[str, ...]) -> None:
        for request_id in request_ids:
            self.started_at[request_id] = self.clock.now()

    def _free(self, request_id: str) -> None:
        client = self.owner.pop(request_id)
        self.busy.discard(client)
        self.next_send[client] = self.clock.now()

    def step(self) -> None:
        now = self.clock.advance(STEP_S)
        for request_id, started in list(self.started_at.items()):
            if started + SERVICE_S <= now + 1e-9:
                del self.started_at[request_id]
                self._started(self.ledger.release(request_id, now, output_tokens=16).started)
                self._free(request_id)
        for request_id in self.ledger.expire_waiting(now):
            entitlement = self.owner[request_id][0]
            self.outcomes[(entitlement, "expired")] += 1
            self._free(request_id)
        for entitlement, count in self.clients.items():
            for index in range(count):
                client = (entitlement, index)
                if client in self.busy or self.next_send.get(client, 0.0) > now + 1e-9:
                    continue
                self.sequence += 1
                request_id = f"{entitlement}-{self.sequence}"
                result = self.ledger.request(entitlement, AdmissionRequest(request_id, 16, 16), now)
                self.outcomes[(entitlement, result.decision.reason)] += 1
                if result.decision.admitted or result.decision.queued:
                    self.busy.add(client)
                    self.owner[request_id] = client
                    self._started(result.started)
                else:
                    self.next_send[client] = now + max(STEP_S, result.decision.retry_after_s)
        running = Counter(request_id.split("-")[0] for request_id in self.started_at)
        for entitlement in self.clients:
            self.running_samples.setdefault(entitlement, []).append(running[entitlement])

    def run(self, seconds: float, tick_every_s: float = 1.0) -> None:
        steps_per_tick = round(tick_every_s / STEP_S)
        for index in range(round(seconds / STEP_S)):
            self.step()
            if (index + 1) % steps_per_tick == 0:
                self.ledger.tick(self.clock.now())

    def mean_running(self, entitlement: str, last: int) -> float:
        samples = self.running_samples[entitlement][-last:]
        return sum(samples) / len(samples)


def test_experiment_1_guaranteed_protected_while_spot_is_throttled() -> None:
    ledger = AdmissionLedger(concurrency_capacity=16, mean_slo_ms=1000.0)
    for name, cls, slots in (("ga", "guaranteed", 6), ("spot", "spot", 10)):
        ledger.upsert_entitlement(EntitlementLimits(name, cls, concurrency=slots), now=0.0)
    loop = ClosedLoop(ledger, {"ga": 6, "spot": 14, "gc": 0})
    loop.run(20)
    assert loop.mean_running("ga", 50) == 6
    assert loop.mean_running("spot", 50) == 10  # spot fills the rest of the pool
    # guaranteed-c binds and joins: 22 slots of demand on 16
    ledger.upsert_entitlement(EntitlementLimits("gc", "guaranteed", concurrency=6), now=loop.clock.now())
    loop.clients["gc"] = 6
    loop.run(20)
    assert loop.mean_running("ga", 50) == 6 and loop.mean_running("gc", 50) == 6
    assert loop.mean_running("spot", 50) <= 4
    assert loop.outcomes[("ga", "pool_contended")] == 0 and loop.outcomes[("gc", "pool_contended")] == 0
    assert loop.outcomes[("spot", "pool_contended")] > 0
    loop.clients["gc"] = 0  # guaranteed-c leaves: spot recovers its share
    loop.run(2)
    ledger.upsert_entitlement(
        EntitlementLimits("gc", "guaranteed", concurrency=6, state="expired"), now=loop.clock.now()
    )
    ledger.remove_entitlement("gc")
    loop.run(10)
    assert loop.mean_running("spot", 30) == 10
    ledger.check_invariants()


def test_experiment_2_slo_aware_share_and_debt() -> None:
    ledger = AdmissionLedger(concurrency_capacity=16, mean_slo_ms=15_250.0)
    ledger.upsert_entitlement(EntitlementLimits("copilot", "elastic", concurrency=5, slo_target_ms=500.0), 0.0)
    ledger.upsert_entitlement(EntitlementLimits("synth", "elastic", concurrency=5, slo_target_ms=30_000.0), 0.0)
    # Copilot asks for its baseline, synth for more than its own.
    loop = ClosedLoop(ledger, {"copilot": 5, "synth": 7})
    loop.run(20)
    assert ledger.dynamics("synth").debt <= 0.0  # enough capacity: no one is owed anything
    ledger.set_capacity(8, now=loop.clock.now())  # the outage halves the pool
    loop.outcomes.clear()
    loop.run(40)
    copilot, synth = loop.mean_running("copilot", 300), loop.mean_running("synth", 300)
    assert copilot == 5 and synth == 3
    assert loop.outcomes[("copilot", "pool_contended")] == 0
    assert loop.outcomes[("synth", "pool_contended")] > 0
    synth_debt = ledger.dynamics("synth").debt
    assert synth_debt > 0.2 and synth_debt > ledger.dynamics("copilot").debt
    raised = priority_weight("elastic", 30_000, 15_250, debt=synth_debt)
    assert raised > priority_weight("elastic", 30_000, 15_250) * 1.5
    assert raised < priority_weight("elastic", 500, 15_250)  # copilot keeps precedence
    ledger.set_capacity(16, now=loop.clock.now())  # recovery: debt decays back towards zero
    loop.run(30)
    assert ledger.dynamics("synth").debt < synth_debt / 10
    ledger.check_invariants()


def test_bursting_above_baseline_earns_credit_and_yields_share() -> None:
    ledger = AdmissionLedger(concurrency_capacity=8, mean_slo_ms=15_250.0)
    ledger.upsert_entitlement(EntitlementLimits("copilot", "elastic", concurrency=5, slo_target_ms=500.0), 0.0)
    ledger.upsert_entitlement(EntitlementLimits("synth", "elastic", concurrency=5, slo_target_ms=30_000.0), 0.0)
    loop = ClosedLoop(ledger, {"copilot": 8, "synth": 0})
    loop.run(10)
    assert loop.mean_running("copilot", 50) == 8  # alone, it borrows the whole pool
    assert ledger.dynamics("copilot").debt < 0 and ledger.dynamics("copilot").burst > 0
    loop.clients["synth"] = 7
    loop.run(30)
    copilot, synth = loop.mean_running("copilot", 200), loop.mean_running("synth", 200)
    assert copilot > synth > 0  # the credit and burst terms let synth in, the SLO term keeps the order
    ledger.check_invariants()
