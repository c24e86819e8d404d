"""Websocket consumers of the live dashboards (convention 7: authenticate, join a group, forward).

`PoolLiveConsumer` (`/ws/pools/<name>/`) and `EntitlementLiveConsumer` (`/ws/entitlements/<name>/`)
refuse an anonymous socket (close 4401) and one for an object the user may not see (close 4404, the
404 of the pages), join the pool's group, send the recent history, then forward every sample of the
pool cut down to what this user may see. The payloads come from the pure builders in
apps.dashboard.figures; nothing here shapes a figure.

Access is checked again every `DASHBOARD_ACCESS_RECHECK_S` seconds against the database (the user row
reloaded: a deactivated login or a removed membership is not visible on the scope's cached user; the browser
session still signed in): a socket whose user may no longer see what it streams, or who signed out, is closed
with 4403, so losing access ends the stream within one period, not at the next page load.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from importlib import import_module
from types import SimpleNamespace
from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django.contrib.auth import get_user, get_user_model
from django.http import Http404

from apps.dashboard import overview_selectors, selectors
from apps.dashboard.figures import live_payload_history, live_payload_update
from apps.dashboard.history import history_store
from apps.dashboard.overview_figures import overview_payload
from apps.dashboard.samples import PoolSample, sample_visible, samples_visible
from apps.dashboard.telemetry import ensure_local_sampler, pool_group

CLOSE_UNAUTHENTICATED = 4401
CLOSE_FORBIDDEN = 4403
CLOSE_NOT_FOUND = 4404
# How often the overview socket sends a fresh picture (its reads are a few aggregate queries).
OVERVIEW_PUSH_S = 2.0

logger = logging.getLogger(__name__)


def narrowed(before: selectors.LiveAccess, now: selectors.LiveAccess) -> bool:
    """Whether `now` withholds something `before` showed (another pool, pool totals, an entitlement).
    A widening is not acted on: the page keeps the series it was given until it is reloaded."""
    if before.pool != now.pool or (before.visibility.pool_totals and not now.visibility.pool_totals):
        return True
    old, new = before.visibility.entitlements, now.visibility.entitlements
    return new is not None and (old is None or not old <= new)


def signed_in_user(user_id: int, session_key: str | None) -> Any:
    """The user, reloaded, while still active and (for a socket that came with a browser session) signed in
    in that session; else None."""
    if session_key is not None:
        # Django's own check of a session: it exists, has not expired, names this user, and its password
        # hash still matches (a password change signs every session out).
        engine = import_module(settings.SESSION_ENGINE)
        signed_in = get_user(SimpleNamespace(session=engine.SessionStore(session_key)))  # type: ignore[arg-type]
        if signed_in.pk != user_id:
            return None
    return get_user_model().objects.filter(pk=user_id, is_active=True).first()


class _LiveConsumer(AsyncJsonWebsocketConsumer):
    access: selectors.LiveAccess | None = None
    group: str | None = None
    recheck: asyncio.Task[None] | None = None

    def resolve(self, user: Any, name: str) -> selectors.LiveAccess:
        raise NotImplementedError

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        name = self.scope["url_route"]["kwargs"]["name"]
        try:
            self.access = await database_sync_to_async(self.resolve)(user, name)
        except Http404:
            await self.close(code=CLOSE_NOT_FOUND)
            return
        self.group = pool_group(self.access.pool)
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()
        # The browser's session, when the socket came with one: signing out (or a password change) ends it.
        session_key = getattr(self.scope.get("session"), "session_key", None)
        self.recheck = asyncio.ensure_future(self._recheck_access(user.pk, name, session_key))
        ensure_local_sampler()
        visibility = self.access.visibility
        history = samples_visible(await history_store().recent(self.access.pool), visibility)
        await self.send_json(live_payload_history(history, visibility.entitlements, ids=self.access.figure_ids))

    def _access_now(self, user_id: int, name: str, session_key: str | None) -> selectors.LiveAccess | None:
        user = signed_in_user(user_id, session_key)
        if user is None:
            return None
        try:
            return self.resolve(user, name)
        except Http404:
            return None

    async def _recheck_access(self, user_id: int, name: str, session_key: str | None) -> None:
        while self.access is not None:
            await asyncio.sleep(settings.DASHBOARD_ACCESS_RECHECK_S)
            try:
                now = await database_sync_to_async(self._access_now)(user_id, name, session_key)
            except Exception:  # the database away for a moment: keep the socket, try again next period
                logger.exception("live dashboard access re-check failed")
                continue
            if now is None or narrowed(self.access, now):
                self.access = None  # forward nothing more, even a sample already queued
                await self.close(code=CLOSE_FORBIDDEN)
                return

    async def disconnect(self, code: int) -> None:
        if self.recheck is not None and self.recheck is not asyncio.current_task():
            self.recheck.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.recheck
        if self.group is not None:
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        """The stream is one-way; whatever a client sends is ignored."""

    async def pool_sample(self, event: dict[str, Any]) -> None:
        if self.access is None:
            return
        visibility = self.access.visibility
        sample = sample_visible(PoolSample.from_dict(event["sample"]), visibility)
        await self.send_json(live_payload_update(sample, visibility.entitlements, ids=self.access.figure_ids))


class PoolLiveConsumer(_LiveConsumer):
    def resolve(self, user: Any, name: str) -> selectors.LiveAccess:
        return selectors.live_pool_access(user=user, name=name)


class EntitlementLiveConsumer(_LiveConsumer):
    def resolve(self, user: Any, name: str) -> selectors.LiveAccess:
        return selectors.live_entitlement_access(user=user, name=name)


class OverviewConsumer(AsyncJsonWebsocketConsumer):
    """`/ws/overview/`: the home page's figures for what the user may see, sent on connect and then every
    `OVERVIEW_PUSH_S`. Each message is computed afresh for the user reloaded from the database, so a removed
    membership narrows the next message and a deactivated or signed-out user's socket is closed (4403)."""

    pusher: asyncio.Task[None] | None = None

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        await self.accept()
        ensure_local_sampler()
        session_key = getattr(self.scope.get("session"), "session_key", None)
        self.pusher = asyncio.ensure_future(self._push_forever(user.pk, session_key))

    async def _push_forever(self, user_id: int, session_key: str | None) -> None:
        while True:
            try:
                user = await database_sync_to_async(signed_in_user)(user_id, session_key)
                if user is None:
                    await self.close(code=CLOSE_FORBIDDEN)
                    return
                await self.send_json(await overview_message(user))
            except asyncio.CancelledError:
                raise
            except Exception:  # the database away for a moment: keep the socket, try again next period
                logger.exception("overview push failed")
            await asyncio.sleep(OVERVIEW_PUSH_S)

    async def disconnect(self, code: int) -> None:
        if self.pusher is not None and self.pusher is not asyncio.current_task():
            self.pusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.pusher

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        """The stream is one-way; whatever a client sends is ignored."""


async def overview_message(user: Any) -> dict[str, Any]:
    """One overview message for `user`: the scope and the reads in a thread, the history from the loop."""
    now = dt.datetime.now(dt.UTC)
    scope = await database_sync_to_async(overview_selectors.overview_scope)(user=user)
    samples = await overview_selectors.pool_histories(scope.pools)

    def build() -> dict[str, Any]:
        return overview_payload(overview_selectors.overview_get(user=user, samples=samples, now=now), now)

    return await database_sync_to_async(build)()
