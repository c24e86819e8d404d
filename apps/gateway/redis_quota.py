"""Tenant quotas in Redis: one hash per quota scope, with the leases of its holds beside it under the same hash
tag (one cluster slot, so every pool of the tenant reaches it atomically: apps/gateway/lua/quota_*.lua).

The sequence that reserves, decides and settles is apps.policy.quota_offer's, as the ledger drives it;
`RedisQuotas` answers its steps, and `RedisStateStore` (apps.gateway.redis_state) calls it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from apps.gateway.redis_args import reply_float
from apps.policy.quota import QuotaCharge, QuotaClaim, QuotaStanding, QuotaVerdict, binding

# A tenant's quota hash outlives the longest window (a month) by a few days.
QUOTA_TTL_S = 35 * 86400

Call = Callable[[str, list[str], Sequence[Any]], Awaitable[Any]]


class RedisQuotas:
    def __init__(self, *, call: Call, prefix: str, now: Callable[[], str]) -> None:
        self._call, self._prefix, self._now = call, prefix, now

    def key(self, scope: str) -> str:
        return f"{self._prefix}{{q:{scope}}}:quota"

    def keys(self, scope: str) -> list[str]:
        """The scope's quota hash and the leases of its holds (one hash tag: one cluster slot)."""
        return [self.key(scope), f"{self._prefix}{{q:{scope}}}:leases"]

    async def reserve(self, claim: QuotaClaim) -> QuotaVerdict:
        args: list[Any] = [claim.request_id, claim.input_tokens, claim.max_tokens, QUOTA_TTL_S, self._now(),
                           "" if claim.lease_s is None else repr(float(claim.lease_s))]
        for charge in claim.charges:
            args += [charge.key, repr(float(charge.limit)), charge.window_id, repr(float(charge.seed_used)),
                     repr(float(charge.input_weight)), repr(float(charge.output_weight))]
        raw = await self._call("quota_reserve", self.keys(claim.scope), args)
        status = int(raw[0])
        if status == -1:
            return QuotaVerdict(False)
        if status == 0:
            charge = claim.charges[int(raw[1]) - 1]
            return QuotaVerdict(False, QuotaStanding(charge, reply_float(raw[2]), reply_float(raw[3])))
        standings = [QuotaStanding(charge, reply_float(raw[1 + 2 * i]), reply_float(raw[2 + 2 * i]))
                     for i, charge in enumerate(claim.charges)]
        return QuotaVerdict(True, binding(standings))

    async def settle(self, scope: str, request_id: str, input_tokens: float, output_tokens: float) -> None:
        await self._call("quota_settle", self.keys(scope),
                         [request_id, repr(float(input_tokens)), repr(float(output_tokens))])

    async def leases(self, *, scope: str, request_ids: Sequence[str], lease_s: float) -> list[str]:
        return [str(r) for r in await self._call("quota_leases", self.keys(scope),
                                                  [self._now(), repr(float(lease_s)), *request_ids])]

    async def standings(self, *, scope: str, charges: Sequence[QuotaCharge]) -> list[QuotaStanding]:
        if not charges:
            return []
        args: list[Any] = []
        for charge in charges:
            args += [charge.key, charge.window_id, repr(float(charge.seed_used))]
        raw = await self._call("quota_read", [self.key(scope)], args)
        return [QuotaStanding(charge, reply_float(raw[2 * i]), reply_float(raw[2 * i + 1]))
                for i, charge in enumerate(charges)]
