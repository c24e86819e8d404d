"""The control loops' state in Redis, shared by the Celery worker and every gateway process
(`apps.gateway.control.ControlState`'s shared implementation)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from apps.gateway.control import AimdRecord, ControlState, _le
from apps.policy import InstanceSnapshot, rebucket

# Take the current slice and delete it in one step, so no observation falls between read and reset.
_TAKE_SLICE = """
local values = redis.call('HGETALL', KEYS[1])
redis.call('DEL', KEYS[1])
return values
"""


class RedisControlState(ControlState):
    """The control state in Redis, shared by the Celery worker and every gateway process.

    Keys (prefix `tokenpools:ctl:`): `ttft:{pool}:current` (hash: a bucket's upper bound, Prometheus'
    `le` ("2.4", "+Inf"), -> count, HINCRBY by the gateways), `ttft:{pool}:window` (list of JSON slices
    {le: count}, newest first). Buckets are named by their bound, not their position, so a writer and a
    reader configured with different targets still add up (`apps.policy.rebucket`); `aimd:{pool}` (hash: the
    AimdRecord; `cap` is the pool budget gateways read), `last:{tick}`, `demand_tps` (hash pool -> tokens/s), `desired_replicas` (hash pool -> replicas),
    `instances:{pool}` (JSON list of the scrape's InstanceSnapshots).
    """

    PREFIX = "tokenpools:ctl:"

    def __init__(self, *, url: str | None = None, client: Any = None, bounds: Sequence[float] | None = None) -> None:
        import redis

        if bounds is not None:
            self.bounds = tuple(float(b) for b in bounds)
        if client is None and not url:
            raise ValueError("RedisControlState needs a Redis URL or client")
        # Any: redis-py's stubs type replies as bytes | str; with decode_responses they are str.
        self.redis: Any = client or redis.Redis.from_url(str(url), decode_responses=True)
        self._take = self.redis.register_script(_TAKE_SLICE)

    def _key(self, *parts: str) -> str:
        return self.PREFIX + ":".join(parts)

    def ttft_observe(self, pool: str, seconds: float) -> None:
        index = self.bucket(seconds)
        le = _le(self.bounds[index] if index < len(self.bounds) else math.inf)
        self.redis.hincrby(self._key("ttft", pool, "current"), le, 1)

    def ttft_add(self, pool: str, counts: Sequence[int], bounds: Sequence[float] | None = None) -> None:
        edges = (*(self.bounds if bounds is None else bounds), math.inf)
        key = self._key("ttft", pool, "current")
        pipe = self.redis.pipeline(transaction=False)
        for le, count in zip(edges, counts, strict=False):
            if count:
                pipe.hincrby(key, _le(le), int(count))
        pipe.execute()

    def _counts(self, by_le: Mapping[str, Any]) -> list[int]:
        return rebucket(((float(le), int(count)) for le, count in by_le.items()), self.bounds)

    def ttft_rotate(self, pool: str, window_ticks: int) -> list[int]:
        flat = self._take(keys=[self._key("ttft", pool, "current")])
        current = self._counts(dict(zip(flat[::2], flat[1::2], strict=True)))
        edges = (*self.bounds, math.inf)
        window_key = self._key("ttft", pool, "window")
        pipe = self.redis.pipeline()
        pipe.lpush(window_key, json.dumps({_le(le): count for le, count in zip(edges, current, strict=True) if count}))
        pipe.ltrim(window_key, 0, window_ticks - 1)
        pipe.lrange(window_key, 0, window_ticks - 1)
        slices = pipe.execute()[-1]
        totals = [0] * len(current)
        for raw in slices:
            piece = json.loads(raw)
            if isinstance(piece, dict):  # a list is a slice of the old positional format: dropped
                for position, count in enumerate(self._counts(piece)):
                    totals[position] += count
        return totals

    def aimd_load(self, pool: str) -> AimdRecord | None:
        raw = self.redis.hgetall(self._key("aimd", pool))
        if not raw or "cap" not in raw:
            return None
        p99 = raw.get("p99_s", "")
        return AimdRecord(
            cap=int(raw["cap"]),
            cooldown_left=int(raw.get("cooldown_left", 0)),
            last_action=raw.get("last_action", ""),
            p99_s=float(p99) if p99 not in ("", "None") else None,
            samples=int(raw.get("samples", 0)),
            min_cap=int(raw.get("min_cap", 1)),
            max_cap=int(raw.get("max_cap", raw["cap"])),
            ticks=int(raw.get("ticks", 0)),
        )

    def aimd_save(self, pool: str, record: AimdRecord) -> None:
        mapping = {k: ("" if v is None else str(v)) for k, v in asdict(record).items()}
        self.redis.hset(self._key("aimd", pool), mapping=mapping)

    def claim(self, name: str, ttl_s: float) -> bool:
        return bool(self.redis.set(self._key("claim", name), "1", nx=True, px=max(1, int(ttl_s * 1000))))

    def swap_last_run(self, tick: str, now: float) -> float | None:
        previous = self.redis.getset(self._key("last", tick), repr(now))
        return None if previous is None else float(previous)

    def pool_demand_set(self, demand_tps: Mapping[str, float]) -> None:
        key = self._key("demand_tps")
        pipe = self.redis.pipeline()
        pipe.delete(key)
        if demand_tps:
            pipe.hset(key, mapping={pool: repr(float(v)) for pool, v in demand_tps.items()})
        pipe.execute()

    def pool_demand(self) -> dict[str, float]:
        return {pool: float(v) for pool, v in self.redis.hgetall(self._key("demand_tps")).items()}

    def desired_replicas_set(self, desired: Mapping[str, int]) -> None:
        key = self._key("desired_replicas")
        pipe = self.redis.pipeline()
        pipe.delete(key)
        if desired:
            pipe.hset(key, mapping={pool: str(int(v)) for pool, v in desired.items()})
        pipe.execute()

    def desired_replicas(self) -> dict[str, int]:
        return {pool: int(v) for pool, v in self.redis.hgetall(self._key("desired_replicas")).items()}

    def instances_set(self, pool: str, snapshots: Sequence[InstanceSnapshot]) -> None:
        self.redis.set(self._key("instances", pool), json.dumps([asdict(s) for s in snapshots]))

    def instances(self, pool: str) -> list[InstanceSnapshot]:
        raw = self.redis.get(self._key("instances", pool))
        return [InstanceSnapshot(**item) for item in json.loads(raw)] if raw else []

    def close(self) -> None:
        self.redis.close()
