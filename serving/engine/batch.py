"""The running batch's KV cache: left-padded rows sharing one write column, preallocated with headroom.

Every row of a decode step writes its new key/value at the same column, so one step costs one in-place
write per layer instead of re-concatenating the cache. Rows are left-padded; a float mask hides the
padding and per-row position ids keep RoPE exact, so a row computes what it would compute alone.
Merging freshly prefilled rows and dropping finished ones copy the cache once (between steps only).

The cache object speaks the one method transformers' attention layers call (`update`) and is not a
`transformers.Cache`, so the model takes the 4D mask we pass as-is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

HEADROOM = 64
"""Columns allocated beyond the current length; the buffers grow by this much when full."""


class PaddedKVCache:
    """Per-layer key/value buffers of shape (B, H_kv, capacity, D); columns [0, length) are in use."""

    def __init__(self, batch_size: int, capacity: int) -> None:
        self.batch_size = batch_size
        self.capacity = capacity
        self.length = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this forward's keys/values (B, H, q, D) at column `length`; return the used prefix."""
        if layer_idx == len(self.keys):  # first forward: buffers take the model's head shapes
            b, h, _, d = key_states.shape
            self.keys.append(key_states.new_zeros(b, h, self.capacity, d))
            self.values.append(value_states.new_zeros(b, h, self.capacity, d))
        end = self.length + key_states.shape[2]
        self.keys[layer_idx][:, :, self.length:end] = key_states
        self.values[layer_idx][:, :, self.length:end] = value_states
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    def relayout(self, rows: torch.Tensor | None, first_col: int, capacity: int, offset: int = 0,
                 total_rows: int | None = None) -> PaddedKVCache:
        """A new cache holding `rows` (all if None), columns [first_col, length) moved to `offset`."""
        used = self.length - first_col
        out = PaddedKVCache(total_rows or (self.batch_size if rows is None else len(rows)), capacity)
        out.length = offset + used
        for keys, values in zip(self.keys, self.values, strict=True):
            new_k = keys.new_zeros(out.batch_size, keys.shape[1], capacity, keys.shape[3])
            new_v = values.new_zeros(out.batch_size, values.shape[1], capacity, values.shape[3])
            src_k, src_v = keys[:, :, first_col:self.length], values[:, :, first_col:self.length]
            if rows is not None:
                src_k, src_v = src_k[rows], src_v[rows]
            new_k[: src_k.shape[0], :, offset:offset + used] = src_k
            new_v[: src_v.shape[0], :, offset:offset + used] = src_v
            out.keys.append(new_k)
            out.values.append(new_v)
        return out


class PaddedBatch:
    """Rows decoding together: their cache, padding mask, next positions and next input tokens."""

    def __init__(self, cache: PaddedKVCache, mask: torch.Tensor, positions: torch.Tensor,
                 next_tokens: torch.Tensor) -> None:
        self.cache = cache
        self.mask = mask  # (B, capacity) additive: 0 where a row has a token, -inf-like elsewhere
        self.positions = positions  # (B,) position id of each row's next token
        self.next_tokens = next_tokens  # (B,) token each row feeds into the next step

    @property
    def size(self) -> int:
        return self.cache.batch_size

    def decode_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """input_ids (B, 1), position_ids (B, 1) and the 4D mask (B, 1, 1, L + 1) of the next step."""
        length = self.cache.length
        if length + 1 > self.cache.capacity:
            self._grow(length + 1 + HEADROOM)
        self.mask[:, length] = 0.0
        mask = self.mask[:, None, None, : length + 1]
        return self.next_tokens.unsqueeze(1), self.positions.unsqueeze(1), mask

    def advance(self, tokens: Sequence[int]) -> None:
        """After a step: the fed tokens are cached; `tokens` are fed next."""
        self.cache.length += 1
        self.positions += 1
        self.next_tokens = torch.tensor(tokens, dtype=torch.long)

    def _grow(self, capacity: int) -> None:
        self.cache = self.cache.relayout(None, 0, capacity)
        mask = self.mask.new_full((self.size, capacity), torch.finfo(self.mask.dtype).min)
        mask[:, : self.mask.shape[1]] = self.mask
        self.mask = mask

    def keep(self, rows: list[int]) -> PaddedBatch | None:
        """The batch without its other rows, leading all-padding columns trimmed (None if empty)."""
        if not rows:
            return None
        index = torch.tensor(rows, dtype=torch.long)
        valid = self.mask[index, : self.cache.length] == 0.0  # (B', L)
        first_col = int(valid.any(dim=0).int().argmax())
        used = self.cache.length - first_col
        capacity = used + HEADROOM
        cache = self.cache.relayout(index, first_col, capacity)
        mask = self.mask.new_full((len(rows), capacity), torch.finfo(self.mask.dtype).min)
        mask[:, :used] = self.mask[index, first_col: self.cache.length]
        return PaddedBatch(cache, mask, self.positions[index].clone(), self.next_tokens[index].clone())


def merge(old: PaddedBatch | None, new: PaddedBatch) -> PaddedBatch:
    """One batch of `old`'s rows then `new`'s, right-aligned on a common length."""
    if old is None:
        return new
    length = max(old.cache.length, new.cache.length)
    capacity = length + HEADROOM
    total = old.size + new.size
    cache = old.cache.relayout(None, 0, capacity, offset=length - old.cache.length, total_rows=total)
    fill = new.cache.relayout(None, 0, capacity, offset=length - new.cache.length)
    for layer, (keys, values) in enumerate(zip(fill.keys, fill.values, strict=True)):
        cache.keys[layer][old.size:] = keys
        cache.values[layer][old.size:] = values
    minimum = torch.finfo(old.mask.dtype).min
    mask = old.mask.new_full((total, capacity), minimum)
    mask[: old.size, length - old.cache.length: length] = old.mask[:, : old.cache.length]
    mask[old.size:, length - new.cache.length: length] = new.mask[:, : new.cache.length]
    positions = torch.cat([old.positions, new.positions])
    next_tokens = torch.cat([old.next_tokens, new.next_tokens])
    return PaddedBatch(cache, mask, positions, next_tokens)


def prefill_inputs(prompts: Sequence[Sequence[int]], dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded input_ids (k, P), position_ids (k, P), 4D causal mask (k, 1, P, P), row mask (k, P)."""
    width = max(len(p) for p in prompts)
    minimum = torch.finfo(dtype).min
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
        valid[i, width - len(prompt):] = True
    positions = (valid.long().cumsum(dim=1) - 1).clamp_(min=0)
    causal = torch.ones(width, width, dtype=torch.bool).tril()  # (P, P) query i sees keys <= i
    allowed = causal.unsqueeze(0) & valid.unsqueeze(1)  # (k, P, P)
    # A padding query sees only itself, so no softmax row is empty; real queries never see padding.
    allowed |= torch.eye(width, dtype=torch.bool).unsqueeze(0) & ~valid.unsqueeze(2)
    mask = torch.zeros(len(prompts), 1, width, width, dtype=dtype)
    mask.masked_fill_(~allowed.unsqueeze(1), minimum)
    row_mask = torch.zeros(len(prompts), width, dtype=dtype).masked_fill_(~valid, minimum)
    return input_ids, positions, mask, row_mask


def prefilled_batch(cache: PaddedKVCache, row_mask: torch.Tensor, prompts: Sequence[Sequence[int]],
                    first_tokens: Sequence[int]) -> PaddedBatch:
    """Wrap a prefill's cache (length P) as a batch whose rows feed their first sampled tokens next."""
    capacity = cache.capacity
    mask = row_mask.new_full((cache.batch_size, capacity), torch.finfo(row_mask.dtype).min)
    mask[:, : row_mask.shape[1]] = row_mask
    positions = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    return PaddedBatch(cache, mask, positions, torch.tensor(list(first_tokens), dtype=torch.long))
