"""Token-level KV eviction policies over the shared pool: Token-PD (seed 001), baselines and ablations.

Every policy keeps its statistics in flat per-slot tensors (the pool's slot index is the token's id), so
one step's work is a handful of vectorised operations over the whole batch, not a loop over sequences.

The engine drives a policy in this order each step:
1. `make_room(view, need)` before the forward when the incoming tokens would not fit the budget `M`:
   the exact global cut-off, evicting the `need` lowest-scored unprotected tokens (the hard guarantee);
2. `on_insert` for the new tokens and `observe` with the attention mass each cached token received
   (dense over the pool's slots, with a mask of the slots whose sequence took part in the step);
3. `voluntary_evictions(view)`: what the policy drops on its own (Token-PD's priced-out tokens, H2O's
   per-sequence budget);
4. `end_step(view, demand_tokens)`: Token-PD's multiplicative update of the dual price `mu`.
Before `observe`, `on_logits` gives a policy the next-token logits of each decoded sequence's newest token:
Token-PD (`token-pd`, the seed's policy) forecasts that token's return from them with its MLP.
Sinks and recent tokens are protected by the engine for every policy alike (`view.protected`).

A policy keeps its tensors on the device `bind` names (the pool's). On the CPU the per-step index work
goes through NumPy views of the same memory (`host_paths`); on any other device the same updates are
torch operations on that device, dense over the pool where a GPU makes a pass cheaper than an index set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from backends.engine.return_predictor import ReturnPredictor


@dataclass
class PoolView:
    """What a policy may read about the pool at one step (tensors indexed by slot, on the pool's device)."""

    live: torch.Tensor  # bool
    protected: torch.Tensor  # bool, live tokens no policy may evict (sinks and recent window)
    owner: torch.Tensor  # long, the sequence row holding the slot, -1 when free
    position: torch.Tensor  # long, the token's original position in its sequence
    birth: torch.Tensor  # long, global arrival order
    # long, tokens seen by the slot's sequence; None when `seen_by_row` is given instead (then it is
    # gathered on first use by `seen_of_owner()`: only H2O reads it, and the gather is a pass over the pool)
    owner_seen: torch.Tensor | None
    num_rows: int  # size of the sequence-row table (owner values are < num_rows)
    running_rows: torch.Tensor  # long, rows of the sequences currently holding a cache
    budget_tokens: int
    step: int
    # Tokens cached per sequence row, when the caller already knows them (saves a pass over the pool).
    row_cached: torch.Tensor | None = None
    seen_by_row: torch.Tensor | None = None  # long, tokens seen per sequence row

    @property
    def evictable(self) -> torch.Tensor:
        return self.live & ~self.protected

    @property
    def used_tokens(self) -> int:
        return int(torch.sum(self.live, dtype=torch.int32))

    def seen_of_owner(self) -> torch.Tensor:
        """`owner_seen`, gathered from `seen_by_row` the first time it is asked for."""
        if self.owner_seen is None:
            if self.seen_by_row is None:
                raise ValueError("a PoolView needs owner_seen or seen_by_row")
            self.owner_seen = self.seen_by_row[self.owner.clamp(min=0)]
        return self.owner_seen


def sparse_nonzero(mask: torch.Tensor) -> torch.Tensor:
    """`mask.nonzero().squeeze(1)` for a flat bool mask: the same ascending slot indices.

    On the CPU this goes through NumPy (a view of the same memory, no copy): its `flatnonzero` scans a
    pool-sized mask several times faster than torch's `nonzero`, which dominated the per-step cost of
    finding the few slots a step evicts.
    """
    if mask.device.type != "cpu" or not mask.is_contiguous():
        return mask.nonzero().squeeze(1)
    return torch.from_numpy(np.flatnonzero(mask.numpy()))


def same_flags(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`torch.equal` for two flat bool masks of one size, compared eight bytes at a time when possible
    (torch compares bool tensors byte by byte, several times slower than a word-wise compare)."""
    if a.numel() % 8 == 0 and a.is_contiguous() and b.is_contiguous():
        return torch.equal(a.view(torch.int64), b.view(torch.int64))
    return torch.equal(a, b)


class ProtectedTokens:
    """The engine's protected tokens (every sequence's first `sinks` and last `recent` positions), kept
    incrementally instead of being rebuilt from the whole pool each step.

    `mask[s]` is always `live[s] & (position[s] < sinks | position[s] >= seen[owner[s]] - recent)`.
    A sequence's recent window is remembered per row in a ring (`window[row, position % recent]` = the
    slot), so a step costs O(new tokens), not passes over the pool.
    Callers report every change: `admit` after new tokens took slots (with the rows' seen counts after
    the step), `forget` for evicted slots, `release_row` when a sequence leaves the pool.
    """

    def __init__(
        self,
        owner: torch.Tensor,
        position: torch.Tensor,
        live: torch.Tensor,
        sinks: int,
        recent: int,
        num_rows: int = 64,
        host_paths: bool | None = None,
    ) -> None:
        self.owner = owner  # the pool's own tensors, read (never written) here
        self.position = position
        self.live = live
        self.sinks = sinks
        self.recent = recent
        self.mask = torch.zeros(owner.numel(), dtype=torch.bool, device=owner.device)
        # A step touches only a few hundred slots, so the per-operation cost dominates; NumPy views of the
        # same memory cost a fraction of torch's per-call overhead for such small gathers and scatters.
        # Off the CPU the same steps are torch operations on the pool's device (`_admit_on_device`);
        # `host_paths=False` takes those on a CPU pool too (tests compare the two).
        self.host_paths = owner.device.type == "cpu" if host_paths is None else host_paths
        if not self.host_paths:
            self.device_window = torch.full(
                (num_rows, max(1, recent)), -1, dtype=torch.long, device=owner.device
            )
            return
        self._owner, self._position, self._live = owner.numpy(), position.numpy(), live.numpy()
        self._mask = self.mask.numpy()
        self.window = np.full((num_rows, max(1, recent)), -1, dtype=np.int64)

    def _ensure_rows(self, num_rows: int) -> None:
        if not self.host_paths:
            if self.device_window.shape[0] < num_rows:
                wider = self.device_window.new_full(
                    (max(num_rows, 2 * self.device_window.shape[0]), self.device_window.shape[1]), -1
                )
                wider[: self.device_window.shape[0]] = self.device_window
                self.device_window = wider
            return
        if self.window.shape[0] < num_rows:
            grown = np.full((max(num_rows, 2 * self.window.shape[0]), self.window.shape[1]), -1, np.int64)
            grown[: self.window.shape[0]] = self.window
            self.window = grown

    def admit(self, slots: torch.Tensor, seen_by_row: torch.Tensor) -> None:
        """New tokens took `slots` (owner and position already written); `seen_by_row` is after the step."""
        if slots.numel() == 0:
            return
        self._ensure_rows(seen_by_row.numel())
        if not self.host_paths:
            self._admit_on_device(slots, seen_by_row)
            return
        new = slots.numpy()
        rows = self._owner[new]
        positions = self._position[new]
        start = seen_by_row.numpy()[rows] - self.recent  # the first position of each token's recent window
        in_window = positions >= start
        self._mask[new] = (positions < self.sinks) | in_window
        if self.recent == 0:
            return
        # A row's new tokens have consecutive positions, so the window entries the newest `recent` of
        # them overwrite are exactly the tokens the window moved past: those lose their protection
        # (sinks excepted). An entry whose slot was freed or reused since is left alone.
        if not in_window.all():
            new, rows, positions, start = (
                new[in_window],
                rows[in_window],
                positions[in_window],
                start[in_window],
            )
        column = positions % self.recent
        held = self.window[rows, column]
        at = np.maximum(held, 0)
        held_position = self._position[at]
        left = (
            (held >= 0)
            & (self._owner[at] == rows)
            & self._live[at]
            & (held_position < start)
            & (held_position >= self.sinks)
        )
        self._mask[at[left]] = False
        self.window[rows, column] = new

    def _admit_on_device(self, new: torch.Tensor, seen_by_row: torch.Tensor) -> None:
        """`admit` in torch operations (the pool on a GPU): the same steps as the NumPy path."""
        rows = self.owner[new]
        positions = self.position[new]
        start = seen_by_row[rows] - self.recent
        in_window = positions >= start
        self.mask[new] = (positions < self.sinks) | in_window
        if self.recent == 0:
            return
        new, rows, positions, start = new[in_window], rows[in_window], positions[in_window], start[in_window]
        column = positions % self.recent
        held = self.device_window[rows, column]
        at = held.clamp(min=0)
        held_position = self.position[at]
        left = (
            (held >= 0)
            & (self.owner[at] == rows)
            & self.live[at]
            & (held_position < start)
            & (held_position >= self.sinks)
        )
        self.mask[at[left]] = False
        self.device_window[rows, column] = new

    def forget(self, slots: torch.Tensor) -> None:
        """These slots were freed (evicted)."""
        if slots.numel():
            if self.host_paths:
                self._mask[slots.numpy()] = False
            else:
                self.mask[slots] = False

    def release_row(self, row: int, slots: torch.Tensor) -> None:
        """The sequence in `row` left the pool, giving back `slots`."""
        self.forget(slots)
        window = self.window if self.host_paths else self.device_window
        if row < window.shape[0]:
            window[row] = -1

    def from_scratch(self, seen_by_row: torch.Tensor) -> torch.Tensor:
        """The same mask computed over the whole pool (what `admit` keeps incrementally; for tests)."""
        owner_seen = seen_by_row[self.owner.clamp(min=0)]
        return self.live & ((self.position < self.sinks) | (self.position >= owner_seen - self.recent))


_PATCH_MIN_SLOTS = 16384  # below this many slots a masked fill costs less than the patch by index


def lowest_scored(score: torch.Tensor, candidates: torch.Tensor, count: int) -> torch.Tensor:
    """Slots of the `count` lowest scores among `candidates` (all of them if there are fewer)."""
    if count <= 0:
        return torch.zeros(0, dtype=torch.long, device=score.device)
    available = int(torch.sum(candidates, dtype=torch.int32))  # int32: twice as fast as bool -> int64
    if count >= available:
        return sparse_nonzero(candidates)
    # Masking and one dense top-k is about twice as fast as gathering the candidates first.
    fill = float("inf") if score.is_floating_point() else torch.iinfo(score.dtype).max
    excluded = torch.logical_not(candidates)
    if (
        score.numel() >= _PATCH_MIN_SLOTS
        and (score.numel() - available) * 16 <= score.numel()
        and score.device.type == "cpu"
    ):
        # Few slots excluded (a full pool: only the protected ones): copy and patch them by index,
        # cheaper than the byte-by-byte masked fill. The same masked scores either way.
        masked = score.clone()
        masked[sparse_nonzero(excluded)] = fill
    else:
        masked = score.masked_fill(excluded, fill)
    _, chosen = torch.topk(masked, count, largest=False, sorted=False)
    return chosen


def lowest_scored_per_owner(
    score: torch.Tensor, candidates: torch.Tensor, owner: torch.Tensor, excess: torch.Tensor
) -> torch.Tensor:
    """For each owner row r, the `excess[r]` lowest-scored candidate slots it holds."""
    if excess.numel() and int(excess.max()) == 1:
        return _lowest_scored_one_per_owner(score, candidates, owner, excess)
    index = candidates.nonzero().squeeze(1)
    if index.numel() == 0:
        return index
    index = index[torch.argsort(score[index], stable=True)]
    index = index[torch.argsort(owner[index], stable=True)]
    owners = owner[index]
    counts = torch.bincount(owners, minlength=excess.numel())
    starts = counts.cumsum(0) - counts
    rank = torch.arange(index.numel(), device=index.device) - starts[owners]
    return index[rank < excess[owners]]


def _lowest_scored_one_per_owner(
    score: torch.Tensor, candidates: torch.Tensor, owner: torch.Tensor, excess: torch.Tensor
) -> torch.Tensor:
    """The common decode case (each sequence one token over): per-owner minimum by scatter, no sort."""
    rows = excess.numel()
    owners = owner.clamp(min=0)
    wanted = candidates & (excess[owners] > 0)
    masked = score.double().masked_fill(~wanted, float("inf"))
    lowest = torch.full((rows,), float("inf"), dtype=torch.float64, device=score.device).scatter_reduce_(
        0, owners, masked, "amin"
    )
    at_minimum = wanted & (masked == lowest[owners])
    # Ties keep only the first slot per owner, so each owner gives up exactly one token.
    slots = torch.arange(score.numel(), device=score.device)
    sentinel = score.numel()
    first = torch.full((rows,), sentinel, dtype=torch.long, device=score.device).scatter_reduce_(
        0, owners, torch.where(at_minimum, slots, sentinel), "amin"
    )
    return first[first < sentinel]


class EvictionPolicy:
    """No eviction: the pool fills and sequences are preempted (what vLLM does)."""

    name = "none"
    evicts = False

    def bind(
        self,
        num_slots: int,
        bytes_per_token: int,
        budget_tokens: int,
        max_batch_size: int,
        device: torch.device | str = "cpu",
    ) -> None:
        """Size the per-slot state for the pool and put it on the pool's `device`."""
        self.num_slots = num_slots
        self.bytes_per_token = bytes_per_token
        self.budget_tokens = budget_tokens
        self.max_batch_size = max_batch_size
        self.device = torch.device(device)
        # NumPy views of the policy's own tensors (CPU only); elsewhere the same updates in torch.
        self.host_paths = self.device.type == "cpu"
        self._allocate()

    def _allocate(self) -> None:
        """The policy's per-slot state, once `bind` has set the pool's size and device (subclasses add theirs)."""

    def _per_slot(self, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed tensor of one `dtype` value per slot, on the pool's device."""
        return torch.zeros(self.num_slots, dtype=dtype, device=self.device)

    def _no_slots(self) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.long, device=self.device)

    def on_insert(self, slots: torch.Tensor, step: int) -> None:
        """New tokens took these slots."""

    def observe(self, view: PoolView, mass: torch.Tensor, stepped: torch.Tensor) -> None:
        """`mass[s]` is the attention slot s received this step; `stepped[s]` whether its sequence ran."""

    def on_logits(self, view: PoolView, slots: torch.Tensor, logits: torch.Tensor) -> None:
        """The next-token logits each decode step produced for its newest token (`slots[i]`)."""

    def scores(self, view: PoolView) -> torch.Tensor:
        """Higher keeps; the hard cut-off evicts the lowest."""
        return view.birth

    def make_room(self, view: PoolView, need: int) -> torch.Tensor:
        if not self.evicts:
            return self._no_slots()
        return lowest_scored(self.scores(view), view.evictable, need)

    def voluntary_evictions(self, view: PoolView) -> torch.Tensor:
        return self._no_slots()

    def end_step(self, view: PoolView, demand_tokens: int) -> None:
        """Called once per step after evictions; `demand_tokens` counts what the step wanted to keep."""

    def gauges(self) -> dict[str, float]:
        return {}


class FifoPolicy(EvictionPolicy):
    """Evict the oldest unprotected token of the whole batch."""

    name = "fifo"
    evicts = True


class LruPolicy(EvictionPolicy):
    """Evict the token least recently *used*: used at a step when it got more than a uniform share."""

    name = "lru"
    evicts = True

    def _allocate(self) -> None:
        super()._allocate()
        # float32 counts steps exactly up to 2**24; the top-k over float32 is the cheapest there is.
        self.last_used = self._per_slot(torch.float32)

    def on_insert(self, slots: torch.Tensor, step: int) -> None:
        self.last_used[slots] = float(step)

    def observe(self, view: PoolView, mass: torch.Tensor, stepped: torch.Tensor) -> None:
        held = view.row_cached
        if held is None:
            held = torch.bincount(view.owner[view.live], minlength=view.num_rows)
        context_length = held[view.owner.clamp(min=0)]
        used = stepped & (mass * context_length >= 1.0)
        self.last_used.masked_fill_(used, float(view.step))

    def scores(self, view: PoolView) -> torch.Tensor:
        return self.last_used  # ties (tokens last used at the same step) go in no particular order


class H2OPolicy(EvictionPolicy):
    """Heavy-Hitter Oracle: per sequence, keep `k` tokens: the k/2 most recent and the k/2 heaviest."""

    name = "h2o"
    evicts = True

    def __init__(self, per_sequence_budget: int | None = None) -> None:
        self.per_sequence_budget = per_sequence_budget

    def _allocate(self) -> None:
        super()._allocate()
        self.accumulated = self._per_slot(torch.float32)
        # The paper fixes k per sequence; the default splits M evenly over a full batch.
        self.k = self.per_sequence_budget or max(2, self.budget_tokens // max(1, self.max_batch_size))

    def on_insert(self, slots: torch.Tensor, step: int) -> None:
        self.accumulated[slots] = 0.0

    def observe(self, view: PoolView, mass: torch.Tensor, stepped: torch.Tensor) -> None:
        self.accumulated += mass  # zero for slots outside the step

    def scores(self, view: PoolView) -> torch.Tensor:
        recent = view.position >= view.seen_of_owner() - self.k // 2
        return self.accumulated + recent.float() * 1e6

    def voluntary_evictions(self, view: PoolView) -> torch.Tensor:
        owners = view.owner.clamp(min=0)
        held = torch.bincount(owners[view.live], minlength=view.num_rows)
        excess = (held - self.k).clamp(min=0)
        if int(excess.sum()) == 0:
            return self._no_slots()
        recent = view.position >= view.seen_of_owner() - self.k // 2
        # Only the sequences over their budget take part in the per-sequence sort.
        candidates = view.evictable & ~recent & (excess[owners] > 0)
        return lowest_scored_per_owner(self.accumulated, candidates, owners, excess)

    def gauges(self) -> dict[str, float]:
        return {"h2o_per_sequence_budget": float(self.k)}


@dataclass(frozen=True)
class TokenPDParams:
    ewma_alpha: float = 0.3  # weight of the newest attention observation in R
    risk_aversion: float = 0.1  # lambda
    learning_rate: float = 4.0  # eta of the multiplicative price update, at the start of a busy period
    # eta_t = eta * sqrt(H / max(H, t)) in the t-th step of a busy period (seed 001: eta proportional to
    # 1/sqrt(T)); an engine does not know its horizon T, so the anytime form decays with the steps run so far
    # and restarts when the batch empties. None: a constant eta (the `token-pd-fixed-step` ablation).
    learning_rate_horizon: int | None = 64
    initial_price_per_token: float = 1e-3  # mu * c at start, in units of attention mass
    min_price_per_token: float = 1e-9
    max_price_per_token: float = 10.0


class TokenPDPolicy(EvictionPolicy):
    """Token-PD with observed returns only (the `token-pd-ewma` ablation; the base of the seed's policy,
    `TokenPDPredictorPolicy`): excess value g = R - lambda*sigma^2 - mu*c against one batch-global dual
    price mu.

    `R` is an exponential average of the attention mass a token receives (already averaged over the
    layers and the heads, GQA groups included); `sigma^2` the exponential variance of the same signal;
    `c` the bytes of one token's keys and values in every layer. Tokens with g < 0 are evicted; `mu`
    rises multiplicatively while the tokens the batch wants exceed M and falls when they do not, with a
    step size that shrinks as 1/sqrt(t) over a busy period. The engine's `make_room` cut-off enforces M
    exactly in the steps before the price has caught up.
    """

    name = "token-pd-ewma"
    evicts = True
    use_price = True

    def __init__(self, params: TokenPDParams | None = None) -> None:
        self.params = params or TokenPDParams()

    def _allocate(self) -> None:
        super()._allocate()
        self.ret = self._per_slot(torch.float32)
        self.ret_sq = self._per_slot(torch.float32)
        self.observed = self._per_slot(torch.bool)
        self.mu = self.params.initial_price_per_token / self.bytes_per_token
        self.busy_steps = 0  # steps since the batch last emptied: the t of the step size
        self.priced_out_total = 0
        self._value = self._per_slot(torch.float32)
        self._mask = self._per_slot(torch.bool)
        if not self.host_paths:
            return
        self._priced_out = np.zeros(self.num_slots, dtype=np.bool_)
        # Every slot not yet observed since its token arrived is in here (duplicates allowed): the fresh
        # tokens of a step are found among these instead of by a pass over the pool. The per-step index
        # work is on a few hundred slots, where NumPy's per-call cost is a fraction of torch's.
        self._unobserved = np.arange(self.num_slots, dtype=np.int64)
        self._ret_np, self._ret_sq_np, self._observed_np = (
            self.ret.numpy(),
            self.ret_sq.numpy(),
            self.observed.numpy(),
        )

    def on_insert(self, slots: torch.Tensor, step: int) -> None:
        if not self.host_paths:
            self.ret[slots] = 0.0
            self.ret_sq[slots] = 0.0
            self.observed[slots] = False
            return
        new = slots.numpy()
        self._ret_np[new] = 0.0
        self._ret_sq_np[new] = 0.0
        self._observed_np[new] = False
        self._unobserved = np.concatenate([self._unobserved, new])

    def observe(self, view: PoolView, mass: torch.Tensor, stepped: torch.Tensor) -> None:
        if not self.host_paths:
            self._observe_dense(view, mass, stepped)
            return
        alpha = self.params.ewma_alpha
        ret, ret_sq, observed = self._ret_np, self._ret_sq_np, self._observed_np
        # Dense in-place updates over the whole pool (a few passes, no gathers); the rare slots that must
        # not move are patched by index afterwards: tokens of a live sequence that sat this step out keep
        # their averages, and a token's first observation seeds them (no zero prior to price it on).
        # Both index sets are usually tiny: in a decode step every live sequence steps (a word-wise
        # compare), and the fresh tokens are the step's new ones, found among the unobserved slots.
        if same_flags(view.live, stepped):
            sat_out = self._unobserved[:0]
        else:
            sat_out = sparse_nonzero(torch.gt(view.live, stepped, out=self._mask)).numpy()  # live & ~stepped
        kept_ret, kept_sq = ret[sat_out], ret_sq[sat_out]
        self.ret.lerp_(mass, alpha)  # (1 - alpha) * R + alpha * m in one pass
        self.ret_sq.mul_(1 - alpha).addcmul_(mass, mass, value=alpha)
        if sat_out.size:
            ret[sat_out], ret_sq[sat_out] = kept_ret, kept_sq
        pending = self._unobserved
        stepped_np, live_np, mass_np = stepped.numpy(), view.live.numpy(), mass.numpy()
        fresh = pending[stepped_np[pending] & ~observed[pending]]  # stepped & ~observed, by index
        if fresh.size:
            seed = mass_np[fresh]
            ret[fresh] = seed
            ret_sq[fresh] = seed * seed
            observed[fresh] = True  # observed |= stepped: stepped slots were observed or are fresh
        # Still pending: live tokens that sat this step out (a freed slot re-enters through on_insert).
        self._unobserved = pending[~observed[pending] & live_np[pending]]
        # R - lambda*sigma^2 with sigma^2 = E[m^2] - R^2, in two fused passes.
        lam = self.params.risk_aversion
        # Written into a preallocated buffer: a fresh pool-sized tensor per step costs page faults.
        torch.addcmul(self.ret, self.ret, self.ret, value=lam, out=self._value).sub_(self.ret_sq, alpha=lam)

    def _observe_dense(self, view: PoolView, mass: torch.Tensor, stepped: torch.Tensor) -> None:
        """`observe` as passes over the whole pool (a GPU): no index sets, so no host round trip.

        The same averages as the host path: a token of a live sequence that sat the step out keeps its
        averages, a token's first observation seeds them, every other slot moves by the exponential average.
        """
        alpha, lam = self.params.ewma_alpha, self.params.risk_aversion
        sat_out = torch.gt(view.live, stepped, out=self._mask)  # live & ~stepped
        fresh = stepped & ~self.observed
        moved = torch.where(fresh, mass, torch.lerp(self.ret, mass, alpha))
        moved_sq = torch.where(fresh, mass * mass, torch.addcmul(self.ret_sq * (1 - alpha), mass, mass, value=alpha))
        self.ret.copy_(torch.where(sat_out, self.ret, moved))
        self.ret_sq.copy_(torch.where(sat_out, self.ret_sq, moved_sq))
        self.observed |= stepped
        torch.addcmul(self.ret, self.ret, self.ret, value=lam, out=self._value).sub_(self.ret_sq, alpha=lam)

    def risk(self) -> torch.Tensor:
        return (self.ret_sq - self.ret * self.ret).clamp(min=0.0)

    def value(self) -> torch.Tensor:
        """R - lambda * sigma^2, before the price (computed once per step, when attention is observed)."""
        return self._value

    def price_per_token(self, view: PoolView) -> torch.Tensor | float:
        return self.mu * self.bytes_per_token

    def scores(self, view: PoolView) -> torch.Tensor:
        # The price is the same for every token under one global mu, so it cannot change the order.
        return self.value()

    def voluntary_evictions(self, view: PoolView) -> torch.Tensor:
        if not self.use_price:
            return self._no_slots()
        price = self.price_per_token(view)
        if not self.host_paths:
            priced_out = (self._value < price) & self.observed & view.live & ~view.protected
            victims = priced_out.nonzero().squeeze(1)
            self.priced_out_total += int(victims.numel())
            return victims
        threshold = price.numpy() if isinstance(price, torch.Tensor) else price
        # g = R - lambda*sigma^2 - mu*c < 0, over observed, live, unprotected slots. In NumPy: its
        # comparisons and logical ands write a bool mask of the pool several times faster than torch's.
        priced_out = np.less(self._value.numpy(), threshold, out=self._priced_out)
        np.logical_and(priced_out, self._observed_np, out=priced_out)
        np.logical_and(priced_out, view.live.numpy(), out=priced_out)
        np.greater(priced_out, view.protected.numpy(), out=priced_out)  # and not protected
        victims = torch.from_numpy(np.flatnonzero(priced_out))
        self.priced_out_total += int(victims.numel())
        return victims

    def step_size(self) -> float:
        """eta_t: the configured eta for the first `learning_rate_horizon` steps, then eta * sqrt(H / t)."""
        horizon = self.params.learning_rate_horizon
        if horizon is None:
            return self.params.learning_rate
        return self.params.learning_rate * math.sqrt(horizon / max(horizon, self.busy_steps))

    def _count_busy_step(self, view: PoolView) -> bool:
        """Advance t of the step size; an empty batch ends the busy period (False)."""
        self.busy_steps = self.busy_steps + 1 if view.running_rows.numel() else 0
        return self.busy_steps > 0

    def end_step(self, view: PoolView, demand_tokens: int) -> None:
        if not self.use_price:
            return
        self._count_busy_step(view)
        c = self.bytes_per_token
        budget_bytes = self.budget_tokens * c
        violation = (demand_tokens * c - budget_bytes) / budget_bytes
        self.mu = self._clamp(self.mu * math.exp(self.step_size() * violation))

    def _clamp(self, mu: float) -> float:
        c = self.bytes_per_token
        return min(max(mu, self.params.min_price_per_token / c), self.params.max_price_per_token / c)

    def gauges(self) -> dict[str, float]:
        return {
            "token_pd_mu": float(self.mu),
            "token_pd_price_per_token": float(self.mu * self.bytes_per_token),
            "token_pd_step_size": self.step_size(),
        }


class TokenPDPredictorPolicy(TokenPDPolicy):
    """Token-PD as seed 001 defines it (`token-pd`, the engine's default): the return of a token is
    forecast from its step's next-token logits by a one-hidden-layer MLP trained online, self-supervised.

    The forecast matters most for young tokens (one noisy observation); its weight falls as the token
    collects observations of the attention it really gets: R_hat = w * f(z) + (1 - w) * EWMA with
    w = 1 / (1 + observations). (The seed prices on f(z) alone; the blend is a deviation listed in the
    engine's README.)
    """

    name = "token-pd"

    def __init__(self, params: TokenPDParams | None = None, predictor: ReturnPredictor | None = None) -> None:
        super().__init__(params)
        self.predictor = predictor

    def _allocate(self) -> None:
        super()._allocate()
        self.forecast = self._per_slot(torch.float32)
        self.has_forecast = self._per_slot(torch.bool)
        self.observations = self._per_slot(torch.float32)

    def on_insert(self, slots: torch.Tensor, step: int) -> None:
        super().on_insert(slots, step)
        self.has_forecast[slots] = False
        self.observations[slots] = 0.0

    def on_logits(self, view: PoolView, slots: torch.Tensor, logits: torch.Tensor) -> None:
        if self.predictor is None:
            self.predictor = ReturnPredictor(logits.shape[-1], device=self.device)
        self.forecast[slots] = self.predictor.forecast(slots, view.birth[slots], logits, view.step)
        self.has_forecast[slots] = True

    def observe(self, view: PoolView, mass: torch.Tensor, stepped: torch.Tensor) -> None:
        super().observe(view, mass, stepped)
        self.observations += stepped.float()
        weight = torch.where(self.has_forecast, 1.0 / (1.0 + self.observations), 0.0)
        self._value.mul_(1 - weight).add_(weight * self.forecast)
        if self.predictor is not None:
            self.predictor.train_step(self.ret, view.live, view.birth, view.step)

    def gauges(self) -> dict[str, float]:
        gauges = super().gauges()
        if self.predictor is not None:
            gauges["token_pd_predictor_loss"] = self.predictor.last_loss
        return gauges


class FixedStepTokenPDPolicy(TokenPDPredictorPolicy):
    """Ablation: the seed's Token-PD with a constant step size eta instead of eta proportional to 1/sqrt(t)."""

    name = "token-pd-fixed-step"

    def __init__(self, params: TokenPDParams | None = None, predictor: ReturnPredictor | None = None) -> None:
        super().__init__(params or TokenPDParams(learning_rate_horizon=None), predictor)


class GlobalTopMPolicy(TokenPDPredictorPolicy):
    """Ablation: Token-PD's value R - lambda*sigma^2, no price: only the exact cut-off at M evicts."""

    name = "global-top-m"
    use_price = False

    def price_per_token(self, view: PoolView) -> float:
        return 0.0

    def gauges(self) -> dict[str, float]:
        return {}


class PerRequestTokenPDPolicy(TokenPDPredictorPolicy):
    """Ablation: Token-PD with a price per sequence against a per-sequence budget M / running sequences."""

    name = "token-pd-per-request"

    def _allocate(self) -> None:
        super()._allocate()
        self.row_mu = torch.full((0,), self.mu, dtype=torch.float64, device=self.device)

    def _ensure_rows(self, num_rows: int) -> None:
        if self.row_mu.numel() < num_rows:
            grown = torch.full(
                (num_rows,),
                self.params.initial_price_per_token / self.bytes_per_token,
                dtype=torch.float64,
                device=self.device,
            )
            grown[: self.row_mu.numel()] = self.row_mu
            self.row_mu = grown

    def price_per_token(self, view: PoolView) -> torch.Tensor:
        self._ensure_rows(view.num_rows)
        return (self.row_mu[view.owner.clamp(min=0)] * self.bytes_per_token).float()

    def scores(self, view: PoolView) -> torch.Tensor:
        return self.value() - self.price_per_token(view)  # prices differ by sequence, so they reorder tokens

    def end_step(self, view: PoolView, demand_tokens: int) -> None:
        self._ensure_rows(view.num_rows)
        if not self._count_busy_step(view):
            return
        per_sequence_budget = max(1.0, self.budget_tokens / view.running_rows.numel())
        held = torch.bincount(view.owner[view.live], minlength=view.num_rows).double()
        violation = (held[view.running_rows] - per_sequence_budget) / per_sequence_budget
        c = self.bytes_per_token
        updated = self.row_mu[view.running_rows] * torch.exp(self.step_size() * violation)
        self.row_mu[view.running_rows] = updated.clamp(
            self.params.min_price_per_token / c, self.params.max_price_per_token / c
        )
        self.mu = float(self.row_mu[view.running_rows].mean())


POLICIES: dict[str, type[EvictionPolicy]] = {
    "none": EvictionPolicy,
    "fifo": FifoPolicy,
    "lru": LruPolicy,
    "h2o": H2OPolicy,
    "token-pd": TokenPDPredictorPolicy,
    "token-pd-ewma": TokenPDPolicy,
    "token-pd-fixed-step": FixedStepTokenPDPolicy,
    "global-top-m": GlobalTopMPolicy,
    "token-pd-per-request": PerRequestTokenPDPolicy,
}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose from {', '.join(POLICIES)}") from None
