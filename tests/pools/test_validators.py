"""Backend URLs: the names backends have inside a cluster or a compose network are accepted; what is not an
http(s) URL of a host is refused, by the model and by the services (apply, REST)."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError

from apps.pools.validators import validate_backend_url


@pytest.mark.parametrize("url", [
    "http://vllm:8000",  # a Kubernetes Service in the same namespace
    "http://virtual-vllm:8000",  # a compose service
    "http://vllm-0.vllm.inference.svc.cluster.local:8000/",
    "https://api.example.com/v1",
    "http://127.0.0.1:8100",
    "http://[::1]:8000",
    "http://localhost",
])
def test_backend_names_are_accepted(url: str) -> None:
    validate_backend_url(url)


@pytest.mark.parametrize("url", [
    "ftp://vllm:8000", "vllm:8000", "http://", "http://-vllm:8000", "http://v llm:8000", "http://vllm:123456",
    "http://under_score:8000", "http://a..b:8000", "javascript:alert(1)",
])
def test_what_is_not_a_backend_url_is_refused(url: str) -> None:
    with pytest.raises(ValidationError):
        validate_backend_url(url)


@pytest.mark.django_db
def test_apply_takes_a_short_service_name() -> None:
    from apps.pools.models import Replica
    from apps.pools.services import _clean_replicas

    cleaned = _clean_replicas([{"url": "http://vllm:8000"}])
    assert [item["url"] for item in cleaned] == ["http://vllm:8000"]
    Replica(url="http://vllm:8000").clean_fields(exclude=["pool"])
