"""UpstreamTransport, the backend calls' HTTP/1.1 transport, against real sockets: a small asyncio server whose
answers each test scripts (keep-alive, chunked streams, a connection cut mid-answer, garbage, silence)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx
import pytest

from apps.gateway.upstream_http import UpstreamTransport
from tests.support.services import free_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await reader.readexactly(length)


def _transport(**overrides: float) -> UpstreamTransport:
    return UpstreamTransport(keepalive_connections=int(overrides.get("keepalive_connections", 10)),
                             keepalive_expiry=overrides.get("keepalive_expiry", 60.0))


async def _serve(handler: Handler) -> tuple[asyncio.Server, str]:
    port = free_port()
    server = await asyncio.start_server(handler, "127.0.0.1", port)
    return server, f"http://127.0.0.1:{port}"


def _request(url: str, body: bytes = b'{"a": 1}', read_s: float = 5.0) -> httpx.Request:
    return httpx.Request("POST", url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                         extensions={"timeout": {"connect": 5.0, "read": read_s, "write": 5.0, "pool": 5.0}})


def test_keep_alive_reuses_one_connection_and_sends_the_request_whole() -> None:
    seen: list[tuple[bytes, bytes]] = []
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while True:
            try:
                request = await _read_request(reader)
            except asyncio.IncompleteReadError:
                break
            assert request is not None
            seen.append(request)
            answer = b"hello " + request[1]
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(answer), answer))
            await writer.drain()
        writer.close()

    async def run() -> list[bytes]:
        server, url = await _serve(handler)
        transport = _transport()
        bodies = []
        async with server:
            for i in range(3):
                response = await transport.handle_async_request(_request(url, b"n=%d" % i))
                assert response.status_code == 200
                assert response.headers["content-type"] == "text/plain"
                bodies.append(await response.aread())
                await response.aclose()
            assert transport.opened == 1
            await transport.aclose()
        return bodies

    assert asyncio.run(run()) == [b"hello n=0", b"hello n=1", b"hello n=2"]
    assert connections == 1
    head = seen[0][0].split(b"\r\n")
    assert head[0] == b"POST /v1/completions HTTP/1.1"
    assert b"content-length: 3" in [line.lower() for line in head]
    assert any(line.lower().startswith(b"host: 127.0.0.1") for line in head)


def test_a_chunked_stream_arrives_piece_by_piece() -> None:
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await release.wait()  # the client must have the first piece before the second is sent
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async def run() -> list[bytes]:
        server, url = await _serve(handler)
        transport = _transport()
        async with server:
            response = await transport.handle_async_request(_request(url))
            pieces = []
            async for piece in response.aiter_raw():
                pieces.append(piece)
                release.set()
            await response.aclose()
            assert sum(len(idle) for idle in transport.idle.values()) == 1  # finished: kept for the next one
            await transport.aclose()
        return pieces

    assert asyncio.run(run()) == [b"first", b"second"]


def test_an_answer_closed_early_closes_its_connection_and_the_backend_sees_it() -> None:
    saw_eof = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        if await reader.read() == b"":
            saw_eof.set()

    async def run() -> None:
        server, url = await _serve(handler)
        transport = _transport()
        async with server:
            response = await transport.handle_async_request(_request(url))
            async for _ in response.aiter_raw():
                break
            await response.aclose()
            await asyncio.wait_for(saw_eof.wait(), 5)
            assert not transport.idle.get(("http", "127.0.0.1", int(url.rsplit(":", 1)[1])))

    asyncio.run(run())


@pytest.mark.parametrize(("answer", "error"), [
    (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort", httpx.ReadError),  # cut mid-body
    (b"", httpx.ReadError),  # closed before any answer (a keep-alive connection the backend was closing)
    (b"SMTP ready\r\n\r\n", httpx.RemoteProtocolError),
])
def test_broken_answers_raise_what_httpx_raises(answer: bytes, error: type[Exception]) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(answer)
        await writer.drain()
        writer.close()

    async def run() -> None:
        server, url = await _serve(handler)
        transport = _transport()
        async with server:
            with pytest.raises(error):
                response = await transport.handle_async_request(_request(url))
                await response.aread()

    asyncio.run(run())


def test_an_answer_delimited_by_the_connection_end_is_read_whole() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        await writer.drain()
        writer.close()

    async def run() -> bytes:
        server, url = await _serve(handler)
        transport = _transport()
        async with server:
            response = await transport.handle_async_request(_request(url))
            body = await response.aread()
            await response.aclose()
            assert not any(transport.idle.values())  # not kept: the backend closed it
            return body

    assert asyncio.run(run()) == b"all of it"


def test_timeouts_and_refused_connections() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.sleep(5)

    async def run() -> None:
        server, url = await _serve(silent)
        transport = _transport()
        async with server:
            with pytest.raises(httpx.ReadTimeout):
                await transport.handle_async_request(_request(url, read_s=0.2))
        with pytest.raises(httpx.ConnectError):
            await transport.handle_async_request(_request(f"http://127.0.0.1:{free_port()}"))

    asyncio.run(run())


def test_idle_connections_expire_before_the_backend_drops_them() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await _read_request(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
            await writer.drain()

    async def run() -> int:
        server, url = await _serve(handler)
        transport = _transport(keepalive_expiry=0.1)
        async with server:
            for _ in range(2):
                response = await transport.handle_async_request(_request(url))
                assert response.status_code == 204
                await response.aclose()
                await asyncio.sleep(0.2)
            await transport.aclose()
        return transport.opened

    assert asyncio.run(run()) == 2


def test_the_client_uses_it_as_it_used_httpcore() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await _read_request(reader)  # type: ignore[misc]
        assert head.startswith(b"GET /health ")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 12\r\n\r\n{\"ok\": true}")
        await writer.drain()
        await reader.read()

    async def run() -> object:
        server, url = await _serve(handler)
        async with server, httpx.AsyncClient(transport=_transport(), timeout=5) as client:
            return (await client.get(url + "/health")).json()

    assert asyncio.run(run()) == {"ok": True}


def test_the_proxy_post_sends_path_host_and_headers_and_refuses_a_smuggled_line() -> None:
    heads: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head, body = await _read_request(reader)  # type: ignore[misc]
            except asyncio.IncompleteReadError:
                return
            heads.append(head)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

    async def run() -> bytes:
        server, url = await _serve(handler)
        transport = _transport()
        timeout = {"connect": 5.0, "read": 5.0}
        async with server:
            response = await transport.post(url + "/prefix/", "/v1/completions", b"{}",
                                            {"x-llm-d-inference-fairness-id": "acme"}, timeout)
            body = await response.aread()
            await response.aclose()
            with pytest.raises(ValueError, match="line break"):
                await transport.post(url, "/v1/completions", b"{}", {"x-a": "b\r\nx-evil: 1"}, timeout)
            await transport.aclose()
        return body

    assert asyncio.run(run()) == b"{}"
    lines = heads[0].split(b"\r\n")
    assert lines[0] == b"POST /prefix/v1/completions HTTP/1.1"
    assert lines[1].startswith(b"host: 127.0.0.1:")
    assert b"x-llm-d-inference-fairness-id: acme" in lines
    assert len(heads) == 1  # the smuggling one never left
