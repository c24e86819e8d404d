"""A budget over a calendar window, as a tenant or an entitlement declares it.

Either tokens (prompt plus completion) or an amount of money (converted at the pool's prices when a
request is priced), per hour, day or month, aligned to the calendar in a timezone (UTC unless given).
The same fields sit on `Tenant` (shared by all its entitlements) and on `TokenEntitlement`; the gateway
enforces both (`apps.policy.quota`).
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models

from apps.policy.quota import QUOTA_ON_EXCEEDED, QUOTA_WINDOWS

CURRENCY = re.compile(r"^[A-Z]{3}$")


def timezone_valid(name: str) -> bool:
    if not name or name != name.strip() or "\0" in name:
        return False
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        return False
    return True


class QuotaFields(models.Model):
    quota_tokens = models.PositiveBigIntegerField(null=True, blank=True, validators=[MinValueValidator(1)])
    quota_amount = models.DecimalField(max_digits=14, decimal_places=4, null=True, blank=True,
                                       validators=[MinValueValidator(Decimal("0.0001"))])
    quota_currency = models.CharField(max_length=3, blank=True, default="")
    quota_window = models.CharField(max_length=8, blank=True, default="",
                                    choices=[(w, w) for w in QUOTA_WINDOWS])
    # Blank means UTC (forms that leave it out stay valid).
    quota_timezone = models.CharField(max_length=64, default="UTC", blank=True)
    # What a used-up quota does: refuse (429 quota_exceeded) or serve as spot until the window resets (issue 24).
    quota_on_exceeded = models.CharField(max_length=8, default="reject", blank=True,
                                         choices=[(v, v) for v in QUOTA_ON_EXCEEDED])

    class Meta:
        abstract = True

    # Fields whose value `clean()` checks with its own message (naming the values it takes) instead of the
    # choices check's "Value 'x' is not a valid choice." (which would say the same twice).
    CHECKED_IN_CLEAN: tuple[str, ...] = ("quota_on_exceeded",)

    def clean_fields(self, exclude: Any = None) -> None:
        super().clean_fields(exclude={*(exclude or ()), *self.CHECKED_IN_CLEAN})

    @property
    def has_quota(self) -> bool:
        return bool(self.quota_window) and (self.quota_tokens is not None or self.quota_amount is not None)

    @property
    def quota_is_money(self) -> bool:
        return self.has_quota and self.quota_amount is not None

    def clean(self) -> None:
        super().clean()
        self.quota_timezone = self.quota_timezone or "UTC"
        self.quota_on_exceeded = self.quota_on_exceeded or "reject"
        errors = quota_errors(tokens=self.quota_tokens, amount=self.quota_amount, currency=self.quota_currency,
                              window=self.quota_window, tz=self.quota_timezone)
        on_exceeded = on_exceeded_error(self.quota_on_exceeded)
        if not on_exceeded and self.quota_on_exceeded != "reject" and not (
                self.quota_window or self.quota_tokens is not None or self.quota_amount is not None):
            on_exceeded = f"{self.quota_on_exceeded} applies to a quota: give quota_tokens or quota_amount and a window"
        if on_exceeded:
            errors["quota_on_exceeded"] = [on_exceeded]
        if errors:
            raise ValidationError(errors)


def on_exceeded_error(value: Any) -> str | None:
    """Why `value` is not what a used-up quota does (None: it is one of QUOTA_ON_EXCEEDED)."""
    if value in QUOTA_ON_EXCEEDED:
        return None
    return (f"unknown value {str(value)[:40]!r}; expected reject (refuse with 429 quota_exceeded, the default) or "
            "spot (serve as spot until the window resets)")


def quota_errors(*, tokens: int | None, amount: Decimal | None, currency: str, window: str,
                 tz: str) -> dict[str, list[str]]:
    """Field errors of a quota as a whole (each field's own validators run separately)."""
    errors: dict[str, list[str]] = {}
    if tokens is not None and amount is not None:
        errors["quota_amount"] = ["give a quota in tokens or in money, not both"]
    if (tokens is not None or amount is not None) and not window:
        errors["quota_window"] = [f"a quota needs a window: one of {', '.join(QUOTA_WINDOWS)}"]
    if window and tokens is None and amount is None:
        errors["quota_tokens"] = ["a quota window needs quota_tokens or quota_amount"]
    if window and window not in QUOTA_WINDOWS:
        errors["quota_window"] = [f"unknown window {window!r}; one of {', '.join(QUOTA_WINDOWS)}"]
    if amount is not None and not CURRENCY.match(currency or ""):
        errors["quota_currency"] = ["a money quota needs a currency: three capital letters (ISO 4217), e.g. USD"]
    if amount is None and currency:
        errors["quota_currency"] = ["a currency is only given with quota_amount"]
    if not timezone_valid(tz):
        errors["quota_timezone"] = [f"unknown timezone {tz!r} (an IANA name such as UTC or Europe/Paris)"]
    return errors
