"""Fixtures for end-to-end tests: Debian's chromium driven by playwright against pytest-django's live server.

Playwright's sync API keeps an asyncio event loop running in the test's thread (through greenlets), and
Django refuses ORM calls from a thread with a running loop (SynchronousOnlyOperation). The test thread
only creates rows before the browser acts and reads them back afterwards, while the live server's own
thread answers the browser, so no connection is shared across an event loop. ``browser_page`` therefore
sets ``DJANGO_ALLOW_ASYNC_UNSAFE`` for the duration of each browser test only (through monkeypatch), so
the rest of the suite keeps Django's guard.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM_PATH = os.environ.get("TOKENPOOLS_CHROMIUM", "/usr/bin/chromium")
# Without the background-networking flags chromium keeps trying to reach Google's services and floods the
# log with refused connections (nothing outside the package registries can be reached here).
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOT_DIR = Path(__file__).resolve().parents[2] / "test-output"


def screenshot_path(request: pytest.FixtureRequest, suffix: str = "") -> Path:
    """Where a test's screenshot goes: test-output/<test name><suffix>.png (the folder is gitignored)."""
    SCREENSHOT_DIR.mkdir(exist_ok=True)
    safe_name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)
    return SCREENSHOT_DIR / f"{safe_name}{suffix}.png"


@pytest.fixture
def fast_password_hashing(settings: Any) -> None:
    """PBKDF2's many rounds cost about half a second per user on this machine; browser tests that create
    users ask for this (not autouse: other end-to-end tests share this folder)."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def browser_page(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A page in a fresh chromium profile; a screenshot of its last state lands in test-output/.

    Each test gets its own ``--user-data-dir`` (playwright's persistent context) so no cookie or cache
    leaks from one test into the next.
    """
    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM_PATH).exists():
        pytest.skip(f"chromium not found at {CHROMIUM_PATH}; run `make system-deps` (Debian package chromium)")
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    profile_dir = tempfile.mkdtemp(prefix="tokenpools-chromium-")
    try:
        with sync_api.sync_playwright() as driver:
            context = driver.chromium.launch_persistent_context(
                profile_dir,
                executable_path=CHROMIUM_PATH,
                headless=True,
                args=CHROMIUM_ARGS,
                viewport={"width": 1280, "height": 900},
            )
            context.set_default_timeout(15_000)
            page = context.pages[0] if context.pages else context.new_page()
            try:
                yield page
            finally:
                try:
                    page.screenshot(path=str(screenshot_path(request)), full_page=True)
                finally:
                    context.close()
    finally:
        shutil.rmtree(profile_dir, ignore_errors=True)
