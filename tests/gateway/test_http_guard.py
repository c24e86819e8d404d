"""A real `serve` process closes idle and slow connections (issue 22: abuse is slowed): connections that send
nothing, that trickle their headers (slowloris) or their body, that stay idle after a response, that never read
a response; headers above the cap are refused. Raw sockets, so nothing in a client library keeps or closes them
for us."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import plotly
import pytest

from apps.gateway.http_guard import MAX_HEADER_BYTES
from apps.simulator.live_site import PreparedSite, manage, serving

pytestmark = pytest.mark.slow

TIMEOUT_S = 1.0
IDLE = 200
REQUEST = b"GET /accounts/login/ HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


@contextlib.contextmanager
def _served(workdir: Path, **timeouts: str) -> Iterator[tuple[str, int]]:
    """A `serve` process of a fresh site with these SERVER_*_TIMEOUT_S settings (the others at their defaults)."""
    env = {name: value for name, value in os.environ.items()
           if not (name.startswith("SERVER_") and name.endswith("_TIMEOUT_S")) and name != "DJANGO_SETTINGS_MODULE"}
    env.update({"DATABASE_URL": f"sqlite:///{workdir / 'site.sqlite3'}", "LOG_LEVEL": "WARNING", "REDIS_URL": "",
                "GATEWAY_STATE_BACKEND": "memory", "DASHBOARD_LOCAL_SAMPLER": "0", "TOKENPOOLS_TICKS": "off",
                **timeouts})
    manage(env, "migrate", "--noinput")
    with serving(PreparedSite(env, {}, workdir)) as (url, _process):
        host, port = url.removeprefix("http://").split(":")
        yield host, int(port)


@pytest.fixture(scope="module")
def address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    with _served(tmp_path_factory.mktemp("http-guard"), SERVER_HEADER_TIMEOUT_S=str(TIMEOUT_S),
                 SERVER_BODY_TIMEOUT_S=str(TIMEOUT_S), SERVER_WRITE_TIMEOUT_S=str(TIMEOUT_S),
                 SERVER_KEEPALIVE_TIMEOUT_S="1") as served:
        yield served


def _connect(address: tuple[str, int]) -> socket.socket:
    sock = socket.create_connection(address, timeout=10)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # no TIME_WAIT
    return sock


def _closed(sock: socket.socket) -> bool:
    """Whether the server has closed it: reads until the end (a response first, perhaps)."""
    sock.settimeout(0.05)
    try:
        while chunk := sock.recv(65536):
            del chunk
        return True
    except TimeoutError:
        return False
    except ConnectionError:
        return True


def _response(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return head


def test_idle_trickling_and_kept_alive_connections_are_closed_after_the_timeout(address: tuple[str, int]) -> None:
    idle = [_connect(address) for _ in range(IDLE)]
    trickling = _connect(address)
    kept_alive = _connect(address)
    kept_alive.sendall(REQUEST)
    assert _response(kept_alive).startswith(b"HTTP/1.1 200")
    started = time.monotonic()
    # Slowloris: one header line at a time, never the blank line that ends them.
    trickling.sendall(b"GET /accounts/login/ HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    trickled_closed = None
    while time.monotonic() - started < 10 * TIMEOUT_S and trickled_closed is None:
        try:
            trickling.sendall(b"X-a: b\r\n")
        except ConnectionError:
            trickled_closed = time.monotonic() - started
        else:
            if _closed(trickling):
                trickled_closed = time.monotonic() - started
        time.sleep(0.2)
    assert trickled_closed is not None and trickled_closed < 5 * TIMEOUT_S, trickled_closed
    # A fresh client is still served meanwhile.
    fresh = _connect(address)
    fresh.sendall(REQUEST)
    assert _response(fresh).startswith(b"HTTP/1.1 200")
    deadline = started + 10 * TIMEOUT_S
    while (still_open := sum(not _closed(s) for s in idle)) and time.monotonic() < deadline:
        time.sleep(0.2)
    print(f"{IDLE} idle connections: {still_open} open {time.monotonic() - started:.1f} s later "
          f"(header timeout {TIMEOUT_S} s); slowloris closed after {trickled_closed:.1f} s")
    assert still_open == 0
    assert _closed(kept_alive)
    for sock in (*idle, trickling, kept_alive, fresh):
        sock.close()


def test_requests_within_the_timeout_keep_their_connection_and_oversized_headers_are_refused(
        address: tuple[str, int]) -> None:
    sock = _connect(address)
    for _ in range(3):
        sock.sendall(REQUEST)
        assert _response(sock).startswith(b"HTTP/1.1 200")
        time.sleep(TIMEOUT_S / 2)
    sock.close()
    big = _connect(address)
    big.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES + 1) + b"\r\n\r\n")
    assert _response(big).startswith(b"HTTP/1.1 400")
    assert _closed(big)
    big.close()


def _closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed `sock` (reading whatever it sent meanwhile), or None."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        if _closed(sock):
            return time.monotonic() - started
        time.sleep(0.1)
    return None


def test_a_trickled_body_is_cut_off_after_the_timeout(address: tuple[str, int]) -> None:
    sock = _connect(address)
    sock.sendall(b"POST /api/v1/auth/token HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"username\"")
    closed_after = _closed_within(sock, 10 * TIMEOUT_S)
    print(f"a body stopped after 11 of 100 bytes: closed after {closed_after} s (body timeout {TIMEOUT_S} s)")
    assert closed_after is not None and closed_after < 5 * TIMEOUT_S
    sock.close()


def test_a_client_that_never_reads_its_response_is_cut_off(address: tuple[str, int]) -> None:
    """4.6 MB of Plotly's script to a client with a tiny receive window that reads nothing: the kernel's buffers
    fill, uvicorn's writer pauses, and the connection is closed after the write timeout, long before the
    response could have been delivered."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: the window it advertises
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.settimeout(10)
    sock.connect(address)
    sock.sendall(b"GET /vendor/plotly.min.js HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    time.sleep(4 * TIMEOUT_S)  # reads nothing meanwhile
    received, ended = 0, False
    sock.settimeout(5)
    try:
        while chunk := sock.recv(65536):
            received += len(chunk)
        ended = True
    except ConnectionError:
        ended = True
    except TimeoutError:
        pass
    sock.close()
    print(f"a client that read nothing for {4 * TIMEOUT_S:.0f} s: {received:,} bytes were buffered for it, then "
          f"the connection {'ended' if ended else 'stayed open'}")
    assert ended
    whole = (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").stat().st_size
    assert received < whole  # the response was cut short (the client got what the buffers held)


def test_by_default_a_connection_idle_longer_than_a_clients_own_expiry_stays_open(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Without SERVER_KEEPALIVE_TIMEOUT_S, a kept-alive connection outlives httpx's and the OpenAI SDK's 5 s idle
    expiry (and a load balancer's 60 s): the client closes idle connections, so none is closed by the server under
    a request the client is sending on it."""
    with _served(tmp_path_factory.mktemp("keep-alive")) as address:
        sock = _connect(address)
        sock.sendall(REQUEST)
        assert _response(sock).startswith(b"HTTP/1.1 200")
        time.sleep(6.0)  # past the 5 s a client library keeps an idle connection for
        assert not _closed(sock)
        sock.sendall(REQUEST)  # the same connection serves the next request
        assert _response(sock).startswith(b"HTTP/1.1 200")
        sock.close()
