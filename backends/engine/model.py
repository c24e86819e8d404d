"""A Llama forward pass over one shared KV pool, returning the attention each cached token received.

Why our own attention: token-level eviction needs (a) the attention weights, which fused paged kernels
never return, and (b) a cache where any single token can be dropped. Here every layer stores keys and
values in `num_slots` slots; a token owns the same slot index in every layer; a sequence is an ordered
list of slots, so dropping a token is removing its slot from the list and returning it to the free list.

Keys are stored *after* RoPE at the token's original position, and a new token's position is the number
of tokens the sequence has seen (not the cache length), so positions stay right after evictions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    tie_word_embeddings: bool = False

    @classmethod
    def from_folder(cls, folder: Path) -> LlamaConfig:
        raw = json.loads((Path(folder) / "config.json").read_text())
        if raw.get("rope_scaling"):
            raise ValueError("rope_scaling is not supported by this engine")
        eos = raw.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads", raw["num_attention_heads"]),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
            rope_theta=raw.get("rope_theta", 10000.0),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos,
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """The seed's cost c: keys and values of one token in every layer, float32 (the default)."""
        return self.kv_bytes_per_token_in(torch.float32)

    def kv_bytes_per_token_in(self, dtype: torch.dtype) -> int:
        """Keys and values of one token in every layer when the cache holds `dtype`."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype.itemsize


def pick_device(requested: str | None = None) -> torch.device:
    if requested:
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KVPool:
    """Keys and values for `num_slots` tokens in every layer, plus per-slot metadata for the policies."""

    def __init__(self, config: LlamaConfig, num_slots: int, device: torch.device, dtype: torch.dtype) -> None:
        shape = (config.num_hidden_layers, num_slots, config.num_key_value_heads, config.head_dim)
        self.num_slots = num_slots
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        # Metadata lives on the CPU: policies run there and read it every step.
        self.live = torch.zeros(num_slots, dtype=torch.bool)
        self.position = torch.zeros(num_slots, dtype=torch.long)
        self.owner = torch.full((num_slots,), -1, dtype=torch.long)
        self.birth = torch.zeros(num_slots, dtype=torch.long)
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._births = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self, owner: int, positions: torch.Tensor) -> torch.Tensor:
        count = positions.numel()
        if count > len(self._free):
            raise MemoryError(f"KV pool has {len(self._free)} free slots, {count} needed")
        taken = self._free[len(self._free) - count :]
        del self._free[len(self._free) - count :]
        slots = torch.tensor(taken[::-1], dtype=torch.long)
        self.live[slots] = True
        self.position[slots] = positions
        self.owner[slots] = owner
        self.birth[slots] = torch.arange(self._births, self._births + count)
        self._births += count
        return slots

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        if not bool(self.live[slots].all()):
            raise ValueError("freeing a slot that is not live")
        self.live[slots] = False
        self.owner[slots] = -1
        self._free.extend(slots.tolist())


@dataclass
class SequenceCache:
    """One sequence's view of the pool: its slots in arrival order and how many tokens it has seen."""

    row: int
    slots: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    seen: int = 0

    @property
    def cached(self) -> int:
        return int(self.slots.numel())


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [batch, vocab], for the last new token of each sequence
    # Per sequence: attention mass its cached tokens received this step (mean over layers, heads and new
    # queries), aligned with `sequence.slots` after the step.
    attention: list[torch.Tensor]
    # The same mass scattered by slot over the whole pool (0 for slots not in the step), the slots that
    # took part in the step, and the slots the new tokens took: what the eviction policies read.
    slot_mass: torch.Tensor
    slot_stepped: torch.Tensor
    new_slots: torch.Tensor


@dataclass(frozen=True)
class _AttentionGroup:
    """Sequences of one step whose attention is computed together, padded to their longest query run
    and key list; `token_index` places each real query row back in the step's flat token order."""

    rows: torch.Tensor  # the sequences' indices in the batch
    max_queries: int
    max_keys: int
    query_index: torch.Tensor  # [G, Q] flat token index of each query row (0 for padding)
    query_valid: torch.Tensor  # [G, Q]
    key_slots: torch.Tensor  # [G, L] pool slot of each key (0 for padding)
    allowed: torch.Tensor  # [G, 1, Q, L]
    token_index: torch.Tensor  # [real queries] flat token index, in `query_valid` order

    @classmethod
    def of(
        cls,
        rows: list[int],
        counts: list[int],
        cached: list[int],
        offsets: torch.Tensor,
        key_slots: torch.Tensor,
        key_lengths: torch.Tensor,
        device: torch.device,
    ) -> _AttentionGroup:
        index = torch.tensor(rows, dtype=torch.long)
        group_counts = torch.tensor([counts[b] for b in rows], dtype=torch.long)
        max_queries = max(counts[b] for b in rows)
        lengths = key_lengths[index]
        max_keys = int(lengths.max())
        query_range = torch.arange(max_queries)
        key_range = torch.arange(max_keys)
        query_valid = query_range[None, :] < group_counts[:, None]  # [G, Q]
        query_index = torch.where(query_valid, offsets[index][:, None] + query_range[None, :], 0)
        group_cached = torch.tensor([cached[b] for b in rows], dtype=torch.long)
        # Query i of sequence b sits at list index cached_b + i: it sees every key up to itself.
        allowed = (key_range[None, None, :] <= (group_cached[:, None, None] + query_range[None, :, None])) & (
            key_range[None, None, :] < lengths[:, None, None]
        )
        allowed &= query_valid[:, :, None]
        # Padded query rows attend to key 0 so softmax stays finite; their outputs are thrown away.
        allowed[:, :, 0] |= ~query_valid
        return cls(
            rows=index.to(device),
            max_queries=max_queries,
            max_keys=max_keys,
            query_index=query_index.to(device),
            query_valid=query_valid.to(device),
            key_slots=key_slots[index, :max_keys].to(device),
            allowed=allowed[:, None, :, :].to(device),
            token_index=query_index[query_valid].to(device),
        )


class LlamaModel:
    def __init__(
        self,
        folder: str | Path,
        num_slots: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        from safetensors.torch import load_file

        self.folder = Path(folder)
        self.config = LlamaConfig.from_folder(self.folder)
        self.device = pick_device(str(device) if device is not None else None)
        self.dtype = dtype
        tensors: dict[str, torch.Tensor] = {}
        for file in sorted(self.folder.glob("*.safetensors")):
            tensors.update(load_file(str(file)))
        self.weights = {name: t.to(self.device, dtype) for name, t in tensors.items()}
        if "lm_head.weight" not in self.weights:
            self.weights["lm_head.weight"] = self.weights["model.embed_tokens.weight"]
        cfg = self.config
        self.pool = KVPool(cfg, num_slots, self.device, dtype)
        half = cfg.head_dim // 2
        self.inv_freq = 1.0 / (
            cfg.rope_theta
            ** (torch.arange(0, half, dtype=torch.float64, device=self.device) * 2 / cfg.head_dim)
        )

    # ---- building blocks ---------------------------------------------------------------------------
    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(variance + self.config.rms_norm_eps) * weight

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(self.device, torch.float64)[:, None] * self.inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(self.dtype)[:, None, :], angles.sin().to(self.dtype)[:, None, :]

    @staticmethod
    def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    # ---- the forward -------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, sequences: list[SequenceCache], new_tokens: list[list[int]]) -> ForwardOutput:
        """Append `new_tokens[b]` to `sequences[b]` (allocating slots) and run one batched step."""
        cfg = self.config
        pool = self.pool
        device = self.device
        batch = len(sequences)
        counts = [len(tokens) for tokens in new_tokens]
        if batch == 0 or min(counts) == 0:
            raise ValueError("every sequence in a step needs at least one new token")
        if sum(counts) > pool.num_free:
            raise MemoryError(f"step needs {sum(counts)} slots, pool has {pool.num_free} free")

        cached = [seq.cached for seq in sequences]
        flat_positions = []
        flat_slots = []
        for seq, count in zip(sequences, counts, strict=True):
            positions = torch.arange(seq.seen, seq.seen + count, dtype=torch.long)
            slots = pool.allocate(seq.row, positions)
            seq.slots = torch.cat([seq.slots, slots])
            seq.seen += count
            flat_positions.append(positions)
            flat_slots.append(slots)
        positions = torch.cat(flat_positions)
        slot_index = torch.cat(flat_slots).to(device)
        tokens = torch.tensor([t for chunk in new_tokens for t in chunk], dtype=torch.long, device=device)

        max_keys = max(seq.cached for seq in sequences)
        offsets = torch.tensor([0, *counts[:-1]], dtype=torch.long).cumsum(0)
        counts_t = torch.tensor(counts, dtype=torch.long)
        key_range = torch.arange(max_keys)
        key_slots = torch.zeros(batch, max_keys, dtype=torch.long)
        key_lengths = torch.tensor([seq.cached for seq in sequences], dtype=torch.long)
        for b, seq in enumerate(sequences):
            key_slots[b, : seq.cached] = seq.slots
        # Attention runs padded to the longest query run and key list of a group. Decoding sequences (one
        # new token) and prefilling ones go in separate groups: padded together, a 60-token prompt chunk
        # would make every decode row of the step pay for 60 query rows.
        shapes = [
            _AttentionGroup.of(rows, counts, cached, offsets, key_slots, key_lengths, device)
            for rows in (
                [b for b, count in enumerate(counts) if count == 1],
                [b for b, count in enumerate(counts) if count > 1],
            )
            if rows
        ]

        cos, sin = self._rope(positions)
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        scale = cfg.head_dim**-0.5
        attention_sum = torch.zeros(batch, max_keys, device=device, dtype=torch.float32)
        hidden = self.weights["model.embed_tokens.weight"][tokens]
        w = self.weights
        kv_heads = cfg.num_key_value_heads
        for layer in range(cfg.num_hidden_layers):
            prefix = f"model.layers.{layer}"
            h = self._rms_norm(hidden, w[f"{prefix}.input_layernorm.weight"])
            q = (h @ w[f"{prefix}.self_attn.q_proj.weight"].T).view(-1, cfg.num_attention_heads, cfg.head_dim)
            k = (h @ w[f"{prefix}.self_attn.k_proj.weight"].T).view(-1, cfg.num_key_value_heads, cfg.head_dim)
            v = (h @ w[f"{prefix}.self_attn.v_proj.weight"].T).view(-1, cfg.num_key_value_heads, cfg.head_dim)
            q = self._apply_rope(q, cos, sin)
            k = self._apply_rope(k, cos, sin)
            pool.keys[layer, slot_index] = k
            pool.values[layer, slot_index] = v

            attn_out = torch.empty(
                hidden.shape[0], cfg.num_attention_heads * cfg.head_dim, device=device, dtype=hidden.dtype
            )
            for shape in shapes:
                rows, queries, keys = shape.rows.numel(), shape.max_queries, shape.max_keys
                k_pad = pool.keys[layer][shape.key_slots].permute(0, 2, 1, 3)  # [B, KVH, L, D]
                v_pad = pool.values[layer][shape.key_slots].permute(0, 2, 1, 3)
                # Grouped-query attention without copying K and V once per query head: head h reads KV
                # head h // groups, so the `groups` query heads of a KV head stack as extra query rows.
                q_grouped = (
                    q[shape.query_index]
                    .transpose(1, 2)
                    .reshape(rows, kv_heads, groups * queries, cfg.head_dim)
                )
                scores = (q_grouped @ k_pad.transpose(-1, -2)).view(rows, -1, queries, keys) * scale
                scores = scores.masked_fill(~shape.allowed, float("-inf"))
                probs = torch.softmax(scores.float(), dim=-1)  # [B, H, Q, L]
                attention_sum[shape.rows, :keys] += (probs * shape.query_valid[:, None, :, None]).sum(
                    dim=(1, 2)
                )
                grouped_probs = probs.to(self.dtype).view(rows, kv_heads, groups * queries, keys)
                out = (grouped_probs @ v_pad).view(rows, -1, queries, cfg.head_dim)
                out = out.transpose(1, 2).reshape(rows, queries, -1)
                attn_out[shape.token_index] = out[shape.query_valid]
            hidden = hidden + attn_out @ w[f"{prefix}.self_attn.o_proj.weight"].T

            h = self._rms_norm(hidden, w[f"{prefix}.post_attention_layernorm.weight"])
            gate = F.silu(h @ w[f"{prefix}.mlp.gate_proj.weight"].T)
            up = h @ w[f"{prefix}.mlp.up_proj.weight"].T
            hidden = hidden + (gate * up) @ w[f"{prefix}.mlp.down_proj.weight"].T

        last = (offsets + counts_t - 1).to(device)
        final = self._rms_norm(hidden[last], w["model.norm.weight"])
        logits = (final @ w["lm_head.weight"].T).float()
        denominator = (counts_t.to(device) * cfg.num_hidden_layers * cfg.num_attention_heads).float()
        mass = (attention_sum / denominator[:, None]).cpu()
        attention = [mass[b, : seq.cached] for b, seq in enumerate(sequences)]
        key_valid = key_range[None, :] < key_lengths[:, None]
        stepped_slots = key_slots.cpu()[key_valid]
        slot_mass = torch.zeros(pool.num_slots, dtype=torch.float32)
        slot_mass[stepped_slots] = mass[key_valid]
        slot_stepped = torch.zeros(pool.num_slots, dtype=torch.bool)
        slot_stepped[stepped_slots] = True
        return ForwardOutput(
            logits=logits.cpu(),
            attention=attention,
            slot_mass=slot_mass,
            slot_stepped=slot_stepped,
            new_slots=slot_index.cpu(),
        )

    def release(self, sequence: SequenceCache) -> None:
        self.pool.free(sequence.slots)
        sequence.slots = torch.zeros(0, dtype=torch.long)

    def evict(self, sequence: SequenceCache, keep: torch.Tensor) -> int:
        """Drop the tokens of `sequence` where `keep` (aligned with its slots) is False."""
        dropped = sequence.slots[~keep]
        self.pool.free(dropped)
        sequence.slots = sequence.slots[keep]
        return int(dropped.numel())

    def evict_marked(self, sequences: list[SequenceCache], marked: torch.Tensor) -> int:
        """Drop, from each of `sequences`, the tokens whose slot is marked (a bool mask over the pool).

        The same as `evict` once per sequence, freed slots in the same order (sequence by sequence, each
        in its own order), but the pool's free list is updated once for the whole batch.
        """
        dropped: list[torch.Tensor] = []
        for seq in sequences:
            drop = marked[seq.slots]
            dropped.append(seq.slots[drop])
            seq.slots = seq.slots[drop.logical_not_()]
        if not dropped:
            return 0
        freed = torch.cat(dropped)
        self.pool.free(freed)
        return int(freed.numel())

    # ---- a reference for tests ----------------------------------------------------------------------
    @torch.inference_mode()
    def reference_logits(
        self,
        tokens: list[int],
        hidden_mask: torch.Tensor | None = None,
        hide_from_query: int = 0,
        positions: torch.Tensor | None = None,
        window: int | None = None,
        sinks: int = 0,
    ) -> torch.Tensor:
        """Full causal forward without the pool; returns the logits of every token, [len, vocab].

        `hidden_mask[j]` True hides key j from the queries at index >= `hide_from_query`: the tokens that
        arrived before an eviction saw the evicted keys, the ones after do not, which is what evicting
        from a cache does. `positions` overrides the RoPE positions (default 0..len-1). `window` lets
        each query see only its last `window` tokens (itself included) and the first `sinks`: a cache
        that keeps the sinks and a sliding window, the best a first-in-first-out cache of that size does.
        """
        cfg = self.config
        w = self.weights
        count = len(tokens)
        cos, sin = self._rope(torch.arange(count) if positions is None else positions)
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        hidden = w["model.embed_tokens.weight"][ids]
        causal = torch.ones(count, count, dtype=torch.bool).tril()
        if window is not None:
            index = torch.arange(count)
            causal &= (index[:, None] - index[None, :] < window) | (index[None, :] < sinks)
        if hidden_mask is not None:
            hidden_keys = hidden_mask.bool()[None, :] & (torch.arange(count)[:, None] >= hide_from_query)
            causal = causal & ~(hidden_keys & ~torch.eye(count, dtype=torch.bool))
        causal = causal.to(self.device)
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        for layer in range(cfg.num_hidden_layers):
            prefix = f"model.layers.{layer}"
            h = self._rms_norm(hidden, w[f"{prefix}.input_layernorm.weight"])
            q = self._apply_rope(
                (h @ w[f"{prefix}.self_attn.q_proj.weight"].T).view(count, -1, cfg.head_dim), cos, sin
            )
            k = self._apply_rope(
                (h @ w[f"{prefix}.self_attn.k_proj.weight"].T).view(count, -1, cfg.head_dim), cos, sin
            )
            v = (h @ w[f"{prefix}.self_attn.v_proj.weight"].T).view(count, -1, cfg.head_dim)
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) * cfg.head_dim**-0.5
            probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
            out = torch.einsum("hqk,khd->qhd", probs, v).reshape(count, -1)
            hidden = hidden + out @ w[f"{prefix}.self_attn.o_proj.weight"].T
            h = self._rms_norm(hidden, w[f"{prefix}.post_attention_layernorm.weight"])
            hidden = (
                hidden
                + (
                    F.silu(h @ w[f"{prefix}.mlp.gate_proj.weight"].T)
                    * (h @ w[f"{prefix}.mlp.up_proj.weight"].T)
                )
                @ w[f"{prefix}.mlp.down_proj.weight"].T
            )
        final = self._rms_norm(hidden, w["model.norm.weight"])
        return (final @ w["lm_head.weight"].T).float().cpu()
