"""The shared state store: Redis, with one Lua script to read and one atomic compare-and-set commit.

Admission: `READ` returns, in one round trip, the entitlement's in-flight count and KV bytes, its
token bucket refilled to Redis' own clock (one clock for every process), debt, burst and version,
the pool's running totals, admission threshold, lowest evictable priority and version, and the
usage of the pool's reserved entitlements. `apps.policy.admit` decides in Python (one policy
implementation, no re-implementation in Lua); `COMMIT` applies the reservation only if the
entitlement's and the pool's versions are still the ones read, else the caller reads again. So
several gateway processes enforce one set of limits exactly.

`RELEASE` is one script too, and idempotent: the reservation lives in its own key, which the first
release deletes; a second release finds nothing and changes nothing.

The pool budget is shared too (seed 002's one controller per pool): `SLOT_ACQUIRE` is the dispatch of
every gateway process, one script that drops slots whose lease ran out, reads the budget the shared
AIMD tick published (`pool:{name}:budget`) and adds the request to `pool:{name}:slots` (a ZSET scored by
lease expiry) only while fewer than the budget are held. When the caller would dispatch at once, `COMMIT`
takes that slot itself (`admit(slot=...)`), and `RELEASE` always gives the request's slot back: the common
path costs no round trip for the budget. Releasing a slot alone is a ZREM (idempotent).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from collections.abc import Callable, Mapping
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from apps.gateway.snapshot import PoolInfo
from apps.gateway.state import (
    AdmitResult,
    GatewayStateStore,
    RateView,
    Reservation,
    ServedCounters,
    SlotGrant,
    SlotRequest,
    StateStoreUnavailable,
    rate_view,
)
from apps.policy import (
    AdmissionDecision,
    AdmissionRequest,
    EntitlementLimits,
    EntitlementUsage,
    PoolUsage,
    admit,
)
from apps.policy.admission import Reason

PREFIX = "tp:gw:"
MAX_ATTEMPTS = 12
# A reservation outlives any request; the key only guards release idempotency.
RESERVATION_TTL_S = 24 * 3600
# Every reservation holds a lease its gateway renews while the request runs; a reservation whose
# lease ran out belonged to a process that died, and any gateway's reaper releases it.
LEASE_S = 60.0

# Bucket: capacity < 0 means unlimited. Level and timestamp live in the entitlement hash.
_REFILL = """
local function now_s()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function level_at(key, capacity, rate, now)
  if capacity < 0 then return -1 end
  local level = tonumber(redis.call('HGET', key, 'level'))
  local ts = tonumber(redis.call('HGET', key, 'ts'))
  if level == nil then return capacity end
  if ts ~= nil and now > ts then level = level + (now - ts) * rate end
  if level > capacity then level = capacity end
  return level
end
"""

# One slot of the pool's budget: drop the slots whose lease ran out (a dead process's), then add this
# request if fewer than the budget are held. The budget is the one the shared AIMD tick published,
# clipped to the pool's capacity the caller knows (replicas may have gone); none published: the capacity.
_TAKE_SLOT = """
local function take_slot(slots, budget_key, request_id, lease_s, capacity, now)
  redis.call('ZREMRANGEBYSCORE', slots, '-inf', now)
  local budget = tonumber(redis.call('GET', budget_key) or capacity) or capacity
  if budget > capacity then budget = capacity end
  local held = redis.call('ZCARD', slots)
  local mine = redis.call('ZSCORE', slots, request_id)
  if mine or held < budget then
    redis.call('ZADD', slots, now + lease_s, request_id)
    if not mine then held = held + 1 end
    return {1, budget, held}
  end
  return {0, budget, held}
end
"""

SLOT_ACQUIRE = _REFILL + _TAKE_SLOT + """
return take_slot(KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), now_s())
"""

READ = _REFILL + """
local ent, pool, prio, evict = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local capacity, rate = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = now_s()
local e = redis.call('HMGET', ent, 'inflight', 'kv', 'debt', 'burst', 'ver')
local p = redis.call('HMGET', pool, 'running', 'kv', 'ver', 'ev_running', 'ev_kv')
local low = redis.call('ZRANGE', prio, 0, 0, 'WITHSCORES')
local low_evict = redis.call('ZRANGE', evict, 0, 0, 'WITHSCORES')
local out = {e[1] or '0', e[2] or '0', tostring(level_at(ent, capacity, rate, now)), e[3] or '0', e[4] or '0',
             e[5] or '0', p[1] or '0', p[2] or '0', p[3] or '0', low[2] or '', low_evict[2] or '',
             p[4] or '0', p[5] or '0'}
for i = 5, #KEYS do
  local r = redis.call('HMGET', KEYS[i], 'inflight', 'kv')
  table.insert(out, r[1] or '0')
  table.insert(out, r[2] or '0')
end
return out
"""

COMMIT = _REFILL + _TAKE_SLOT + """
local ent, pool, prio, evict, res = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
if (redis.call('HGET', ent, 'ver') or '0') ~= ARGV[1] or (redis.call('HGET', pool, 'ver') or '0') ~= ARGV[2] then
  return {0}
end
local cost, kv, priority = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local capacity, rate = tonumber(ARGV[8]), tonumber(ARGV[9])
local now = now_s()
local level = level_at(ent, capacity, rate, now)
if capacity >= 0 then
  level = level - cost
  redis.call('HSET', ent, 'level', tostring(level), 'ts', tostring(now))
end
local inflight = redis.call('HINCRBY', ent, 'inflight', 1)
redis.call('HINCRBYFLOAT', ent, 'kv', kv)
redis.call('HINCRBY', ent, 'ver', 1)
redis.call('HINCRBY', pool, 'running', 1)
redis.call('HINCRBYFLOAT', pool, 'kv', kv)
redis.call('HINCRBY', pool, 'ver', 1)
redis.call('ZADD', prio, priority, ARGV[7])
if ARGV[6] == '1' then
  redis.call('ZADD', evict, priority, ARGV[7])
  redis.call('HINCRBY', pool, 'ev_running', 1)
  redis.call('HINCRBYFLOAT', pool, 'ev_kv', kv)
end
redis.call('HSET', res, 'cost', ARGV[3], 'kv', ARGV[4], 'ent', ent, 'pool', pool, 'prio', prio, 'evict', evict,
           'cap', ARGV[8], 'rate', ARGV[9])
redis.call('EXPIRE', res, tonumber(ARGV[10]))
redis.call('ZADD', KEYS[6], now + tonumber(ARGV[11]), ARGV[7])
if ARGV[12] ~= '' then
  local slot = take_slot(KEYS[7], KEYS[8], ARGV[7], tonumber(ARGV[13]), tonumber(ARGV[12]), now)
  return {1, inflight, tostring(level), slot[1]}
end
return {1, inflight, tostring(level), 0}
"""

RELEASE = _REFILL + """
local res = KEYS[1]
redis.call('ZREM', KEYS[2], ARGV[1])
local r = redis.call('HMGET', res, 'cost', 'kv', 'ent', 'pool', 'prio', 'evict', 'cap', 'rate')
if r[1] == false then return 0 end
redis.call('DEL', res)
local cost, kv, ent, pool = tonumber(r[1]), tonumber(r[2]), r[3], r[4]
-- The request's slot of the pool budget, if it held one (`RedisStateStore._slot_keys`).
redis.call('ZREM', pool .. ':slots', ARGV[1])
local used, capacity, rate = tonumber(ARGV[2]), tonumber(r[7]), tonumber(r[8])
local now = now_s()
if used >= 0 and capacity >= 0 and cost > used then
  local level = level_at(ent, capacity, rate, now) + (cost - used)
  if level > capacity then level = capacity end
  redis.call('HSET', ent, 'level', tostring(level), 'ts', tostring(now))
end
if redis.call('HINCRBY', ent, 'inflight', -1) < 0 then redis.call('HSET', ent, 'inflight', 0) end
if tonumber(redis.call('HINCRBYFLOAT', ent, 'kv', -kv)) < 0 then redis.call('HSET', ent, 'kv', 0) end
redis.call('HINCRBY', ent, 'ver', 1)
if used >= 0 then
  redis.call('HINCRBY', ent, 'served_tokens', used)
  redis.call('HINCRBY', ent, 'served_requests', 1)
  redis.call('HINCRBY', ent, 'demand_tokens', used)
end
if redis.call('HINCRBY', pool, 'running', -1) < 0 then redis.call('HSET', pool, 'running', 0) end
if tonumber(redis.call('HINCRBYFLOAT', pool, 'kv', -kv)) < 0 then redis.call('HSET', pool, 'kv', 0) end
redis.call('HINCRBY', pool, 'ver', 1)
redis.call('ZREM', r[5], ARGV[1])
if redis.call('ZREM', r[6], ARGV[1]) == 1 then
  if redis.call('HINCRBY', pool, 'ev_running', -1) < 0 then redis.call('HSET', pool, 'ev_running', 0) end
  if tonumber(redis.call('HINCRBYFLOAT', pool, 'ev_kv', -kv)) < 0 then redis.call('HSET', pool, 'ev_kv', 0) end
end
return 1
"""

RENEW = _REFILL + """
local deadline = now_s() + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', deadline, ARGV[i]) end
return 1
"""

EXPIRED = _REFILL + """
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now_s(), 'LIMIT', 0, 100)
"""


DRAIN = """
local v = redis.call('HMGET', KEYS[1], 'served_tokens', 'served_requests', 'demand_tokens', 'rejected')
redis.call('HDEL', KEYS[1], 'served_tokens', 'served_requests', 'demand_tokens', 'rejected')
return {v[1] or '0', v[2] or '0', v[3] or '0', v[4] or '0'}
"""


def _bucket_args(limits: EntitlementLimits) -> tuple[float, float]:
    capacity = limits.bucket_capacity
    return (-1.0, 0.0) if capacity is None else (capacity, limits.tokens_per_second or 0.0)


def _float(value: Any) -> float:
    return float(value) if value not in (None, b"", "") else 0.0


class RedisStateStore(GatewayStateStore):
    def __init__(self, *, url: str, socket_timeout_s: float = 1.0, client: aioredis.Redis | None = None,
                 prefix: str = PREFIX) -> None:
        self.prefix = prefix
        # Short timeouts: an unreachable store must turn into a fast 503, not a hung request.
        self.redis = client or aioredis.Redis.from_url(
            url, socket_connect_timeout=socket_timeout_s, socket_timeout=socket_timeout_s, decode_responses=True,
            health_check_interval=30,
        )
        self._read = self.redis.register_script(READ)
        self._commit = self.redis.register_script(COMMIT)
        self._release = self.redis.register_script(RELEASE)
        self._drain = self.redis.register_script(DRAIN)
        self._renew = self.redis.register_script(RENEW)
        self._expired = self.redis.register_script(EXPIRED)
        self._slot = self.redis.register_script(SLOT_ACQUIRE)
        # Admissions to one pool from this process go one at a time, so compare-and-set conflicts
        # only come from other processes (a retry storm among our own tasks would be pure waste).
        self._pool_locks: dict[str, asyncio.Lock] = {}

    def _ent_key(self, entitlement: str) -> str:
        return f"{self.prefix}ent:{entitlement}"

    def _pool_keys(self, pool: str) -> tuple[str, str, str]:
        base = f"{self.prefix}pool:{pool}"
        return base, base + ":prio", base + ":evict"

    async def _call(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        try:
            return await script(keys=keys, args=args)
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise StateStoreUnavailable(f"Redis unreachable ({type(exc).__name__})") from exc
        except RedisError as exc:
            raise StateStoreUnavailable(f"Redis error: {exc}") from exc

    async def _snapshot(
        self, limits: EntitlementLimits, pool: PoolInfo, saturation: float
    ) -> tuple[EntitlementUsage, PoolUsage, str, str]:
        pool_key, prio_key, evict_key = self._pool_keys(pool.name)
        reserved = [r for r in pool.reserved]
        keys = [self._ent_key(limits.entitlement_id), pool_key, prio_key, evict_key, *(self._ent_key(r[0]) for r in reserved)]
        raw = await self._call(self._read, keys, list(_bucket_args(limits)))
        in_flight, kv = int(raw[0]), _float(raw[1])
        level = _float(raw[2])
        tokens = math.inf if level < 0 and limits.bucket_capacity is None else level
        usage = EntitlementUsage(in_flight, kv, in_flight, kv, tokens, _float(raw[3]), _float(raw[4]))
        idle_slots, idle_kv = 0, 0.0
        for index, (_name, concurrency, kv_bytes) in enumerate(reserved):
            running, used_kv = int(raw[13 + 2 * index]), _float(raw[14 + 2 * index])
            idle_slots += max(0, concurrency - running)
            idle_kv += max(0.0, kv_bytes - used_kv)
        pool_usage = PoolUsage(
            concurrency_capacity=pool.concurrency_capacity,
            kv_capacity=pool.kv_capacity,
            running=int(raw[6]),
            kv_bytes_running=_float(raw[7]),
            reserved_idle_concurrency=idle_slots,
            reserved_idle_kv=idle_kv,
            saturation=saturation,
            admission_threshold=float(raw[9]) if raw[9] != "" else -math.inf,
            mean_slo_ms=pool.mean_slo_ms,
            lowest_evictable_priority=float(raw[10]) if raw[10] != "" else None,
            evictable_running=int(raw[11]),
            evictable_kv_bytes=_float(raw[12]),
        )
        return usage, pool_usage, raw[5], raw[8]

    async def admit(
        self, *, limits: EntitlementLimits, pool: PoolInfo, request: AdmissionRequest, saturation: float = 0.0,
        slot: SlotRequest | None = None,
    ) -> AdmitResult:
        lock = self._pool_locks.get(pool.name)
        if lock is None:
            lock = self._pool_locks[pool.name] = asyncio.Lock()
        async with lock:
            return await self._admit(limits, pool, request, saturation, slot)

    async def _admit(
        self, limits: EntitlementLimits, pool: PoolInfo, request: AdmissionRequest, saturation: float,
        slot: SlotRequest | None,
    ) -> AdmitResult:
        # The slot of the pool budget is taken in the same script as the reservation when the caller asks
        # (its own queue is empty): the common path then costs no round trip of its own.
        slot_keys = list(self._slot_keys(pool.name))
        slot_args = ["", 0] if slot is None else [max(0, slot.capacity), slot.lease_s]
        pool_key, prio_key, evict_key = self._pool_keys(pool.name)
        capacity, rate = _bucket_args(limits)
        evictable = limits.traits.evictable
        for attempt in range(MAX_ATTEMPTS):
            usage, pool_usage, ent_version, pool_version = await self._snapshot(limits, pool, saturation)
            decision = admit(limits, usage, pool_usage, request)
            if not decision.admitted:
                return AdmitResult(decision, None, rate_view(limits, usage.in_flight, usage.tokens_available))
            result = await self._call(
                self._commit,
                [self._ent_key(limits.entitlement_id), pool_key, prio_key, evict_key,
                 f"{self.prefix}res:{request.request_id}", self._leases, *slot_keys],
                [ent_version, pool_version, decision.token_cost, decision.kv_bytes, decision.priority,
                 "1" if evictable else "0", request.request_id, capacity, rate, RESERVATION_TTL_S, LEASE_S,
                 *slot_args],
            )
            if int(result[0]) == 1:
                reservation = Reservation(
                    request_id=request.request_id, entitlement=limits.entitlement_id, pool=pool.name,
                    token_cost=decision.token_cost, kv_bytes=decision.kv_bytes, priority=decision.priority,
                    max_tokens=decision.max_tokens, input_tokens=request.input_tokens, evictable=evictable,
                )
                level = _float(result[2])
                tokens = math.inf if limits.bucket_capacity is None else level
                return AdmitResult(decision, reservation, rate_view(limits, int(result[1]), tokens),
                                   slot_taken=int(result[3]) == 1)
            # Someone committed in between: back off a little (jittered) and decide again on fresh state.
            await asyncio.sleep(random.uniform(0, 0.0005 * (attempt + 1)))
        contended = AdmissionDecision(False, Reason.POOL_CONTENDED.value, retry_after_s=0.1, check=5)
        return AdmitResult(contended, None, RateView())

    async def release(self, *, reservation: Reservation, prompt_tokens: int, completion_tokens: int) -> bool:
        used = max(0, prompt_tokens) + max(0, completion_tokens)
        # The bucket's capacity and rate were stored with the reservation at commit.
        # The request's slot of the pool budget (if it held one) goes back in the same script.
        return bool(await self._call(self._release, [f"{self.prefix}res:{reservation.request_id}", self._leases],
                                     [reservation.request_id, used]))

    @property
    def _leases(self) -> str:
        return self.prefix + "leases"

    async def leases_renew(self, *, request_ids: list[str]) -> None:
        if request_ids:
            await self._call(self._renew, [self._leases], [LEASE_S, *request_ids])

    async def leases_reap(self) -> int:
        """Release reservations whose lease ran out (their process died); returns how many."""
        reaped = 0
        for request_id in await self._call(self._expired, [self._leases], []):
            # Nothing is known of what they generated (used = -1): the tokens stay charged, nothing is
            # counted as served, the slots and KV bytes come back.
            reaped += int(await self._call(self._release, [f"{self.prefix}res:{request_id}", self._leases],
                                           [request_id, -1]))
        return reaped

    async def record_rejection(self, *, entitlement: str, token_cost: int) -> None:
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hincrby(self._ent_key(entitlement), "rejected", 1)
                pipe.hincrby(self._ent_key(entitlement), "demand_tokens", max(0, token_cost))
                await pipe.execute()
        except (RedisError, OSError) as exc:
            raise StateStoreUnavailable(str(exc)) from exc

    async def entitlement_usage(self, *, limits: EntitlementLimits) -> EntitlementUsage:
        pool = PoolInfo("-", "-", (), 0, 0.0, 0, 1)
        usage, _pool, _e, _p = await self._snapshot(limits, pool, 0.0)
        return usage

    async def pool_running(self, *, pool: str) -> int:
        try:
            value = await self.redis.hget(self._pool_keys(pool)[0], "running")
        except (RedisError, OSError) as exc:
            raise StateStoreUnavailable(str(exc)) from exc
        return int(value or 0)

    async def served_drain(self, *, entitlement: str) -> ServedCounters:
        raw = await self._call(self._drain, [self._ent_key(entitlement)], [])
        return ServedCounters(int(raw[0]), int(raw[1]), int(raw[2]), int(raw[3]))

    async def dynamics_set(self, *, entitlement: str, debt: float, burst: float) -> None:
        try:
            await self.redis.hset(self._ent_key(entitlement), mapping={"debt": repr(debt), "burst": repr(burst)})
        except (RedisError, OSError) as exc:
            raise StateStoreUnavailable(str(exc)) from exc

    async def evict_candidates(self, *, pool: str, below_priority: float, limit: int) -> list[str]:
        try:
            found = await self.redis.zrangebyscore(self._pool_keys(pool)[2], "-inf", f"({below_priority!r}",
                                                   start=0, num=limit)
            return [str(member) for member in found]
        except (RedisError, OSError) as exc:
            raise StateStoreUnavailable(str(exc)) from exc

    async def evictions_publish(self, *, request_ids: list[str]) -> None:
        try:
            for request_id in request_ids:
                await self.redis.publish(self.prefix + "evict", request_id)
        except (RedisError, OSError) as exc:
            raise StateStoreUnavailable(str(exc)) from exc

    async def evictions_listen(self, handler: Callable[[str], None]) -> None:
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.prefix + "evict")
                while True:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is not None and message.get("type") == "message":
                        handler(str(message["data"]))
            except (RedisError, OSError):
                await asyncio.sleep(1.0)  # Redis away: subscribe again when it is back
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    # --- the pool budget shared by every gateway process -----------------------------------------------

    shares_budget = True

    def _slot_keys(self, pool: str) -> tuple[str, str]:
        # RELEASE finds the slots from the reservation's pool key (`_pool_keys`): keep the two in step.
        base = f"{self.prefix}pool:{pool}"
        return base + ":slots", base + ":budget"

    async def slot_acquire(self, *, pool: str, request_id: str, capacity: int, lease_s: float) -> SlotGrant:
        raw = await self._call(self._slot, list(self._slot_keys(pool)), [request_id, lease_s, max(0, capacity)])
        return SlotGrant(int(raw[0]) == 1, int(raw[1]), int(raw[2]))

    async def slot_release(self, *, pool: str, request_id: str) -> None:
        try:
            await self.redis.zrem(self._slot_keys(pool)[0], request_id)
        except (RedisError, OSError) as exc:
            raise StateStoreUnavailable(str(exc)) from exc

    async def slots_renew(self, *, pool: str, request_ids: list[str], lease_s: float) -> None:
        if request_ids:
            await self._call(self._renew, [self._slot_keys(pool)[0]], [lease_s, *request_ids])

    async def pool_budgets_set(self, *, budgets: Mapping[str, int]) -> None:
        if not budgets:
            return
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for pool, budget in budgets.items():
                    pipe.set(self._slot_keys(pool)[1], int(budget))
                await pipe.execute()
        except (RedisError, OSError) as exc:
            raise StateStoreUnavailable(str(exc)) from exc

    async def pool_budget(self, *, pool: str) -> int | None:
        try:
            value = await self.redis.get(self._slot_keys(pool)[1])
        except (RedisError, OSError) as exc:
            raise StateStoreUnavailable(str(exc)) from exc
        return None if value is None else int(value)

    async def close(self) -> None:
        await self.redis.aclose()
