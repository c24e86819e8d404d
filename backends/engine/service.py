"""The engine loop: scheduler + runner + tokenizer, stepped in one background thread.

The HTTP server runs on asyncio; the forward pass is blocking torch work, so a dedicated thread owns
the scheduler and steps it while there is work. Requests talk to it through a lock-protected submit
and per-request asyncio queues fed with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from backends import vllm_wire
from backends.engine.runner import EngineRunner, RunnerConfig, budget_tokens_for
from backends.engine.scheduler import (
    AdmissionRejectedEvent,
    BatchSchedulerConfig,
    CompletedEvent,
    CompletionReason,
    ContinuousBatchScheduler,
    PreemptedEvent,
    PrefillStrategy,
    PromptRequest,
    SamplingParams,
    SchedulerEvent,
    TenantConfig,
    TokenEvent,
    next_request_id,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSettings:
    model_dir: str
    policy: str = "token-pd"
    kv_budget_mib: float = 64.0
    max_batch_size: int = 16
    max_pending_prompts: int = 256
    prefill_strategy: PrefillStrategy = PrefillStrategy.CHUNKED
    prefill_chunk_tokens: int = 256
    block_size: int = 16
    device: str | None = None
    dtype: str = "float32"  # weights, activations and the KV cache (a key of `model.DTYPES`)
    served_model_name: str | None = None
    default_tenant: TenantConfig = field(default_factory=lambda: TenantConfig("default", 16, 1_000_000, 1.0))
    sink_tokens: int = 4
    recent_tokens: int = 8
    # Per-tenant quotas known in advance; any other tenant gets `default_tenant`'s quotas.
    tenants: tuple[TenantConfig, ...] = ()
    over_quota: str = "queue"


@dataclass
class RequestStream:
    request_id: str
    tenant_id: str
    prompt_tokens: int
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[SchedulerEvent]
    submitted_at: float


class Engine:
    def __init__(self, settings: EngineSettings) -> None:
        from tokenizers import Tokenizer

        self.settings = settings
        folder = Path(settings.model_dir)
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tokenizer_config_path = folder / "tokenizer_config.json"
        self.tokenizer_config = (
            json.loads(tokenizer_config_path.read_text()) if tokenizer_config_path.exists() else {}
        )
        from backends.engine.model import DTYPES, LlamaConfig

        if settings.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {settings.dtype!r}; choose from {', '.join(DTYPES)}")
        dtype = DTYPES[settings.dtype]
        model_config = LlamaConfig.from_folder(folder)
        self.kv_bytes_per_token = model_config.kv_bytes_per_token_in(dtype)
        budget = budget_tokens_for(settings.kv_budget_mib, self.kv_bytes_per_token)
        self.runner = EngineRunner(
            settings.model_dir,
            settings.policy,
            RunnerConfig(
                budget_tokens=budget,
                max_batch_size=settings.max_batch_size,
                sink_tokens=settings.sink_tokens,
                recent_tokens=settings.recent_tokens,
            ),
            device=settings.device,
            dtype=dtype,
        )
        self.model_config = self.runner.model.config
        self.scheduler = ContinuousBatchScheduler(
            self.runner,
            BatchSchedulerConfig(
                max_batch_size=settings.max_batch_size,
                max_pending_prompts=settings.max_pending_prompts,
                prefill_strategy=settings.prefill_strategy,
                # A chunk must fit in the budget with room to spare, so a prompt longer than M still
                # streams through the cache (evicting as it goes) instead of failing.
                prefill_chunk_tokens=max(1, min(settings.prefill_chunk_tokens, budget // 4)),
                block_size=settings.block_size,
                over_quota="reject" if settings.over_quota == "reject" else "queue",
            ),
        )
        for tenant in settings.tenants:
            self.scheduler.register_tenant(tenant)
        self.model_name = settings.served_model_name or folder.name
        self.max_model_len = self.model_config.max_position_embeddings
        self.created = int(time.time())
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.counters: Counter[str] = Counter()
        self.finished_by_reason: Counter[str] = Counter()
        self.rejected_by_reason: Counter[str] = Counter()

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the stepping thread (idempotent; the server calls it on every request)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            events = self.scheduler.shutdown()
        for event in events:
            self._dispatch(event)

    def _loop(self) -> None:
        while not self._stopping:
            with self._lock:
                busy = self.scheduler.has_work()
                try:
                    events = self.scheduler.step() if busy else []
                except Exception:
                    # A bug outside the forward (the scheduler reports forward errors itself) must not
                    # kill the thread and leave every client hanging: end what is in flight, go on.
                    logger.exception("engine step failed; cancelling every request in flight")
                    self.counters["step_failures"] += 1
                    events = self.scheduler.shutdown(CompletionReason.ENGINE_ERROR, "engine step failed")
            for event in events:
                self._dispatch(event)
            if not busy:
                self._wake.wait(timeout=0.05)
                self._wake.clear()

    def _dispatch(self, event: SchedulerEvent) -> None:
        if isinstance(event, TokenEvent):
            self.counters["generation_tokens"] += 1
        elif isinstance(event, CompletedEvent):
            self.finished_by_reason[event.reason.value] += 1
        elif isinstance(event, AdmissionRejectedEvent):
            self.rejected_by_reason[event.quota.value if event.quota else event.reason.value] += 1
        elif isinstance(event, PreemptedEvent):
            self.counters["preemptions"] += 1
        stream = self._streams.get(event.request_id)
        if stream is None:
            return
        if isinstance(event, CompletedEvent | AdmissionRejectedEvent):
            self._streams.pop(event.request_id, None)
        # RuntimeError: the client's event loop is gone (server shutting down), nobody is listening.
        with contextlib.suppress(RuntimeError):
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, event)

    # ---- requests ----------------------------------------------------------------------------------
    def ensure_tenant(self, tenant_id: str) -> None:
        if self.scheduler.tenant_state(tenant_id) is None:
            default = self.settings.default_tenant
            self.scheduler.register_tenant(
                TenantConfig(tenant_id, default.max_concurrent, default.max_blocks, default.weight)
            )

    def register_tenant(self, config: TenantConfig) -> None:
        with self._lock:
            self.scheduler.register_tenant(config)

    def submit(
        self,
        tenant_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> RequestStream | SchedulerEvent:
        """Queue a request; returns its stream, or the rejection event when it was refused outright.

        `loop` is the event loop that will read the stream (default: the running one); pass it when
        calling from a worker thread, which the server does so a forward in progress (the engine holds
        the lock during a step) never blocks its event loop.
        """
        request_id = next_request_id("cmpl")
        stream = RequestStream(
            request_id,
            tenant_id,
            len(prompt_ids),
            loop or asyncio.get_running_loop(),
            asyncio.Queue(),
            time.monotonic(),
        )
        with self._lock:
            self.ensure_tenant(tenant_id)
            self._streams[request_id] = stream
            rejection = self.scheduler.submit(
                PromptRequest(tenant_id, request_id, tuple(prompt_ids), sampling)
            )
            if rejection is not None:
                self._streams.pop(request_id, None)
                return rejection
            self.counters["prompt_tokens"] += len(prompt_ids)
        self._wake.set()
        return stream

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self.scheduler.cancel(request_id)
        self._wake.set()

    # ---- tokens ------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict]) -> str:
        import jinja2

        template = self.tokenizer_config.get("chat_template")
        if not template:
            template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "
        environment = jinja2.Environment(autoescape=False, trim_blocks=False)
        return environment.from_string(template).render(messages=messages, add_generation_prompt=True)

    # ---- metrics -----------------------------------------------------------------------------------
    def metrics_text(self) -> str:
        with self._lock:
            running = self.scheduler.num_running
            waiting = self.scheduler.num_pending + (self.scheduler.num_active - running)
            pool = self.runner.model.pool
            stats = self.runner.stats
            gauges = self.runner.policy.gauges()
            tenants = [self.scheduler.tenant_state(t) for t in self.scheduler.tenant_ids()]
        budget = self.runner.config.budget_tokens
        block = self.settings.block_size
        lines = vllm_wire.vllm_metric_lines(
            vllm_wire.VllmStats(
                model_name=self.model_name,
                running=running,
                waiting=waiting,
                kv_usage=pool.num_used / budget,
                cache_config={
                    "block_size": block,
                    "num_gpu_blocks": budget // block,
                    "kv_bytes_per_token": self.kv_bytes_per_token,
                    "kv_budget_tokens": budget,
                    "cache_dtype": self.settings.dtype,
                },
                prompt_tokens=self.counters["prompt_tokens"],
                generation_tokens=self.counters["generation_tokens"],
                preemptions=self.counters["preemptions"],
                success_by_reason=dict(self.finished_by_reason),
            )
        )
        policy = {"policy": self.runner.policy.name}
        family = vllm_wire.metric_family
        lines += family(
            "tokenpools_engine_tokens_evicted_total",
            "counter",
            [
                ({**policy, "kind": "cutoff"}, stats.tokens_evicted_by_cutoff),
                ({**policy, "kind": "voluntary"}, stats.tokens_evicted_voluntarily),
            ],
        )
        lines += family("tokenpools_engine_kv_used_tokens", "gauge", [({}, pool.num_used)])
        lines += family("tokenpools_engine_kv_peak_tokens", "gauge", [({}, stats.peak_used_tokens)])
        lines += family("tokenpools_engine_kv_budget_tokens", "gauge", [({}, budget)])
        lines += family("tokenpools_engine_policy_seconds_total", "counter", [({}, stats.policy_seconds_total)])
        lines += family("tokenpools_engine_token_pd_mu", "gauge", [(policy, gauges.get("token_pd_mu", 0.0))])
        lines += family(
            "tokenpools_engine_rejections_total",
            "counter",
            [({"reason": reason}, count) for reason, count in sorted(self.rejected_by_reason.items())],
        )
        snapshots = [snap for snap in tenants if snap is not None]
        for name, attribute in (
            ("tokenpools_engine_tenant_active", "active_count"),
            ("tokenpools_engine_tenant_allocated_blocks", "allocated_blocks"),
            ("tokenpools_engine_tenant_pending", "pending_count"),
        ):
            lines += family(name, "gauge", [({"tenant": s.tenant_id}, getattr(s, attribute)) for s in snapshots])
        return vllm_wire.exposition(lines)
