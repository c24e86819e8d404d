"""``python manage.py demo_screenshot``: redo the README's picture of the live pool dashboard.

With the demo running (``make run`` or ``manage.py demo_up``), logs in as the operator in headless Debian
chromium (playwright), opens ``/pools/demo-pool/live/``, lets the charts fill for ``--wait`` seconds of
traffic and saves a full-page screenshot (``static/img/dashboard.png`` by default). Start it within a few
seconds of the demo so the picture spans the quiet start and globex-spot's burst (20 s to 60 s).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

# Without the background-networking flags chromium keeps trying to reach Google's services (same flags as
# the browser tests in tests/e2e/conftest.py).
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


class Command(BaseCommand):
    help = "Screenshot the live dashboard of demo-pool while the demo's traffic runs."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--url", default="http://127.0.0.1:8000", help="the running demo site")
        parser.add_argument("--pool", default="demo-pool")
        parser.add_argument("--username", default="admin")
        parser.add_argument("--password", default=None, help="default: TOKENPOOLS_ADMIN_PASSWORD")
        parser.add_argument("--wait", type=float, default=45.0, help="seconds of live updates before the shot")
        parser.add_argument("--out", default=str(Path(settings.BASE_DIR) / "static" / "img" / "dashboard.png"))
        parser.add_argument("--chromium", default=settings.TOKENPOOLS_CHROMIUM)
        parser.add_argument("--width", type=int, default=1400)

    def handle(self, *args: Any, **options: Any) -> None:
        from playwright.sync_api import sync_playwright

        password = options["password"] or settings.TOKENPOOLS_ADMIN_PASSWORD
        if not password:
            raise CommandError("give --password or set TOKENPOOLS_ADMIN_PASSWORD (the operator's password)")
        if not Path(options["chromium"]).exists():
            raise CommandError(f"chromium not found at {options['chromium']} (Debian package chromium)")
        url = options["url"].rstrip("/")
        out = Path(options["out"])
        out.parent.mkdir(parents=True, exist_ok=True)
        # One update a second: wait for the count rather than sleeping, so a stalled socket fails loudly.
        updates = max(2, int(options["wait"]))
        with sync_playwright() as driver:
            browser = driver.chromium.launch(executable_path=options["chromium"], args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": options["width"], "height": 1000})
                page.set_default_timeout(30_000)
                page.goto(f"{url}/pools/{options['pool']}/live/")
                page.get_by_label("Username", exact=True).fill(options["username"])
                page.get_by_label("Password", exact=True).fill(password)
                page.get_by_role("button", name="Log in").click()
                page.wait_for_selector("#live")
                page.wait_for_function(
                    f"Number(document.getElementById('live').dataset.updates) >= {updates}",
                    timeout=(options["wait"] + 60) * 1000,
                )
                page.screenshot(path=str(out), full_page=True)
            finally:
                browser.close()
        self.stdout.write(f"saved {out}")
