"""The site's lifespan: the gateway and the in-process ticker start with the server, and at shutdown the
gateway is stopped (its releases and usage flushed) before the ticker."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import tokenpools_site.lifespan as lifespan


def test_the_lifespan_starts_and_stops_the_gateway_and_the_ticker(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []

    class FakeLoops:
        def tick_services(self) -> dict[str, Any]:
            events.append("gateway services")
            return {}

    class FakeGateway:
        loops = FakeLoops()

        async def start(self) -> None:
            events.append("gateway start")

        async def stop(self) -> None:
            events.append("gateway stop")

    gateway = FakeGateway()
    monkeypatch.setattr(lifespan, "gateway_application", lambda: gateway)
    monkeypatch.setattr(lifespan, "start_in_process_ticker", lambda **_: events.append("ticker start"))
    monkeypatch.setattr(lifespan, "stop_in_process_ticker", lambda: events.append("ticker stop"))
    monkeypatch.setattr(lifespan, "favour_the_event_loop", lambda: events.append("switch interval"))
    monkeypatch.setattr(lifespan, "freeze_startup_heap", lambda: events.append("heap frozen"))

    async def inner(scope: dict[str, Any], receive: Any, send: Any) -> None:
        events.append(scope["type"])

    app = lifespan.with_lifespan(inner)
    incoming = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app({"type": "lifespan"}, receive, send))
    asyncio.run(app({"type": "http"}, receive, send))
    assert events == ["gateway services", "ticker start", "gateway start", "switch interval", "heap frozen",
                      "gateway stop", "ticker stop", "http"]
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


def test_a_gateway_that_cannot_start_yet_does_not_stop_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    class Unready:
        class loops:  # noqa: N801 - the gateway's attribute
            @staticmethod
            def tick_services() -> dict[str, Any]:
                return {}

        async def start(self) -> None:
            raise RuntimeError("no such table: pools_tokenpool")

        async def stop(self) -> None:
            pass

    monkeypatch.setattr(lifespan, "gateway_application", Unready)
    monkeypatch.setattr(lifespan, "start_in_process_ticker", lambda **_: None)
    monkeypatch.setattr(lifespan, "stop_in_process_ticker", lambda: None)
    monkeypatch.setattr(lifespan, "favour_the_event_loop", lambda: None)
    monkeypatch.setattr(lifespan, "freeze_startup_heap", lambda: None)
    incoming = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[str] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message["type"])

    async def inner(scope: dict[str, Any], receive: Any, send: Any) -> None:
        return None

    asyncio.run(lifespan.with_lifespan(inner)({"type": "lifespan"}, receive, send))
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
