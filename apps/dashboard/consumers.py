"""Websocket consumers of the live dashboards (convention 7: authenticate, join a group, forward).

`PoolLiveConsumer` (`/ws/pools/<name>/`) and `EntitlementLiveConsumer` (`/ws/entitlements/<name>/`)
refuse an anonymous socket (close 4401) and one for an object the user may not see (close 4404, the
404 of the pages), join the pool's group, send the recent history, then forward every sample of the
pool cut down to what this user may see. The payloads come from the pure builders in
apps.dashboard.figures; nothing here shapes a figure.
"""

from __future__ import annotations

from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.http import Http404

from apps.dashboard import selectors
from apps.dashboard.figures import live_payload_history, live_payload_update
from apps.dashboard.telemetry import (
    PoolSample,
    ensure_local_sampler,
    history_store,
    pool_group,
    sample_visible,
    samples_visible,
)

CLOSE_UNAUTHENTICATED = 4401
CLOSE_NOT_FOUND = 4404


class _LiveConsumer(AsyncJsonWebsocketConsumer):
    access: selectors.LiveAccess | None = None
    group: str | None = None

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
        ensure_local_sampler()
        visibility = self.access.visibility
        history = samples_visible(await history_store().recent(self.access.pool), visibility)
        await self.send_json(live_payload_history(history, visibility.entitlements, ids=self.access.figure_ids))

    async def disconnect(self, code: int) -> None:
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
