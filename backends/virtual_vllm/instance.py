"""One inference instance: vLLM-style continuous batching with `max_num_seqs` slots and a paged KV cache.

The model, in vLLM's terms:
- A step prefills the prompts admitted for it (whole prompts, up to `max_batched_tokens`) and decodes one
  token for every other running sequence. A prefill step emits the sequence's first token (its TTFT).
- KV lives in blocks of `block_size` tokens. A prompt of P tokens takes ceil(P/bs) blocks at admission; a
  decode step that feeds a sequence's token into a full last block takes one more block.
- When the next step cannot get its blocks, the newest running sequence is preempted (recompute): its blocks
  are freed and it goes back to the head of the waiting queue, to be prefilled again with prompt + output so far.

Speed: decode steps are run in batches. Between two events (a completion, a KV shortfall, an arrival that can
be admitted) every running sequence advances one token per step, so a batch of k steps costs O(1): the step
counter moves by k, sequences know their finishing step, and block allocations follow a per-sequence phase
(`(prompt + j - 1) % bs == 0` at decode step j), counted in a `block_size`-long table. An arrival that can be
admitted cuts the batch at the end of the step in progress.

Time comes from the loop the instance is given: the simulator's event loop in virtual time
(`apps.simulator.engine.EventLoop`) or the virtual vLLM's asyncio loop in real time
(`backends.virtual_vllm.server.RealTimeLoop`). The same model runs under both clocks.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from backends.virtual_vllm.latency import LatencyModel, blocks_for


class Loop(Protocol):
    """What an instance needs of its clock: the time now, and a callback at a later time."""

    @property
    def time(self) -> float: ...

    def at(self, when: float, callback: Callable[..., Any], *args: Any) -> None: ...


class SimRequest:
    """One request attempt moving through gateway and instance; times are virtual seconds."""

    __slots__ = (
        "rid",
        "tenant",
        "slo_class",
        "prompt_tokens",
        "output_tokens",
        "arrival",
        "admitted_at",
        "dispatched_at",
        "first_token_at",
        "finished_at",
        "generated",
        "preemptions",
        "instance",
        "attempt",
        "origin",
        "priority",
        "slo_target_s",
        "outcome",
        "served_class",
        "ticket",
        # per-run bookkeeping on the instance
        "run_prompt",
        "start_step",
        "block_phase",
        "epoch",
    )

    def __init__(
        self,
        rid: int,
        tenant: str,
        prompt_tokens: int,
        output_tokens: int,
        arrival: float,
        slo_class: str = "standard",
        attempt: int = 0,
        origin: Any = None,
        slo_target_s: float | None = None,
    ) -> None:
        self.rid = rid
        self.tenant = tenant
        self.slo_class = slo_class
        self.prompt_tokens = prompt_tokens
        self.output_tokens = max(1, output_tokens)
        self.arrival = arrival
        self.admitted_at: float | None = None
        self.dispatched_at: float | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.generated = 0
        self.preemptions = 0
        self.instance = -1
        self.attempt = attempt
        self.origin = origin
        self.priority = 0.0
        self.slo_target_s = slo_target_s
        self.outcome = ""
        # The service class the gateway serves it as (the simulator's token-pools admission; "": not told).
        self.served_class = ""
        self.ticket: Any = None
        self.run_prompt = 0
        self.start_step = 0
        self.block_phase = 0
        self.epoch = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.arrival

    def __repr__(self) -> str:
        return f"SimRequest({self.rid}, {self.tenant!r}, in={self.prompt_tokens}, out={self.output_tokens})"


Callback = Callable[[SimRequest], None]


def _ignore(request: SimRequest) -> None:
    return None


class Instance:
    def __init__(
        self,
        index: int,
        loop: Loop,
        latency: LatencyModel,
        *,
        max_num_seqs: int = 256,
        kv_blocks: int = 1_000_000,
        block_size: int = 16,
        max_batched_tokens: int | None = None,
        max_batch_steps: int = 64,
        watermark: float = 0.01,
        on_first_token: Callback = _ignore,
        on_finish: Callback = _ignore,
        on_lost: Callable[[SimRequest, str], None] | None = None,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        if block_size < 1 or kv_blocks < 1:
            raise ValueError("block_size and kv_blocks must be positive")
        self.index = index
        self.loop = loop
        self.latency = latency
        self.max_num_seqs = max_num_seqs
        self.total_blocks = kv_blocks
        self.block_size = block_size
        self.max_batched_tokens = max_batched_tokens
        self.max_batch_steps = max(1, max_batch_steps)
        self.watermark_blocks = int(kv_blocks * watermark)
        self.on_first_token = on_first_token
        self.on_finish = on_finish
        self.on_lost = on_lost or (lambda request, reason: None)
        self.online = True

        self.waiting: deque[SimRequest] = deque()
        self.running: dict[int, SimRequest] = {}
        self.steps = 0
        self.used_blocks = 0
        self.phase_counts = [0] * block_size
        self.finish_heap: list[tuple[int, int, int, SimRequest]] = []
        self.context_base = 0  # sum over running of (run_prompt - start_step); context = base + B * steps

        self.busy = False
        self.version = 0
        self.batch_start = 0.0
        self.batch_steps = 0
        self.step_dt = 0.0
        self.batch_allocations = 0
        self.prefilling: list[SimRequest] = []

        self.busy_seconds = 0.0
        self.sequence_seconds = 0.0
        self.output_tokens = 0
        self.preemptions = 0
        self.dropped_unservable = 0

    # ---- what the gateway sees -------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def batch_size(self) -> int:
        return len(self.running)

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def kv_utilization(self) -> float:
        return self.used_blocks / self.total_blocks

    # ---- entry points ----------------------------------------------------------------------------
    def enqueue(self, request: SimRequest) -> None:
        request.instance = self.index
        self.waiting.append(request)
        if not self.busy:
            self._plan()
        elif self.prefilling == [] and self.batch_steps > 1 and len(self.running) < self.max_num_seqs:
            self._cut_batch()

    def go_offline(self, reason: str = "instance_removed") -> list[SimRequest]:
        """The instance fails: every request on it is lost (handed to `on_lost`) and its state is reset."""
        self.online = False
        self.version += 1
        if self.busy:
            self._refund_tail(self.batch_steps - max(0, min(self.batch_steps, self._steps_elapsed())))
        self.busy = False
        lost = [*self.running.values(), *self.waiting]
        for request in self.prefilling:
            if request.rid not in self.running:
                lost.append(request)
        self.waiting.clear()
        self.running.clear()
        self.prefilling = []
        self.finish_heap.clear()
        self.phase_counts = [0] * self.block_size
        self.used_blocks = 0
        self.context_base = 0
        for request in lost:
            request.epoch += 1
            self.on_lost(request, reason)
        return lost

    def go_online(self) -> None:
        self.online = True
        if not self.busy:
            self._plan()

    def set_max_num_seqs(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {slots}")
        self.max_num_seqs = slots
        if not self.busy:
            self._plan()

    def tokens_generated(self, request: SimRequest) -> int:
        """Output tokens the request has produced by now, counting decode steps of the batch in progress."""
        if request.finished_at is not None:
            return request.output_tokens
        if self.running.get(request.rid) is not request:
            return request.generated
        steps = self.steps
        if self.busy and not self.prefilling and self.step_dt > 0:
            steps += min(self.batch_steps, self._steps_elapsed())
        done = steps - request.start_step + 1
        return min(request.output_tokens, request.generated + max(0, done))

    def abort(self, request: SimRequest) -> bool:
        """Drop a request (its client went away): free its slot and blocks; False when it is not here."""
        if self.running.get(request.rid) is request:
            # The batch in progress already booked this sequence's blocks through its last step.
            end = self.steps + (self.batch_steps if self.busy else 0)
            if request.start_step <= self.steps:
                booked = blocks_for(request.run_prompt + end - request.start_step, self.block_size)
                at_start = blocks_for(request.run_prompt + self.steps - request.start_step, self.block_size)
                self.batch_allocations -= booked - at_start
            self._release(request, end)
        elif request in self.waiting:
            self.waiting.remove(request)
        else:
            return False
        request.epoch += 1
        if not self.busy:
            self._plan()
        return True

    # ---- the batch loop --------------------------------------------------------------------------
    def _allocations(self, first_step: int, count: int) -> int:
        """Blocks the running decode sequences take over steps first_step .. first_step + count - 1."""
        bs = self.block_size
        counts = self.phase_counts
        full, rest = divmod(count, bs)
        total = full * len(self.running) if full else 0
        if rest:
            # counts[(first_step + offset) % bs] for offset < rest: one slice, or two where it wraps around.
            start = first_step % bs
            end = start + rest
            total += sum(counts[start:end]) if end <= bs else sum(counts[start:]) + sum(counts[:end - bs])
        return total

    def _plan(self) -> None:
        if not self.online:
            self.busy = False
            return
        bs = self.block_size
        steps = self.steps
        running = self.running
        counts = self.phase_counts
        # The next step must get its decode blocks; preempt the newest sequences until it does.
        while running and self.used_blocks + counts[(steps + 1) % bs] > self.total_blocks:
            self._preempt_newest()
        decode_need = counts[(steps + 1) % bs] if running else 0

        admitted: list[SimRequest] = []
        prefill_tokens = 0
        prefill_square = 0
        waiting = self.waiting
        if waiting and len(running) < self.max_num_seqs:
            limit = self.total_blocks - self.watermark_blocks
            budget = None if self.max_batched_tokens is None else self.max_batched_tokens - len(running)
            while waiting and len(running) + len(admitted) < self.max_num_seqs:
                request = waiting[0]
                prompt = request.prompt_tokens + request.generated
                need = -(-prompt // bs) if prompt > 0 else 0  # blocks_for(prompt, bs)
                if need > limit:
                    waiting.popleft()
                    self.dropped_unservable += 1
                    request.epoch += 1
                    self.on_lost(request, "unservable")
                    continue
                if self.used_blocks + decode_need + need > limit:
                    break
                if admitted and budget is not None and prefill_tokens + prompt > budget:
                    break
                waiting.popleft()
                self.used_blocks += need
                admitted.append(request)
                prefill_tokens += prompt
                prefill_square += prompt * prompt

        decoding = len(running)
        if admitted:
            context = self.context_base + decoding * steps
            dt = self.latency.step_time(prefill_tokens, prefill_square, decoding, context)
            self.used_blocks += decode_need
            first = steps + 1
            heap = self.finish_heap
            context_base = self.context_base
            for request in admitted:
                generated = request.generated
                prompt = request.prompt_tokens + generated
                request.run_prompt = prompt
                request.start_step = first
                phase = (first + 1 - prompt) % bs
                request.block_phase = phase
                counts[phase] += 1
                context_base += prompt - first
                running[request.rid] = request
                heapq.heappush(heap, (first + request.output_tokens - generated - 1, request.rid, request.epoch, request))
            self.context_base = context_base
            self.prefilling = admitted
            count = 1
            allocations = decode_need
        elif running:
            heap = self.finish_heap
            while heap[0][2] != heap[0][3].epoch:
                heapq.heappop(heap)
            count = min(heap[0][0] - steps, self.max_batch_steps)
            free = self.total_blocks - self.used_blocks
            allocations = self._allocations(steps + 1, count)
            if allocations > free:
                # KV is tight: stop the batch at the last step whose blocks all fit.
                allocations = 0
                fits = 0
                for offset in range(1, count + 1):
                    extra = counts[(steps + offset) % bs]
                    if allocations + extra > free:
                        break
                    allocations += extra
                    fits = offset
                count = fits
            self.used_blocks += allocations
            mean_context = self.context_base + decoding * (steps + (count - 1) / 2)
            dt = self.latency.step_time(0, 0, decoding, int(mean_context))
            self.prefilling = []
        else:
            self.busy = False
            self.prefilling = []
            return

        self.busy = True
        self.version += 1
        self.batch_start = self.loop.time
        self.batch_steps = count
        self.step_dt = dt
        self.batch_allocations = allocations
        self.busy_seconds += count * dt
        self.sequence_seconds += len(running) * count * dt
        self.loop.at(self.batch_start + count * dt, self._end_batch, self.version)

    def next_step_end(self) -> float | None:
        """When the step in progress ends (the next instant a sequence can have a new token); None when idle."""
        if not self.busy or self.step_dt <= 0:
            return None
        return self.batch_start + min(self.batch_steps, self._steps_elapsed() + 1) * self.step_dt

    def _steps_elapsed(self) -> int:
        if self.step_dt <= 0:
            return self.batch_steps
        return int((self.loop.time - self.batch_start) / self.step_dt)

    def _refund_tail(self, cancelled_steps: int) -> None:
        """Give back the time and blocks accounted for steps of the current batch that will not run."""
        if cancelled_steps <= 0:
            return
        kept = self.batch_steps - cancelled_steps
        if not self.prefilling:
            kept_allocations = self._allocations(self.steps + 1, kept)
            self.used_blocks -= self.batch_allocations - kept_allocations
            self.batch_allocations = kept_allocations
        self.busy_seconds -= cancelled_steps * self.step_dt
        self.sequence_seconds -= len(self.running) * cancelled_steps * self.step_dt
        self.batch_steps = kept

    def _cut_batch(self) -> None:
        kept = self._steps_elapsed() + 1
        if kept >= self.batch_steps:
            return
        self._refund_tail(self.batch_steps - kept)
        self.version += 1
        self.loop.at(self.batch_start + kept * self.step_dt, self._end_batch, self.version)

    def _end_batch(self, version: int) -> None:
        if version != self.version:
            return
        self.steps += self.batch_steps
        steps = self.steps
        now = self.loop.time
        for request in self.prefilling:
            if request.first_token_at is None and request.rid in self.running:
                request.first_token_at = now
                self.on_first_token(request)
        self.prefilling = []
        heap = self.finish_heap
        while heap and heap[0][0] <= steps:
            _, _, epoch, request = heapq.heappop(heap)
            if epoch != request.epoch:
                continue
            self._release(request, steps)
            request.generated = request.output_tokens
            request.finished_at = now
            request.epoch += 1
            self.output_tokens += request.output_tokens
            self.on_finish(request)
        self._plan()

    def _release(self, request: SimRequest, steps: int) -> None:
        del self.running[request.rid]
        self.phase_counts[request.block_phase] -= 1
        self.context_base -= request.run_prompt - request.start_step
        self.used_blocks -= blocks_for(request.run_prompt + steps - request.start_step, self.block_size)

    def _preempt_newest(self) -> None:
        request = self.running[next(reversed(self.running))]
        steps = self.steps
        self._release(request, steps)
        request.generated += steps - request.start_step + 1
        request.epoch += 1
        request.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)
