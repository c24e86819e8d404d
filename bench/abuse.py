"""Issue 22's attacks on tenants' privacy and by brute force, against a real `serve`, with the figures printed.

    .venv/bin/python -m bench.abuse [--attempts 300] [--page-attempts 100] [--idle 500] [--lockout-s 20]

1. anonymous `/metrics` (embedded mode, no METRICS_TOKEN; then with one): status, tenant names seen;
2. `--attempts` wrong passwords on `POST /api/v1/auth/token`: how many answered 400 before the lockout, how
   many 429; the right password during the lockout; the right password once it has ended (the site runs with
   LOGIN_LOCKOUT_S=`--lockout-s` so that the run is short; the default is 300 s);
3. `--page-attempts` wrong passwords on the login page: how many "did not match", how many "Too many";
4. `--idle` connections that send nothing: how many are still open after SERVER_HEADER_TIMEOUT_S (10 s).
"""

from __future__ import annotations

import argparse
import socket
import tempfile
import time
from pathlib import Path

import httpx

from apps.simulator.live_site import PreparedSite, manage, prepare_site, serving
from tests.support.manifests import documents, entitlement, tiny_pool

PASSWORD = "olivia-pass-123"
SECRET_NAME = "globex-secret-project"


def _metrics(site: PreparedSite, key: str) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for token in ("", "bench-metrics-token"):
        with serving(site, env={"METRICS_TOKEN": token}) as (url, _proc):
            httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)
            anonymous = httpx.get(url + "/metrics", timeout=10)
            print(f"/metrics, METRICS_TOKEN {'set' if token else 'unset (embedded)'}: anonymous -> "
                  f"{anonymous.status_code}, tenant names in it: {SECRET_NAME in anonymous.text or 'globex' in anonymous.text}")
            if token:
                full = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=10)
                print(f"  with the bearer token -> {full.status_code}, series naming {SECRET_NAME}: "
                      f"{sum(SECRET_NAME in line for line in full.text.splitlines())}")


def _token_attempts(url: str, attempts: int, lockout_s: float) -> None:
    statuses: list[int] = []
    started = time.monotonic()
    with httpx.Client(base_url=url, timeout=10) as client:
        for i in range(attempts):
            statuses.append(client.post("/api/v1/auth/token", json={"username": "olivia",
                                                                   "password": f"wrong-{i}"}).status_code)
        elapsed = time.monotonic() - started
        first_429 = statuses.index(429) if 429 in statuses else None
        right = client.post("/api/v1/auth/token", json={"username": "olivia", "password": PASSWORD})
        print(f"{attempts} wrong passwords on /api/v1/auth/token in {elapsed:.1f} s ({attempts / elapsed:.1f}/s): "
              f"{statuses.count(400)} answered 400, {statuses.count(429)} answered 429 (first 429 at attempt "
              f"{None if first_429 is None else first_429 + 1}); others: "
              f"{sorted(set(statuses) - {400, 429})}")
        print(f"  right password during the lockout -> {right.status_code}, Retry-After "
              f"{right.headers.get('retry-after')}")
        time.sleep(lockout_s + 1)
        after = client.post("/api/v1/auth/token", json={"username": "olivia", "password": PASSWORD})
        print(f"  right password {lockout_s + 1:g} s later (LOGIN_LOCKOUT_S={lockout_s:g}) -> {after.status_code}")


def _page_attempts(url: str, attempts: int) -> None:
    counts = {"did not match": 0, "Too many failed sign-ins": 0, "other": 0}
    with httpx.Client(base_url=url, timeout=10) as client:
        client.get("/accounts/login/")
        csrf = client.cookies["csrftoken"]
        for i in range(attempts):
            page = client.post("/accounts/login/", data={"username": "mark", "password": f"wrong-{i}",
                                                         "csrfmiddlewaretoken": csrf},
                               headers={"Referer": url + "/accounts/login/"})
            found = next((k for k in counts if k in page.text), "other")
            counts[found] += 1
    print(f"{attempts} wrong passwords on the login page: {counts}")


def _idle(url: str, count: int, timeout_s: float) -> None:
    host, port = url.removeprefix("http://").split(":")
    sockets = [socket.create_connection((host, int(port)), timeout=10) for _ in range(count)]
    started = time.monotonic()

    def open_now() -> int:
        still = 0
        for sock in sockets:
            sock.settimeout(0.01)
            try:
                still += sock.recv(1) != b""
            except TimeoutError:
                still += 1
            except ConnectionError:
                pass
        return still

    time.sleep(timeout_s / 2)
    half = open_now()
    time.sleep(max(0.0, timeout_s + 1 - (time.monotonic() - started)))
    print(f"{count} idle connections: {half} open after {timeout_s / 2:g} s, {open_now()} open after "
          f"{time.monotonic() - started:.1f} s (SERVER_HEADER_TIMEOUT_S={timeout_s:g})")
    for sock in sockets:
        sock.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attempts", type=int, default=300)
    parser.add_argument("--page-attempts", type=int, default=100)
    parser.add_argument("--idle", type=int, default=500)
    parser.add_argument("--lockout-s", type=float, default=20.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-abuse-") as tmp:
        manifest = documents(tiny_pool("tiny", "http://127.0.0.1:9"),
                             entitlement(SECRET_NAME, tenant="globex", pool="tiny", service_class="elastic",
                                         concurrency=1))
        site = prepare_site(Path(tmp), tenants=["globex"], manifest=manifest, key_for=[SECRET_NAME],
                            env={"REDIS_URL": "", "GATEWAY_STATE_BACKEND": "memory", "TOKENPOOLS_TICKS": "off",
                                 "LOGIN_LOCKOUT_S": str(args.lockout_s), "DASHBOARD_LOCAL_SAMPLER": "0"})
        manage(site.env, "shell", "-c", "from django.contrib.auth.models import User; "
               f"User.objects.create_user('olivia', password={PASSWORD!r}); "
               f"User.objects.create_user('mark', password={PASSWORD!r})")
        _metrics(site, site.keys[SECRET_NAME])
        with serving(site) as (url, _proc):
            _token_attempts(url, args.attempts, args.lockout_s)
            _page_attempts(url, args.page_attempts)
            _idle(url, args.idle, float(site.env.get("SERVER_HEADER_TIMEOUT_S") or 10))


if __name__ == "__main__":
    main()
