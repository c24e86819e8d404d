"""The attacks of issue 22, run as an outside attacker would against `serve --workers 2` on a real Redis, with
tenants, keys, users and quotas (`make bench-security`). Every figure in the table is what this run saw.

    python -m bench.security [--write-results]

The site runs with short timeouts so that the run ends in about a minute and a half: a 3 s lease, a 5 s lockout
after 10 failed logins, a 5 s idle-connection timeout. Each row says what was sent, what came back, and whether
that is what issue 22 requires.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.results import machine_description, write_section
from tests.support.crash import upstream, wait_for_workers, worker_pids
from tests.support.manifests import documents, entitlement, tiny_pool
from tests.support.services import PrivateRedis
from tests.support.site import PreparedSite, manage, prepare_site, serving

LEASE_S = 3.0
LOCKOUT_S = 5.0
IDLE_S = 5.0
METRICS_TOKEN = "bench-metrics-token"
PASSWORD = "correct horse battery staple"
SITE_ENV = {
    "TOKENPOOLS_TICKS": "off", "GATEWAY_LEASE_S": str(LEASE_S), "GATEWAY_LEASE_RENEW_S": "1",
    "GATEWAY_ACQUIRE_TIMEOUT_S": "2", "GATEWAY_USAGE_FLUSH_S": "1", "METRICS_TOKEN": METRICS_TOKEN,
    "LOGIN_FAILURE_LIMIT": "10", "LOGIN_LOCKOUT_S": str(LOCKOUT_S), "SERVER_HEADER_TIMEOUT_S": str(IDLE_S),
    "SERVER_KEEPALIVE_TIMEOUT_S": str(int(IDLE_S)),
}
USERS = """
from django.contrib.auth import get_user_model
from apps.tenancy.models import Membership, Tenant
User = get_user_model()
for name, slug, role in (("mallory", "acme", "member"), ("olivia", "acme", "owner"), ("eve", "globex", "owner")):
    user = User.objects.create_user(name, f"{name}@example.com", PASSWORD)
    Membership.objects.create(user=user, tenant=Tenant.objects.get(slug=slug), role=role)
User.objects.create_superuser("root", "root@ops.example.com", PASSWORD)
"""
ATTACKS = ("hints", "disconnects", "bursts", "input", "leaks", "brute-force", "idle", "fail-open")
ENTITLEMENT = {"tenant": "globex", "pool": "open", "service_class": "spot", "slo_target_ms": 2000,
               "tokens_per_second": 1000, "kv_cache_gib": 0.01, "concurrency": 1}


@dataclass
class Row:
    attack: str
    result: str
    required: str
    met: bool


def _chat(model: str, max_tokens: int = 4) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": max_tokens}


def manifest(backend_url: str) -> str:
    return documents(
        tiny_pool("narrow", backend_url, slots=2),
        tiny_pool("open", backend_url, slots=256),
        entitlement("filler", tenant="globex", pool="narrow", service_class="spot", concurrency=4),
        entitlement("spotty", tenant="acme", pool="narrow", service_class="spot", concurrency=4),
        entitlement("daily", tenant="acme", pool="open", service_class="elastic", concurrency=128)
        + "  quota: {tokens: 100000, window: day}\n",
        # Guaranteed: its concurrency is a hard limit (an elastic one may borrow the pool's idle slots).
        entitlement("tight", tenant="acme", pool="open", service_class="guaranteed", concurrency=8)
        + "  quota: {tokens: 250, window: day}\n",
        entitlement("tight-open", tenant="acme", pool="open", service_class="guaranteed", concurrency=8)
        + "  quota: {tokens: 250, window: day}\n",
    )


class Attacker:
    def __init__(self, url: str, site: PreparedSite, backend: object, redis: PrivateRedis | None = None,
                 process_pid: int = 0) -> None:
        self.url, self.site, self.backend, self.redis = url, site, backend, redis
        # The `serve` process whose workers' memory the YAML bomb row reports.
        self.process_pid = process_pid
        self.rows: list[Row] = []

    def row(self, attack: str, result: str, required: str, met: bool) -> None:
        self.rows.append(Row(attack, result, required, met))
        print(f"[{'met' if met else 'NOT met'}] {attack}: {result}", file=sys.stderr)

    async def post(self, key: str, body: bytes | dict, *, path: str = "/v1/chat/completions",
                   headers: dict[str, str] | None = None) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with httpx.AsyncClient(timeout=60) as client:
            return await client.post(self.url + path, content=content, headers={
                "Authorization": f"Bearer {key}", "content-type": "application/json", **(headers or {})})

    async def reserved_quota_tokens(self, entitlement: str) -> float:
        async with httpx.AsyncClient(timeout=10) as client:
            text = (await client.get(self.url + "/metrics",
                                     headers={"Authorization": f"Bearer {METRICS_TOKEN}"})).text
        # The entitlement's own quota, and its tenant's shared one (exported once, under the tenant).
        own = rf'tokenpools_entitlement_quota_reserved_tokens{{[^}}]*entitlement="{re.escape(entitlement)}"[^}}]*}} (\S+)'
        tenants = set(re.findall(rf'tokenpools_entitlement_info{{[^}}]*tenant="([^"]*)"[^}}]*entitlement='
                                 rf'"{re.escape(entitlement)}"', text))
        shared = [rf'tokenpools_tenant_quota_reserved_tokens{{tenant="{re.escape(t)}"}} (\S+)' for t in tenants]
        return sum(float(v) for pattern in (own, *shared) for v in re.findall(pattern, text))

    # --- item 1 ---------------------------------------------------------------------------------------

    async def hints(self) -> None:
        """Another tenant's two spot requests of 0.8 s fill the narrow pool; a spot key then asks three times
        without the header and three times with it (a request of higher priority than the running ones waits)."""
        spot, filler = self.site.keys["spotty"], self.site.keys["filler"]

        async def attempt(headers: dict[str, str] | None) -> str:
            fillers = [asyncio.create_task(self.post(filler, _chat("narrow", 80))) for _ in range(2)]
            await asyncio.sleep(0.3)
            response = await self.post(spot, _chat("narrow", 1), headers=headers)
            await asyncio.gather(*fillers)
            return f"{response.status_code} {response.headers.get('x-tokenpools-reject-reason', '')}".strip()

        plain = [await attempt(None) for _ in range(3)]
        hinted = [await attempt({"x-llm-d-slo-ttft-ms": "1"}) for _ in range(3)]
        unknown = (await self.post(spot, _chat("narrow", 1),
                                   headers={"x-llm-d-inference-objective": "platinum"})).status_code
        self.row("spot key into a pool full of another tenant's spot work, without / with "
                 "`x-llm-d-slo-ttft-ms: 1` (3 each)",
                 f"{plain} / {hinted}", "the header changes nothing", plain == hinted)
        self.row("unknown `x-llm-d-inference-objective: platinum`", f"{unknown}", "400", unknown == 400)

    # --- item 2 ---------------------------------------------------------------------------------------

    async def _leave_after(self, key: str, delay_s: float) -> None:
        host, port = self.url.removeprefix("http://").split(":")
        body = json.dumps(_chat("open", 400)).encode()
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()
        await asyncio.sleep(delay_s)
        writer.close()

    async def disconnects(self) -> None:
        key = self.site.keys["daily"]
        delays = (0.0, 0.001, 0.005, 0.010, 0.050)
        await asyncio.gather(*(self._leave_after(key, d) for d in delays for _ in range(12)))
        await asyncio.sleep(LEASE_S * 2 + 1)
        left = await self.reserved_quota_tokens("daily")
        self.row(f"60 requests (max_tokens 400) whose clients close 0, 1, 5, 10, 50 ms after sending; quota "
                 f"tokens still reserved {LEASE_S * 2 + 1:.0f} s later", f"{left:.0f}", "0", left == 0)
        # Redis 7 refuses DEBUG SLEEP unless started to allow it: SIGSTOP freezes it the same way (connections
        # open, nothing answers), for 5 s.
        assert self.redis is not None
        self.redis.pause()
        offered = asyncio.gather(*(self.post(key, _chat("open", 4)) for _ in range(10)), return_exceptions=True)
        await asyncio.sleep(5)
        self.redis.resume()
        statuses = await offered
        await asyncio.sleep(LEASE_S * 2 + 1)
        left = await self.reserved_quota_tokens("daily")
        codes = Counter(getattr(s, "status_code", type(s).__name__) for s in statuses)
        self.row("10 requests offered during a 5 s Redis stall (SIGSTOP); quota tokens reserved after",
                 f"{left:.0f} (answers: {dict(codes)})", "0", left == 0)

    # --- item 3 ---------------------------------------------------------------------------------------

    async def burst(self, entitlement: str, count: int) -> tuple[Counter, int]:
        key = self.site.keys[entitlement]
        responses = await asyncio.gather(*(self.post(key, _chat("open", 4)) for _ in range(count)),
                                         return_exceptions=True)
        served = sum(r.json()["usage"]["total_tokens"] for r in responses
                     if isinstance(r, httpx.Response) and r.status_code == 200)
        return Counter(getattr(r, "status_code", type(r).__name__) for r in responses), served

    async def bursts(self) -> None:
        self.backend.peak = 0  # type: ignore[attr-defined]
        codes, served = await self.burst("tight", 200)
        peak = self.backend.peak  # type: ignore[attr-defined]
        self.row("200 concurrent requests on a guaranteed entitlement (concurrency 8) with a 250-token quota, Redis up",
                 f"{dict(codes)}, {served} tokens served, peak {peak} in flight at the backend",
                 "no 503; at most 250 tokens, at most 8 at once", codes.get(503, 0) == 0 and served <= 250 and peak <= 8)

    # --- items 4 and 5 --------------------------------------------------------------------------------

    async def bad_input(self, token: str) -> None:
        key = self.site.keys["daily"]
        deep = b'{"model": "open", "messages": [{"role": "user", "content": "x"}], "x": ' + b"[" * 970 + b"]" * 970 + b"}"
        status = (await self.post(key, deep)).status_code
        self.row("`/v1/chat/completions` body nested 970 levels deep", f"{status}", "400", status == 400)
        nan = b'{"model": "open", "messages": [{"role": "user", "content": "x"}], "temperature": NaN, "max_tokens": 2}'
        status = (await self.post(key, nan)).status_code
        self.row("`temperature: NaN`", f"{status}", "400, nothing forwarded", status == 400)
        batch = {"model": "open", "prompt": ["a"] * 50, "max_tokens": 2}
        response = await self.post(key, batch, path="/v1/completions")
        charged = response.json().get("usage", {}).get("prompt_tokens") if response.status_code == 200 else None
        self.row('`"prompt": ["a"] * 50` on /v1/completions', f"{response.status_code}"
                 + (f", {charged} prompt tokens charged" if charged is not None else ""),
                 "charged per prompt or refused (400)", response.status_code == 400 or (charged or 0) >= 50)
        # The classic "billion laughs", its last alias where a value is checked (and quoted in the error).
        bomb = ("apiVersion: tokenpools.io/v1alpha1\nkind: TokenEntitlement\nmetadata: {name: bomb}\nx-anchors:\n"
                '  a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
                + "".join(f"  {chr(98 + i)}: &{chr(98 + i)} [" + ",".join([f"*{chr(97 + i)}"] * 9) + "]\n"
                          for i in range(8))
                + "spec: {tenantId: acme, poolRef: {name: open}, qos: {serviceClass: *i}}\n")
        rss = self.worker_rss_mb()
        started = time.monotonic()
        try:
            async with httpx.AsyncClient(timeout=120) as client:
                response = await client.post(self.url + "/api/v1/apply", content=bomb.encode(), headers={
                    "Authorization": f"Token {token}", "content-type": "application/yaml"})
            answer, ok = f"{response.status_code}, {len(response.content):,} bytes", (
                response.status_code == 400 and len(response.content) < 10_000)
        except httpx.HTTPError as error:
            answer, ok = f"no answer ({type(error).__name__}: {error})", False
        took = time.monotonic() - started
        grown = self.worker_rss_mb() - rss
        self.row(f"{len(bomb)}-byte YAML alias bomb to `POST /api/v1/apply` by a member",
                 f"{answer} in {took:.2f} s, workers grew {grown:.0f} MB", "a short 400", ok)
        async with httpx.AsyncClient(timeout=30) as client:
            for who, headers in (("anonymous", {}), ("a member", {"Authorization": f"Token {token}"})):
                codes = [(await client.request(method, self.url + "/api/v1/entitlements/daily", json={},
                                               headers=headers)) for method in ("PATCH", "PUT", "DELETE")]
                leaked = any("DATABASES" in r.text or "Traceback" in r.text for r in codes)
                statuses = [r.status_code for r in codes]
                self.row(f"PATCH, PUT, DELETE `/api/v1/entitlements/daily` without the slash, {who}",
                         f"{statuses}{', debug page' if leaked else ''}", "no 500, no debug page",
                         not leaked and 500 not in statuses)

    def worker_rss_mb(self) -> float:
        total = 0.0
        for pid in worker_pids(self.process_pid):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        return total

    # --- item 6 ---------------------------------------------------------------------------------------

    async def leaks(self, tokens: dict[str, str]) -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            anonymous = await client.get(self.url + "/metrics")
            named = [n for n in ("daily", "spotty", "acme") if n in anonymous.text]
            self.row("anonymous `GET /metrics`", f"{anonymous.status_code}, tenant names shown: {named or 'none'}",
                     "no tenant named", not named)
            eve = {"Authorization": f"Token {tokens['eve']}"}
            taken = await client.post(self.url + "/api/v1/entitlements/", headers=eve, json={
                **ENTITLEMENT, "name": "daily"})
            free = await client.post(self.url + "/api/v1/entitlements/", headers=eve, json={
                **ENTITLEMENT, "name": "globex-own"})
            probe = "already exists" in taken.text
            self.row("another tenant's owner creates an entitlement named `daily` (acme's)",
                     f"{taken.status_code} {taken.text[:120]}", "nothing says the name is another tenant's",
                     not probe and free.status_code == 201)
            olivia = {"Authorization": f"Token {tokens['olivia']}"}
            await client.post(self.url + "/api/v1/memberships/", headers=olivia,
                              json={"tenant": "acme", "user": "root", "role": "member"})
            users = (await client.get(self.url + "/api/v1/users/", headers=olivia)).json()
            rows = users.get("results", users) if isinstance(users, dict) else users
            root: dict = next((u for u in rows if u.get("username") == "root"), {})
            shown = [f for f in ("email", "is_superuser") if f in root]
            self.row("an owner adds the superuser `root` to its tenant, then lists users",
                     f"root's fields shown: {sorted(root)}", "no email, no is_superuser", not shown)

    # --- item 7 ---------------------------------------------------------------------------------------

    async def brute_force(self) -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            async def attempt(password: str) -> int:
                response = await client.post(self.url + "/api/v1/auth/token",
                                             data={"username": "mallory", "password": password})
                return response.status_code
            started = time.monotonic()
            codes = Counter([await attempt(f"guess-{i}") for i in range(300)])
            rate = 300 / (time.monotonic() - started)
            locked = await attempt(PASSWORD)
            await asyncio.sleep(LOCKOUT_S + 1)
            after = await attempt(PASSWORD)
        self.row(f"300 wrong passwords on `/api/v1/auth/token` ({rate:.0f}/s), then the right one, then the right "
                 f"one after {LOCKOUT_S + 1:.0f} s", f"{dict(codes)}; right password at once: {locked}; after: {after}",
                 "locked out (429), the lockout ends by itself",
                 codes.get(429, 0) >= 280 and locked == 429 and after == 200)

    async def idle_connections(self, count: int = 500) -> None:
        host, port = self.url.removeprefix("http://").split(":")
        pairs = [await asyncio.open_connection(host, int(port)) for _ in range(count)]
        await asyncio.sleep(IDLE_S + 3)
        still_open = 0
        for reader, writer in pairs:
            try:
                data = await asyncio.wait_for(reader.read(1), timeout=0.01)
                still_open += 0 if data == b"" else 1
            except TimeoutError:
                still_open += 1
            writer.close()
        self.row(f"{count} idle connections, {IDLE_S + 3:.0f} s later", f"{still_open} still open",
                 "all closed", still_open == 0)


def api_token(url: str, username: str) -> str:
    response = httpx.post(url + "/api/v1/auth/token", data={"username": username, "password": PASSWORD}, timeout=30)
    response.raise_for_status()
    return response.json()["token"]


async def fail_open_burst(site: PreparedSite, backend: object) -> Row:
    with serving(site, workers=1, env={**SITE_ENV, "GATEWAY_FAIL_OPEN": "1"}, log_name="fail-open.log") as (url, _):
        backend.peak = 0  # type: ignore[attr-defined]
        attacker = Attacker(url, site, backend)
        codes, served = await attacker.burst("tight-open", 200)
        peak = backend.peak  # type: ignore[attr-defined]
    return Row("the same burst with `GATEWAY_FAIL_OPEN=1`, Redis up (quota 250 tokens, concurrency 8)",
               f"{dict(codes)}, {served} tokens served, peak {peak} in flight at the backend",
               "at most 250 tokens, at most 8 at once", served <= 250 and peak <= 8)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write-results", action="store_true", help="rewrite the section in bench/RESULTS.md")
    parser.add_argument("--only", nargs="*", default=[], metavar="ATTACK", choices=ATTACKS,
                        help=f"run only these ({', '.join(ATTACKS)})")
    args = parser.parse_args(argv)
    redis = PrivateRedis()
    redis.start()
    with tempfile.TemporaryDirectory(prefix="tokenpools-attack-") as tmp, upstream(token_delay_s=0.01) as backend:
        env = {**SITE_ENV, "REDIS_URL": redis.url, "GATEWAY_STATE_BACKEND": "redis"}
        site = prepare_site(Path(tmp), tenants=["acme", "globex"], manifest=manifest(backend.url),
                            key_for=["filler", "spotty", "daily", "tight", "tight-open"], env=env)
        manage(site.env, "shell", "-c", f"PASSWORD = {PASSWORD!r}\n" + USERS)
        with serving(site, workers=2, log_name="attack-serve.log") as (url, process):
            wait_for_workers(process.pid, 2)
            attacker = Attacker(url, site, backend, redis, process.pid)
            tokens = {name: api_token(url, name) for name in ("mallory", "olivia", "eve")}

            attacks = {"hints": attacker.hints, "disconnects": attacker.disconnects, "bursts": attacker.bursts,
                       "input": lambda: attacker.bad_input(tokens["mallory"]), "leaks": lambda: attacker.leaks(tokens),
                       "brute-force": attacker.brute_force, "idle": attacker.idle_connections}

            async def everything() -> None:
                for name, attack in attacks.items():
                    if not args.only or name in args.only:
                        await attack()

            asyncio.run(everything())
        if not args.only or "fail-open" in args.only:
            attacker.rows.append(asyncio.run(fail_open_burst(site, backend)))
    redis.remove()
    rows = attacker.rows
    text = "\n".join([
        "Command: `python -m bench.security` (`make bench-security`)  ",
        f"Machine: {machine_description()}  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        f"`serve --workers 2` on a real Redis, tenants acme and globex, a member, two owners and a superuser; "
        f"settings of the run: lease {LEASE_S:.0f} s, lockout {LOCKOUT_S:.0f} s after 10 failures, idle timeout "
        f"{IDLE_S:.0f} s. {sum(r.met for r in rows)} of {len(rows)} rows as required.",
        "",
        "| attack | what came back | required | |",
        "|---|---|---|---|",
        *(f"| {r.attack} | {r.result} | {r.required} | {'met' if r.met else 'NOT met'} |" for r in rows),
    ])
    print(text)
    if args.write_results and not args.only:
        write_section("Security and abuse (`make bench-security`)", text)
    return 0 if all(r.met for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
