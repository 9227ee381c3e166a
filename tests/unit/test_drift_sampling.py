"""proxy.drift_check_every: one chained turn in N is compared with a fresh render; 0 never, 1 always."""

from __future__ import annotations

from typing import Any, cast

from proxy.conversations.index import ConversationIndex


def test_one_chained_turn_in_every_n_is_checked() -> None:
    def due(every: int, turns: int) -> list[bool]:
        index = ConversationIndex(cast(Any, None))
        return [index.drift_check_due(every) for _ in range(turns)]

    assert due(3, 6) == [False, False, True, False, False, True]
    assert due(1, 3) == [True, True, True]
    assert due(0, 3) == [False, False, False]
