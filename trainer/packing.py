"""Which rows of a minibatch a data-parallel rank trains, and how its rows are packed into micro-batches.

Pure functions over row lengths (tokens per row, padding excluded) that return positions into the list
they were given. Every rank calls them on the same minibatch with the same arguments, so the ranks agree
on the split without talking to each other.
"""

from __future__ import annotations

from collections.abc import Sequence


def longest_first(lengths: Sequence[int]) -> list[int]:
    """Positions of `lengths`, longest row first; equal lengths keep their order."""
    return sorted(range(len(lengths)), key=lambda position: -lengths[position])


def rank_share(lengths: Sequence[int], rank: int, world_size: int) -> list[int]:
    """Rank `rank`'s share of the rows whose lengths are `lengths`, as positions in ascending order.

    The rows are dealt longest first in a snake order (ranks 0…N−1, then N−1…0, …), so every row goes to
    exactly one rank, shares differ by at most one row, and their token counts stay close. A rank may get
    nothing when there are fewer rows than ranks.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not one of {world_size} ranks")
    share = []
    for place, position in enumerate(longest_first(lengths)):
        lap, seat = divmod(place, world_size)
        if (seat if lap % 2 == 0 else world_size - 1 - seat) == rank:
            share.append(position)
    return sorted(share)


def pack_micro_batches(
    lengths: Sequence[int], token_budget: int | None = None, max_rows: int | None = None
) -> list[list[int]]:
    """Group the rows whose lengths are `lengths` into micro-batches (lists of positions).

    With neither limit, one micro-batch of every row in the given order. Otherwise rows are taken longest
    first and a micro-batch grows while its padded tokens (its rows × its longest row) stay within
    `token_budget` and its rows within `max_rows`; a row longer than the budget goes alone. Sorting first
    keeps the rows of a micro-batch of similar length, so little of the budget goes to padding. No rows,
    no micro-batches.
    """
    if not lengths:
        return []
    if token_budget is None and max_rows is None:
        return [list(range(len(lengths)))]
    parts: list[list[int]] = []
    current: list[int] = []
    width = 0  # the longest row of `current`: its first, rows being sorted
    for position in longest_first(lengths):
        fits_rows = max_rows is None or len(current) < max_rows
        fits_tokens = token_budget is None or (len(current) + 1) * width <= token_budget
        if current and fits_rows and fits_tokens:
            current.append(position)
            continue
        if current:
            parts.append(current)
        current, width = [position], lengths[position]
    parts.append(current)
    return parts
