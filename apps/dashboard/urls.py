"""Browser admin UI pages (login required)."""

from __future__ import annotations

app_name = "ui"
urlpatterns: list = []
