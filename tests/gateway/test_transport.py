"""ShardedTransport: the proxy's round robin over independent keep-alive pools."""

from __future__ import annotations

import asyncio

import httpx

from apps.gateway.upstream import ShardedTransport


class _Recorder(httpx.AsyncBaseTransport):
    def __init__(self, name: str, seen: list[str]) -> None:
        self.name, self.seen, self.closed = name, seen, False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(self.name)
        return httpx.Response(200, content=self.name.encode())

    async def aclose(self) -> None:
        self.closed = True


def test_round_robin_and_close() -> None:
    transport = ShardedTransport(3, keepalive_connections=1000, keepalive_expiry=60)
    assert len(transport.shards) == 3
    seen: list[str] = []
    recorders = [_Recorder(str(i), seen) for i in range(3)]
    transport.shards = recorders  # type: ignore[assignment]

    async def run() -> list[bytes]:
        bodies = []
        for _ in range(7):
            response = await transport.handle_async_request(httpx.Request("POST", "http://upstream/v1/completions"))
            bodies.append(await response.aread())
        await transport.aclose()
        return bodies

    bodies = asyncio.run(run())
    assert seen == ["0", "1", "2", "0", "1", "2", "0"]
    assert bodies == [name.encode() for name in seen]
    assert all(recorder.closed for recorder in recorders)


def test_keepalive_split_over_shards() -> None:
    transport = ShardedTransport(64, keepalive_connections=1000, keepalive_expiry=60)
    assert len(transport.shards) == 64
    assert len({id(shard) for shard in transport.shards}) == 64
    assert ShardedTransport(0, keepalive_connections=1, keepalive_expiry=1).shards  # at least one pool
    asyncio.run(transport.aclose())
