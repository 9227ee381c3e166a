"""Reading recorded completions back as the worker saw them: a completion with a parent stores only its
prompt suffix (DESIGN.md section 3), so the prompt the worker got is rebuilt from the chain."""

from __future__ import annotations

from collections.abc import Sequence

from storage.models import Completion
from storage.queries import completion_record
from storage.sequences import full_prompt_ids as chain_prompt_ids


def full_prompt_ids(rows: Sequence[Completion], row: Completion) -> list[int]:
    """The whole prompt `row` was sampled from, given all rows of its session."""
    by_id = {r.id: r for r in rows}
    chain = [row]
    while chain[0].parent_id is not None:
        chain.insert(0, by_id[chain[0].parent_id])
    return [int(t) for t in chain_prompt_ids([completion_record(r) for r in chain])]
