"""Failed sign-ins lock a username and an address for a while (issue 22: abuse is slowed): the token
endpoint answers 429 with Retry-After, the login pages a form error; the right password is refused while
locked; the lock ends by itself; each lock is logged at WARNING naming user and address."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
from django.test import Client
from rest_framework.test import APIClient

pytestmark = [pytest.mark.api, pytest.mark.django_db]

TOKEN = "/api/v1/auth/token"
RIGHT = "olivia-pass-123"


@pytest.fixture(autouse=True)
def _limits(settings: Any) -> None:
    settings.LOGIN_FAILURE_LIMIT, settings.LOGIN_FAILURE_WINDOW_S, settings.LOGIN_LOCKOUT_S = 3, 60.0, 60.0


def _token(username: str, password: str, address: str = "10.0.0.1") -> Any:
    return APIClient().post(TOKEN, {"username": username, "password": password}, format="json", REMOTE_ADDR=address)


def test_the_token_endpoint_locks_a_user_after_the_limit_and_refuses_even_the_right_password(
        owner: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="apps.tenancy.lockout"):
        statuses = [_token("olivia", f"wrong-{i}", address=f"10.0.0.{i}").status_code for i in range(3)]
    assert statuses == [400, 400, 429]  # the failure that reaches the limit is answered with the lock
    locked = _token("olivia", RIGHT, address="10.9.9.9")  # another address: the username is locked
    assert locked.status_code == 429
    assert 1 <= int(locked["Retry-After"]) <= 60
    assert "try again in" in locked.json()["detail"]
    (record,) = [r for r in caplog.records if "locked" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert "'olivia'" in record.getMessage() and "10.0.0.2" in record.getMessage()


def test_an_address_is_locked_whatever_usernames_it_tries(owner: Any, member: Any) -> None:
    assert [_token(name, "wrong", "10.0.0.7").status_code for name in ("a", "b", "c")] == [400, 400, 429]
    assert _token("olivia", RIGHT, "10.0.0.7").status_code == 429
    assert _token("olivia", RIGHT, "10.0.0.8").status_code == 200  # the user is not locked elsewhere


def test_the_lock_ends_by_itself(settings: Any, owner: Any) -> None:
    settings.LOGIN_LOCKOUT_S = 0.5
    assert [_token("olivia", "wrong").status_code for _ in range(3)] == [400, 400, 429]
    assert _token("olivia", RIGHT).status_code == 429
    time.sleep(0.6)
    assert _token("olivia", RIGHT).status_code == 200


def test_a_right_password_clears_the_users_count_and_missing_fields_do_not_count(owner: Any) -> None:
    assert [_token("olivia", "wrong", f"10.1.0.{i}").status_code for i in range(2)] == [400, 400]
    assert _token("olivia", RIGHT, "10.1.0.9").status_code == 200
    assert [_token("olivia", "wrong", f"10.2.0.{i}").status_code for i in range(2)] == [400, 400]
    for _ in range(5):
        assert APIClient().post(TOKEN, {"username": "olivia"}, format="json").status_code == 400
    assert _token("olivia", RIGHT, "10.3.0.1").status_code == 200


@pytest.mark.parametrize("url", ["/accounts/login/", "/django-admin/login/"])
def test_the_login_pages_lock_out_with_a_form_error(url: str, owner: Any, member: Any, admin: Any) -> None:
    username, password = ("olivia", RIGHT) if url == "/accounts/login/" else ("root", "root-pass-123")
    admin.set_password("root-pass-123")
    admin.save()
    client = Client(REMOTE_ADDR="10.0.0.3")
    for _ in range(3):
        page = client.post(url, {"username": username, "password": "wrong"})
        assert page.status_code == 200  # the form again, with its error
    assert "Too many failed sign-ins" in page.content.decode()
    refused = client.post(url, {"username": username, "password": password})
    assert refused.status_code == 200 and "Too many failed sign-ins" in refused.content.decode()
    assert "_auth_user_id" not in client.session
    # The lock is the username's and the address's: another user from another address signs in.
    other = Client(REMOTE_ADDR="10.0.0.4")
    assert other.post("/accounts/login/", {"username": "mark", "password": "mark-pass-123"}).status_code == 302
