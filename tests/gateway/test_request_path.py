"""The request path as a newcomer follows it: which project files one `/v1/chat/completions` request runs
through from the gateway's entry until the request leaves for the backend (traced, not listed by hand).

Two figures: the files the pipeline (`apps/gateway/app.py`) calls into directly, the steps one reads in turn
(issue 12 asks for at most 6, entry included), and every project file whose code runs on the way (the
helpers those steps use: the request context, the snapshot, the state store, the policy core). The second is
printed, with its list, and held at its current size so that the path does not grow unnoticed.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from apps.gateway import upstream

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[2]
ENTRY = "apps/gateway/app.py"
# The pipeline's steps before the backend, in the order the entry calls them.
STEPS = ["apps/gateway/auth.py", "apps/gateway/parse.py", "apps/gateway/tokens.py", "apps/gateway/admission.py",
         "apps/gateway/upstream.py"]
# Every project file the request's code runs in before it leaves, as measured when this test was written
# (2026-11-26: 22; 23 once the entitlement's queue joined the state machine, apps/policy/queues.py). More is a
# regression to look at; fewer, lower it.
MOST_FILES_ON_THE_WAY = 23


def _project_file(frame: FrameType | None) -> str | None:
    if frame is None:
        return None
    path = Path(frame.f_code.co_filename)
    if not path.is_relative_to(ROOT) or ".venv" in path.parts or "tests" in path.parts:
        return None
    return path.relative_to(ROOT).as_posix()


class PathTrace:
    """Project files entered (in first-seen order), and those entered straight from the entry module,
    until the backend transport is called."""

    def __init__(self) -> None:
        self.files: list[str] = []
        self.from_entry: list[str] = []
        self.left = False

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or self.left:
            return
        if frame.f_code is upstream.ShardedTransport.handle_async_request.__code__:
            self.left = True
            return
        here = _project_file(frame)
        if here is None:
            return
        if here not in self.files:
            self.files.append(here)
        caller = _project_file(frame.f_back)
        if caller == ENTRY and here != ENTRY and here not in self.from_entry:
            self.from_entry.append(here)


def _request(harness: Any, trace: PathTrace | None) -> int:
    """One completion through the gateway's ASGI entry, run on the gateway's own loop (its thread, where the
    trace is installed)."""
    gateway, secret = harness.gateway, harness.secret
    body = json.dumps({"model": "tiny-model", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 4}).encode()
    sent: list[dict[str, Any]] = []

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
            sent.append(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
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
    return int(sent[0]["status"])


def test_a_completion_reads_as_the_pipeline_of_steps_and_its_path_does_not_grow(gateway_factory: Any) -> None:
    harness = gateway_factory()
    # The first request of a process starts the gateway and syncs the pool: the steady path is the second's.
    assert _request(harness, None) == 200
    trace = PathTrace()
    assert _request(harness, trace) == 200
    assert trace.left, "the request never reached the backend transport"
    print(f"\nfiles the entry calls into ({len(trace.from_entry) + 1} with it): {[ENTRY, *trace.from_entry]}")
    print(f"project files on the way to the backend ({len(trace.files)}): {trace.files}")
    # The entry calls into the steps, in order, and into nothing else: six files to read.
    assert trace.from_entry == STEPS, trace.from_entry
    assert len([ENTRY, *trace.from_entry]) <= 6
    assert len(trace.files) <= MOST_FILES_ON_THE_WAY, trace.files
