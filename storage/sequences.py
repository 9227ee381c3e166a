"""Rebuild full token sequences from a chain of completions that each store only their suffix, and order a
session's completions as their conversation tree (`flywheel sessions show`, the dashboard)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import numpy as np

from storage.packing import IntArray
from storage.records import CompletionRecord


def full_prompt_ids(chain: Sequence[CompletionRecord]) -> IntArray:
    """The prompt the last completion of a root-first chain was sampled from:
    `p0 + o0 + p1 + o1 + … + pk`, where each `p` is a stored suffix and each `o` an output
    (docs/architecture.md, "The token-exact rule")."""
    if not chain:
        raise ValueError("an empty chain has no prompt")
    for parent, child in pairwise(chain):
        if child.parent_id != parent.id:
            raise ValueError(f"completion {child.id} does not extend {parent.id}")
    if chain[0].parent_id is not None:
        raise ValueError(f"chain starts at {chain[0].id}, which has a parent")
    parts: list[IntArray] = []
    for i, completion in enumerate(chain):
        if i:
            parts.append(np.asarray(chain[i - 1].output_ids, dtype=np.int32))
        parts.append(np.asarray(completion.prompt_ids, dtype=np.int32))
    return np.concatenate(parts).astype(np.int32, copy=False)


def full_token_ids(chain: Sequence[CompletionRecord]) -> IntArray:
    """The last completion's whole sequence: its full prompt followed by its output."""
    output = np.asarray(chain[-1].output_ids, dtype=np.int32) if chain else np.empty(0, np.int32)
    return np.concatenate([full_prompt_ids(chain), output]).astype(np.int32, copy=False)


def tree_order(completions: Sequence[CompletionRecord]) -> list[tuple[CompletionRecord, int, int]]:
    """Completions (call order) depth first, children in call order, each with its depth and its full
    prompt's length (its stored suffix plus its parent's prompt and output)."""
    ids = {c.id for c in completions}
    children: dict[str | None, list[CompletionRecord]] = {}
    for c in completions:
        children.setdefault(c.parent_id if c.parent_id in ids else None, []).append(c)
    ordered: list[tuple[CompletionRecord, int, int]] = []
    stack = [(c, 0, 0) for c in reversed(children.get(None, []))]
    while stack:
        node, depth, inherited = stack.pop()
        prompt = inherited + len(node.prompt_ids)
        ordered.append((node, depth, prompt))
        below = prompt + len(node.output_ids)
        stack.extend((child, depth + 1, below) for child in reversed(children.get(node.id, [])))
    return ordered
