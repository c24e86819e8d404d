"""The route step: choose a replica of the pool (least outstanding requests among the healthy ones) and
send the request there, trying another replica when nothing reached the first one.

Routing policy lives in `apps.gateway.routing` (health, outstanding counts); this module sends. The
transport (`apps.gateway.upstream_http`) is shared by every request: keep-alive connections per backend.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping

import httpx

from apps.gateway.context import RequestContext
from apps.gateway.errors import GatewayError, unavailable, upstream_shed
from apps.gateway.parse import CHAT, ParsedRequest, upstream_body
from apps.gateway.routing import ReplicaSet
from apps.gateway.snapshot import PoolInfo
from apps.gateway.upstream_http import UpstreamTransport

UPSTREAM_HEADERS = {"content-type": "application/json", "accept": "application/json, text/event-stream"}
LLMD = "llm-d"
# What llm-d's flow control keys a request by (the Gateway API Inference Extension's names and llm-d's own).
FAIRNESS_HEADERS = ("x-gateway-inference-fairness-id", "x-llm-d-inference-fairness-id")
OBJECTIVE_HEADERS = ("x-gateway-inference-objective", "x-llm-d-inference-objective")
SLO_TTFT_HEADER = "x-llm-d-slo-ttft-ms"
# The statuses an inference gateway sheds a request with, and the header that may say why.
SHED_STATUSES = frozenset({429, 503})
SHED_REASON_HEADER = "x-llm-d-request-dropped-reason"
# An idle upstream connection is dropped before the backend drops it: vLLM's server closes idle keep-alive
# connections after 5 s, and a request sent on one it is closing fails with a ReadError (a 502 here).
UPSTREAM_KEEPALIVE_S = 4.0


def default_transport() -> UpstreamTransport:
    return UpstreamTransport(keepalive_connections=1000, keepalive_expiry=UPSTREAM_KEEPALIVE_S)


def upstream_headers(pool: PoolInfo, *, tenant: str, service_tier: str, slo_ttft_ms: float) -> Mapping[str, str]:
    """The headers a backend of `pool` gets: the same two for every vLLM-like backend (no copy per request);
    for an llm-d inference gateway, also the tenant (fairness id), the served class's InferenceObjective and
    the entitlement's TTFT target."""
    if pool.backend_kind != LLMD:
        return UPSTREAM_HEADERS
    objective = pool.objective_for(service_tier)
    return {**UPSTREAM_HEADERS, **dict.fromkeys(FAIRNESS_HEADERS, tenant), **dict.fromkeys(OBJECTIVE_HEADERS, objective),
            SLO_TTFT_HEADER: str(round(slo_ttft_ms))}


def shed(pool: PoolInfo, response: httpx.Response) -> GatewayError | None:
    """The inference gateway in front of an llm-d pool shed the request: a 429 for the client, with its reason
    and when to retry (its own Retry-After, else a second)."""
    if pool.backend_kind != LLMD or response.status_code not in SHED_STATUSES:
        return None
    reason = response.headers.get(SHED_REASON_HEADER, "").strip()[:200]
    try:
        retry_after_s = max(1.0, float(response.headers.get("retry-after", "1")))
    except ValueError:
        retry_after_s = 1.0
    return upstream_shed(reason or f"HTTP {response.status_code}", retry_after_s=retry_after_s)


def upstream_path(parsed: ParsedRequest) -> str:
    return "/v1/chat/completions" if parsed.kind == CHAT else "/v1/completions"


async def send_upstream(ctx: RequestContext, transport: UpstreamTransport, timeout: dict[str, float | None],
                        replicas: ReplicaSet, pool: PoolInfo, parsed: ParsedRequest, max_tokens: int,
                        headers: Mapping[str, str] = UPSTREAM_HEADERS) -> tuple[httpx.Response, str]:
    """Send the request to a replica; returns the response (headers read, body not) and the replica's URL,
    which the caller gives back with `close_upstream` once the answer is relayed. An answer that shed the
    request (`shed`) is closed here and raised as its 429."""
    pool_name = pool.name
    body = upstream_body(parsed, model=pool.model_name, max_tokens=max_tokens)
    path = upstream_path(parsed)
    tried: set[str] = set()
    resent = False
    while True:
        candidates = replicas.candidates(tried)
        if not candidates:
            raise unavailable("no_healthy_replica", f"No healthy replica of pool {pool_name!r} can serve.")
        url = candidates[0]
        tried.add(url)
        replicas.acquire(url)
        ctx.upstream_started = time.perf_counter()
        try:
            # Straight to the shared transport: the client's cookie, redirect, auth and hook handling cost
            # ~0.3 ms a request and none of it applies to a backend call.
            response = await transport.post(url, path, body, headers, timeout)
            refusal = shed(pool, response)
            if refusal is not None:
                with contextlib.suppress(httpx.HTTPError):
                    await response.aclose()
                raise refusal  # the replica is given back below
            return response, url
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            # Nothing reached the replica: safe to try another one. Refused: it is down; a timeout only
            # counts (see apps.gateway.routing).
            replicas.release(url)
            if isinstance(exc, httpx.ConnectTimeout):
                replicas.timed_out(url)
                # Silence is not a no (apps.gateway.routing): a replica that still counts as healthy is tried
                # once more when no other is left. A gateway whose own loop stalled past the connect timeout
                # (a burst of a thousand arrivals) saw its only replica "time out" with the connection made.
                if not resent and not replicas.candidates(tried):
                    resent = True
                    tried.discard(url)
            else:
                replicas.mark(url, False)
        except (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError):
            replicas.release(url)
            if resent:
                raise GatewayError(502, "upstream_error", "The backend closed the connection twice.",
                                   error_type="server_error") from None
            # The connection broke before any byte of an answer: most often a pooled keep-alive connection
            # the backend was closing as we sent. Sent once more on a fresh one; had the backend started on
            # it, it saw its client go and aborted it.
            resent = True
            tried.discard(url)
        except httpx.HTTPError as exc:
            replicas.release(url)
            raise GatewayError(502, "upstream_error", f"The backend failed: {type(exc).__name__}.",
                               error_type="server_error") from None
        except BaseException:
            replicas.release(url)
            raise


async def close_upstream(response: httpx.Response, replicas: ReplicaSet, url: str) -> None:
    """Close the backend's response (a stream cut short is aborted: the backend sees its client go) and give
    the replica's outstanding count back."""
    try:
        await response.aclose()
    finally:
        replicas.release(url)
