"""The backend URL check: http(s), a host, an optional port and path.

Django's URLValidator wants a dotted domain (or `localhost`), which refuses the names backends actually have
inside a cluster or a compose network: `http://vllm:8000` (a Kubernetes Service in the same namespace),
`http://virtual-vllm:8000` (a compose service). A backend URL is not a link for people to click: any host name
the resolver may know is fair, as are IPv4 and bracketed IPv6 addresses.
"""

from __future__ import annotations

import re

from django.core.validators import RegexValidator

_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
BACKEND_URL_RE = re.compile(
    rf"^https?://(?:{_LABEL}(?:\.{_LABEL})*\.?|\[[0-9a-f:.]+\])(?::\d{{1,5}})?(?:[/?#]\S*)?$", re.IGNORECASE)

validate_backend_url = RegexValidator(BACKEND_URL_RE, "Enter an http(s) URL: a host name or address, an optional "
                                                      "port and path.", code="invalid")
