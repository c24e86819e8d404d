"""Token pools (capacity), their replicas, entitlements to that capacity and their state history.

Capacity has three dimensions (seed 000, section 3.1): concurrency (decode slots), token throughput
(tokens/s) and KV cache (bytes). A pool's capacity is its enabled replicas times the per-replica capacity.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models
from django.utils import timezone

from apps.policy import CLASS_TRAITS, ServiceClass
from apps.policy.admission import MAX_QUEUE_WAIT_MS
from apps.policy.classes import SPILLOVER_FROM, SPILLOVER_TO, Baseline, Shrink
from apps.policy.errors import PolicyConfigError
from apps.pools.validators import validate_backend_url
from apps.tenancy.quota import CURRENCY, QuotaFields

# A Kubernetes object name (RFC 1123 subdomain): what an InferenceObjective may be called.
K8S_NAME = re.compile(r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")

GIB = 1024**3
# The one answer to a taken entitlement name, whichever tenant holds it (TokenEntitlement.unique_error_message).
ENTITLEMENT_NAME_TAKEN = "this name is not available; choose another"

name_validator = RegexValidator(
    r"^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$",
    "Use lowercase letters, digits, '.' and '-' (Kubernetes object name style), starting and ending "
    "with a letter or digit.",
)


def gib_to_bytes(gib: Decimal | int | float) -> int:
    return int(Decimal(str(gib)) * GIB)


@dataclass(frozen=True)
class Capacity:
    """An amount on the three dimensions; used for pool capacity, reservations and free room."""

    slots: int
    tokens_per_second: int
    kv_bytes: int

    def __add__(self, other: Capacity) -> Capacity:
        return Capacity(
            self.slots + other.slots,
            self.tokens_per_second + other.tokens_per_second,
            self.kv_bytes + other.kv_bytes,
        )

    def __sub__(self, other: Capacity) -> Capacity:
        return Capacity(
            self.slots - other.slots,
            self.tokens_per_second - other.tokens_per_second,
            self.kv_bytes - other.kv_bytes,
        )

    def fits_in(self, room: Capacity) -> bool:
        return (
            self.slots <= room.slots
            and self.tokens_per_second <= room.tokens_per_second
            and self.kv_bytes <= room.kv_bytes
        )

    @property
    def kv_gib(self) -> float:
        return self.kv_bytes / GIB

    @classmethod
    def zero(cls) -> Capacity:
        return cls(0, 0, 0)


class BackendKind(models.TextChoices):
    VLLM = "vllm", "vLLM"
    ENGINE = "engine", "tokenpools engine"
    VIRTUAL = "virtual", "virtual (simulated vLLM)"
    # An llm-d inference gateway (Gateway API Inference Extension) in front of an InferencePool: handed the
    # tenant as fairness id and the served class's InferenceObjective on every request (issue 24).
    LLM_D = "llm-d", "llm-d inference gateway"


class TokenPool(models.Model):
    name = models.CharField(max_length=253, unique=True, validators=[name_validator])
    model_name = models.CharField(max_length=300)
    backend_kind = models.CharField(max_length=16, choices=BackendKind.choices, default=BackendKind.VLLM)
    min_replicas = models.PositiveIntegerField(default=1)
    max_replicas = models.PositiveIntegerField(default=1, validators=[MinValueValidator(1)])
    slots_per_replica = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    tokens_per_second_per_replica = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    kv_cache_gib_per_replica = models.DecimalField(
        max_digits=12, decimal_places=3, validators=[MinValueValidator(Decimal("0.001"))]
    )
    kv_layers = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    kv_heads = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    head_dim = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    bytes_per_element = models.PositiveIntegerField(default=2, validators=[MinValueValidator(1)])
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    updated_at = models.DateTimeField(default=timezone.now)
    # Written by the control loops (workers/), never by people: the scrape measures what one replica's
    # KV cache really holds (vLLM's cache_config_info), the autoscaling tick stores the replica count
    # the entitlements and the observed demand call for. Both are written with QuerySet.update(), which
    # leaves updated_at alone, so a tick does not make every gateway reload its snapshot.
    measured_kv_cache_tokens_per_replica = models.PositiveBigIntegerField(null=True, blank=True)
    measured_kv_cache_bytes_per_replica = models.PositiveBigIntegerField(null=True, blank=True)
    measured_at = models.DateTimeField(null=True, blank=True)
    desired_replicas = models.PositiveIntegerField(null=True, blank=True)
    desired_replicas_reason = models.CharField(max_length=300, blank=True, default="")
    desired_replicas_at = models.DateTimeField(null=True, blank=True)
    # Prices per million tokens: usage is reported as spend, and money quotas are converted at them.
    price_input_per_million = models.DecimalField(max_digits=12, decimal_places=6, null=True, blank=True,
                                                  validators=[MinValueValidator(Decimal(0))])
    price_output_per_million = models.DecimalField(max_digits=12, decimal_places=6, null=True, blank=True,
                                                   validators=[MinValueValidator(Decimal(0))])
    price_currency = models.CharField(max_length=3, blank=True, default="")
    # For an llm-d backend: the InferenceObjective name of each served class ({"guaranteed": "NAME"}); a class
    # left out gets `tokenpools-<class>` (apps.gateway.snapshot.PoolInfo.objective_for).
    inference_objectives = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def has_prices(self) -> bool:
        return self.price_input_per_million is not None and self.price_output_per_million is not None

    def clean(self) -> None:
        super().clean()
        given = [self.price_input_per_million is not None, self.price_output_per_million is not None,
                 bool(self.price_currency)]
        if any(given) and not all(given):
            raise ValidationError({"price_currency": ["prices need all three: input and output per million "
                                                      "tokens and a currency"]})
        if self.price_currency and not CURRENCY.match(self.price_currency):
            raise ValidationError({"price_currency": ["three capital letters (ISO 4217), e.g. USD"]})
        objectives_error = inference_objectives_error(self.inference_objectives)
        if objectives_error:
            raise ValidationError({"inference_objectives": [objectives_error]})

    @property
    def kv_cache_bytes_per_replica(self) -> int:
        return gib_to_bytes(self.kv_cache_gib_per_replica)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token occupies: c = 2 * L * H_kv * d_h * b (keys and values)."""
        return 2 * self.kv_layers * self.kv_heads * self.head_dim * self.bytes_per_element

    @property
    def per_replica_capacity(self) -> Capacity:
        return Capacity(self.slots_per_replica, self.tokens_per_second_per_replica, self.kv_cache_bytes_per_replica)

    def enabled_replica_count(self) -> int:
        return self.replicas.filter(enabled=True).count()

    def capacity(self) -> Capacity:
        """Enabled replicas x per-replica capacity, on all three dimensions."""
        n = self.enabled_replica_count()
        per = self.per_replica_capacity
        return Capacity(n * per.slots, n * per.tokens_per_second, n * per.kv_bytes)

    @property
    def kv_tokens_per_replica(self) -> int:
        """How many tokens of KV state one replica holds (derived, shown in the UI)."""
        return self.kv_cache_bytes_per_replica // self.bytes_per_token if self.bytes_per_token else 0


class Replica(models.Model):
    pool = models.ForeignKey(TokenPool, on_delete=models.CASCADE, related_name="replicas")
    # A CharField with an http(s) validator: a backend base URL, not a link for people to click.
    url = models.CharField(max_length=500, validators=[validate_backend_url])
    enabled = models.BooleanField(default=True)
    position = models.PositiveIntegerField(default=0)
    # The last scrape of the replica's /metrics (workers' scrape tick); null until the first one.
    healthy = models.BooleanField(null=True, blank=True)
    scrape_error = models.CharField(max_length=300, blank=True, default="")
    scraped_at = models.DateTimeField(null=True, blank=True)
    num_requests_running = models.PositiveIntegerField(null=True, blank=True)
    num_requests_waiting = models.PositiveIntegerField(null=True, blank=True)
    kv_cache_usage = models.FloatField(null=True, blank=True)
    kv_cache_tokens = models.PositiveBigIntegerField(null=True, blank=True)
    kv_cache_bytes = models.PositiveBigIntegerField(null=True, blank=True)

    class Meta:
        ordering = ["pool", "position", "id"]
        constraints = [models.UniqueConstraint(fields=["pool", "url"], name="pools_replica_unique_url")]

    def __str__(self) -> str:
        return f"{self.pool.name}: {self.url}"


# The service classes come from the policy core's one table (apps.policy.classes.CLASS_TRAITS); the field's
# choices are the same list as in migration 0001, so deriving them changes no schema.
SERVICE_CLASS_CHOICES: list[tuple[str, str]] = [(str(cls), cls.label) for cls in ServiceClass]
# Seed 000, Table 1: the base weight of each class (keys: ServiceClass values).
SERVICE_CLASS_WEIGHT: dict[str, float] = {str(cls): traits.base_weight for cls, traits in CLASS_TRAITS.items()}
# Classes whose baselines count against pool capacity when binding (elastic as a time-averaged reservation).
RESERVING_CLASSES = frozenset(str(cls) for cls, traits in CLASS_TRAITS.items() if traits.binds_capacity)
_BASELINE_WORDS = {Baseline.RESERVED: "reserved baseline", Baseline.TIME_AVERAGED: "time-averaged baseline",
                   Baseline.NONE: "no baseline"}
_SHRINK_WORDS = {Shrink.NEVER: "never shrinks", Shrink.YES: "shrinkable", Shrink.EVICT: "evicted first"}


def _class_help(cls: ServiceClass) -> str:
    traits = cls.traits
    burst = "may burst" if traits.may_burst else "no burst"
    return (f"{cls}: weight {traits.base_weight:g}, {_BASELINE_WORDS[traits.baseline]}, {burst}, "
            f"{_SHRINK_WORDS[traits.shrink]}")


# The classes in one line each, for help texts (API schema, entitlement form).
SERVICE_CLASS_HELP = "; ".join(_class_help(cls) for cls in ServiceClass)


# The longest a request may wait in an entitlement's queue, in whole milliseconds (10 minutes).
QUEUE_WAIT_MAX_MS = int(MAX_QUEUE_WAIT_MS)
QUEUE_MAX_MESSAGE = "must be 0 or more (0: refused at once; blank: the service class's default)"
QUEUE_WAIT_MESSAGE = f"must be from 0 to {QUEUE_WAIT_MAX_MS} ms (10 minutes); blank: the service class's default"
# Each class's default queue, for help texts (API schema, entitlement form).
QUEUE_DEFAULTS_HELP = "; ".join(f"{cls}: {t.queue_max}, {t.queue_max_wait_ms:g} ms" for cls, t in CLASS_TRAITS.items())


class EntitlementState(models.TextChoices):
    PENDING = "Pending", "Pending"
    BOUND = "Bound", "Bound"
    DEGRADED = "Degraded", "Degraded"
    EXPIRED = "Expired", "Expired"


class TokenEntitlement(QuotaFields, models.Model):
    name = models.CharField(max_length=253, unique=True, validators=[name_validator])
    tenant = models.ForeignKey("tenancy.Tenant", on_delete=models.CASCADE, related_name="entitlements")
    # PROTECT: a pool with entitlements cannot vanish under them; delete the entitlements first.
    pool = models.ForeignKey(TokenPool, on_delete=models.PROTECT, related_name="entitlements")
    service_class = models.CharField(max_length=16, choices=SERVICE_CLASS_CHOICES)
    slo_target_ms = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    tokens_per_second = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    kv_cache_gib = models.DecimalField(max_digits=12, decimal_places=3, validators=[MinValueValidator(Decimal("0.001"))])
    concurrency = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    default_max_tokens = models.PositiveIntegerField(null=True, blank=True, validators=[MinValueValidator(1)])
    # The entitlement's own queue (requests over its own limits wait there): how many may wait (0: refused at
    # once) and how long; blank takes the service class's default (apps.policy.classes.ClassTraits).
    queue_max = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(0, message=QUEUE_MAX_MESSAGE)])
    queue_max_wait_ms = models.PositiveIntegerField(null=True, blank=True, validators=[
        MinValueValidator(0, message=QUEUE_WAIT_MESSAGE),
        MaxValueValidator(QUEUE_WAIT_MAX_MS, message=QUEUE_WAIT_MESSAGE)])
    # A lower class its requests run as, at once, on idle capacity, when its own limits would make them wait
    # or refuse them (issue 24); blank: none.
    spillover_class = models.CharField(max_length=16, blank=True, default="",
                                       choices=[(c.value, c.value) for c in SPILLOVER_TO])
    expires_at = models.DateTimeField(null=True, blank=True)
    state = models.CharField(max_length=16, choices=EntitlementState.choices, default=EntitlementState.PENDING)
    state_reason = models.CharField(max_length=500, blank=True, default="")
    state_changed_at = models.DateTimeField(default=timezone.now)
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]
        indexes = [models.Index(fields=["pool", "state"]), models.Index(fields=["tenant", "state"]),
                   # The gateway's change marker reads their maxima twice a second (selectors.gateway_change_marker):
                   # a lookup, where a scan of 10,000 rows took 2.5 ms of a core each poll.
                   models.Index(fields=["updated_at"], name="pools_ent_updated_idx"),
                   models.Index(fields=["state_changed_at"], name="pools_ent_state_changed_idx")]

    def __str__(self) -> str:
        return self.name

    def unique_error_message(self, model_class: Any, unique_check: Any) -> ValidationError:
        # Names are unique across tenants (the gateway's caches, usage records and store keys are keyed by
        # them): "already exists" would tell a tenant that another one uses the name. The same neutral answer
        # whoever holds it, so a taken name says nothing about whose it is.
        if tuple(unique_check) == ("name",):
            return ValidationError(ENTITLEMENT_NAME_TAKEN, code="unique")
        return super().unique_error_message(model_class, unique_check)

    @property
    def weight(self) -> float:
        return SERVICE_CLASS_WEIGHT[self.service_class]

    @property
    def reserves_capacity(self) -> bool:
        return self.service_class in RESERVING_CLASSES

    @property
    def kv_cache_bytes(self) -> int:
        return gib_to_bytes(self.kv_cache_gib)

    @property
    def baseline(self) -> Capacity:
        """The entitlement's baseline (lambda_e, chi_e, r_e) as a Capacity."""
        return Capacity(self.concurrency, self.tokens_per_second, self.kv_cache_bytes)

    @property
    def queue_effective(self) -> tuple[int, int]:
        """The queue the entitlement gets: (how many may wait, how long in ms), blank fields by the class's
        defaults (the same rule as apps.policy.EntitlementLimits.own_queue_max / own_queue_wait_s)."""
        traits = CLASS_TRAITS[ServiceClass(self.service_class)]
        size = traits.queue_max if self.queue_max is None else self.queue_max
        wait = traits.queue_max_wait_ms if self.queue_max_wait_ms is None else self.queue_max_wait_ms
        return size, int(wait)

    @property
    def reservation(self) -> Capacity:
        """What binding this entitlement takes from the pool: its baseline, or nothing for spot/preemptible."""
        return self.baseline if self.reserves_capacity else Capacity.zero()

    def is_past_expiry(self, now: datetime | None = None) -> bool:
        return self.expires_at is not None and self.expires_at <= (now or timezone.now())

    # spillover_class's choices are checked by spillover_error, whose message says which classes may be named.
    CHECKED_IN_CLEAN = (*QuotaFields.CHECKED_IN_CLEAN, "spillover_class")

    def clean(self) -> None:
        errors: dict[str, Any] = {}
        try:
            super().clean()
        except ValidationError as exc:  # the quota's errors, reported with the spillover's
            errors = exc.update_error_dict(errors)
        error = spillover_error(self.service_class, self.spillover_class)
        if error:
            errors["spillover_class"] = [error]
        if errors:
            raise ValidationError(errors)

    def effective_state(self, now: datetime | None = None) -> str:
        """The stored state, except Expired as soon as ``expires_at`` has passed (before the tick runs)."""
        return str(EntitlementState.EXPIRED) if self.is_past_expiry(now) else str(self.state)


class EntitlementStateChange(models.Model):
    """One transition of an entitlement's state, with why and when (an audit trail)."""

    entitlement = models.ForeignKey(TokenEntitlement, on_delete=models.CASCADE, related_name="state_changes")
    from_state = models.CharField(max_length=16, blank=True, default="")
    to_state = models.CharField(max_length=16, choices=EntitlementState.choices)
    reason = models.CharField(max_length=500, blank=True, default="")
    at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["at", "id"]

    def __str__(self) -> str:
        return f"{self.entitlement_id}: {self.from_state or '-'} -> {self.to_state} ({self.reason})"


def spillover_error(service_class: str, spillover_class: str) -> str | None:
    """Why `spillover_class` cannot be the spillover of a `service_class` entitlement (None: it can)."""
    if not spillover_class:
        return None
    try:
        target = ServiceClass.parse(spillover_class)
    except PolicyConfigError:
        return f"unknown class {spillover_class!r}; expected one of {', '.join(c.value for c in SPILLOVER_TO)}"
    try:
        own = ServiceClass.parse(service_class)
    except PolicyConfigError:
        return None  # the service class's own error says it
    if own not in SPILLOVER_FROM:
        return f"a {own.value} entitlement cannot spill over (only dedicated, guaranteed and elastic ones can)"
    if not target.is_lower_than(own):
        lower = ", ".join(c.value for c in SPILLOVER_TO if c.is_lower_than(own))
        return f"{target.value!r} is not lower than {own.value!r}; expected one of {lower}"
    return None


def inference_objectives_error(objectives: Any) -> str | None:
    """Why a pool's InferenceObjective map is invalid (None: it is valid): {class: Kubernetes name}."""
    if objectives in (None, ""):
        return None
    if not isinstance(objectives, dict):
        return "a map of service class to InferenceObjective name, e.g. {\"guaranteed\": \"premium\"}"
    known = ", ".join(c.value for c in ServiceClass)
    for name, objective in objectives.items():
        if str(name) not in {c.value for c in ServiceClass}:
            return f"unknown service class {name!r}; expected one of {known}"
        if not isinstance(objective, str) or not K8S_NAME.match(objective):
            return (f"{objective!r} (for {name}) is not a Kubernetes object name: lower-case letters, digits and "
                    "'-', at most 253 characters, starting and ending with a letter or digit")
    return None
