"""The request path as a newcomer follows it: which project files one streamed `/v1/chat/completions` request
runs through from the gateway's entry until the request leaves for the backend, and on to the end of its
stream, the release of its hold and its accounting included (traced, not listed by hand).

Two figures, to the backend and to the end: the files the pipeline (`apps/gateway/app.py`) calls into
directly, the steps one reads in turn (issue 12 asks for at most 6 to the backend, entry included; the relay
and the account step make 8 to the end), and every project file whose code runs on the way (the helpers those
steps use: the request context, the snapshot, the state store, the policy core, the metrics). Both are
printed, with their lists, and held at their current size so that the path does not grow unnoticed.
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from apps.gateway.upstream_http import UpstreamTransport

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[2]
ENTRY = "apps/gateway/app.py"
# The pipeline's steps before the backend, in the order the entry calls them.
STEPS = ["apps/gateway/auth.py", "apps/gateway/parse.py", "apps/gateway/tokens.py", "apps/gateway/admission.py",
         "apps/gateway/upstream.py"]
# And after it: the answer relayed, then the hold given back and the usage recorded, once, by the entry; then
# the request's record of the request log (issue 26).
STEPS_AFTER = ["apps/gateway/relay.py", "apps/gateway/account.py", "apps/gateway/request_log.py"]
# Every project file the request's code runs in before it leaves, as measured when this test was written
# (2026-11-26: 22; 23 once the entitlement's queue joined the state machine, apps/policy/queues.py; 19 on
# 2026-11-27, once the narrow store left the own-queue decision and the quota sequence to calls the path in this
# test does not take). More is a regression to look at; fewer, lower it.
MOST_FILES_ON_THE_WAY = 19
# Every project file it runs in to the end of its stream: the 19 above plus 9, the three steps after the backend
# (relay.py, account.py, request_log.py) and what only they use: the TTFT feeding the dispatch budget's AIMD
# window (budget.py, apps/policy/aimd.py), the key's last use and the usage records (usage.py, and peers.py,
# which says whether the store counted them), the quota settled at release (apps/policy/quota_offer.py,
# quota.py). The release itself runs in files the offer already ran in (the state store, the policy ledger).
# More is a regression; fewer, lower it.
MOST_FILES_TO_THE_END = MOST_FILES_ON_THE_WAY + 9
# The backend's transport: the backend's own work, as httpx's was (a library outside the project).
TRANSPORT_FILE = "apps/gateway/upstream_http.py"


def _project_file(frame: FrameType | None) -> str | None:
    if frame is None:
        return None
    path = Path(frame.f_code.co_filename)
    if not path.is_relative_to(ROOT) or ".venv" in path.parts or "tests" in path.parts:
        return None
    name = path.relative_to(ROOT).as_posix()
    return None if name == TRANSPORT_FILE else name


class PathTrace:
    """Project files entered (in first-seen order), and those entered straight from the entry module: until
    the backend transport is called (`files`, `from_entry`), and until the request's last byte is sent
    (`all_files`, `all_from_entry`). The backend's own work (the transport and below) is not the gateway's."""

    def __init__(self) -> None:
        self.files: list[str] = []
        self.from_entry: list[str] = []
        self.all_files: list[str] = []
        self.all_from_entry: list[str] = []
        self.left = False

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        if frame.f_code is UpstreamTransport.post.__code__:
            self.left = True
            return
        here = _project_file(frame)
        if here is None:
            return
        caller = _project_file(frame.f_back)
        from_entry = caller == ENTRY and here != ENTRY
        if not self.left:
            _add(self.files, here)
            if from_entry:
                _add(self.from_entry, here)
        _add(self.all_files, here)
        if from_entry:
            _add(self.all_from_entry, here)


def _add(seen: list[str], name: str) -> None:
    if name not in seen:
        seen.append(name)


@dataclass
class Answer:
    """What the client got, and the state of its hold and its accounting when the end of the stream went out."""

    status: int = 0
    body: bytes = b""
    in_flight_at_done: list[int] = field(default_factory=list)


def _request(harness: Any, trace: PathTrace | None) -> Answer:
    """One streamed completion through the gateway's ASGI entry, run on the gateway's own loop (its thread,
    where the trace is installed), to the end of its stream."""
    gateway, secret = harness.gateway, harness.secret
    body = json.dumps({"model": "tiny-model", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 4, "stream": True}).encode()
    answer = Answer()

    async def run() -> None:
        done = asyncio.Event()
        delivered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                answer.status = message["status"]
                return
            answer.body += message.get("body", b"")
            if b"[DONE]" in message.get("body", b""):
                # The client sees the end: the request must hold nothing by now (its next request may come).
                answer.in_flight_at_done.append(sum(1 for _ in gateway.in_flight.contexts()))
            if not message.get("more_body"):
                done.set()

        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"",
                 "headers": [(b"authorization", f"Bearer {secret}".encode()),
                             (b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 1)}
        if trace is not None:
            sys.setprofile(trace)
        try:
            await gateway(scope, receive, send)
        finally:
            sys.setprofile(None)

    harness.server.call(run())
    return answer


def test_a_completion_reads_as_the_pipeline_of_steps_and_its_path_does_not_grow(gateway_factory: Any) -> None:
    harness = gateway_factory()
    # The first request of a process starts the gateway and syncs the pool: the steady path is the second's.
    assert _request(harness, None).status == 200
    metrics, entitlement = harness.gateway.metrics, harness.entitlement.name
    completion_before = metrics.tokens.get((entitlement, "completion"))
    trace = PathTrace()
    answer = _request(harness, trace)
    assert answer.status == 200 and answer.body.rstrip().endswith(b"data: [DONE]"), answer.body
    assert trace.left, "the request never reached the backend transport"
    print(f"\nfiles the entry calls into to the backend ({len(trace.from_entry) + 1} with it): "
          f"{[ENTRY, *trace.from_entry]}")
    print(f"project files on the way to the backend ({len(trace.files)}): {trace.files}")
    print(f"files the entry calls into to the end ({len(trace.all_from_entry) + 1} with it): "
          f"{[ENTRY, *trace.all_from_entry]}")
    print(f"project files to the end of the stream ({len(trace.all_files)}): {trace.all_files}")
    # The entry calls into the steps, in order, and into nothing else: six files to read to the backend,
    # nine to the end of the stream.
    assert trace.from_entry == STEPS, trace.from_entry
    assert len([ENTRY, *trace.from_entry]) <= 6
    assert trace.all_from_entry == STEPS + STEPS_AFTER, trace.all_from_entry
    assert len(trace.files) <= MOST_FILES_ON_THE_WAY, trace.files
    assert len(trace.all_files) <= MOST_FILES_TO_THE_END, trace.all_files
    # Followed to the end: the hold was given back before the client saw [DONE], and the request accounted.
    assert answer.in_flight_at_done == [0]
    assert harness.usage().in_flight == 0
    assert metrics.tokens.get((entitlement, "completion")) - completion_before == 4
