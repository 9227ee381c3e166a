"""proxy/workers/resume.py without servers: the pieces of a generation resumed after an abort stitched
into one choice (tokens, logprobs, versions, text cut inside a UTF-8 character), which aborts are
resumed, and a stop string straddling the boundary between pieces."""

from __future__ import annotations

from typing import Any

from proxy.workers.plan import read_choice
from proxy.workers.resume import Prefix, end_at_straddling_stop, join_text, merge, resumable, version_spans
from serving.models.tiny import build_tokenizer


def piece(ids: list[int], text: str, version: str, finish: dict[str, Any] | None) -> dict[str, Any]:
    return {"text": text, "output_ids": ids, "meta_info": {
        "id": "r", "finish_reason": finish, "weight_version": version,
        "output_token_logprobs": [[-0.1 * (i + 1), t, None] for i, t in enumerate(ids)]}}


def test_pieces_stitch_into_one_choice_with_versions_per_token() -> None:
    first = piece([5, 6, 7], "abc", "default", {"type": "abort"})
    second = piece([8, 9], "de", "3", {"type": "length", "length": 2})
    merged = merge(Prefix.of(first, None), second, None)
    choice = read_choice(merged, 0, final=True)
    assert choice.output_ids == [5, 6, 7, 8, 9] and choice.text == "abcde"
    assert choice.versions == [0, 0, 0, 3, 3] and choice.finish_reason == "length"
    assert choice.logprobs == [-0.1, -0.2, -0.30000000000000004, -0.1, -0.2]
    assert version_spans([0, 0, 3]) == [{"version": "0", "start": 0, "end": 2},
                                         {"version": "3", "start": 2, "end": 3}]


def test_text_cut_inside_a_character_is_rejoined() -> None:
    tokenizer = build_tokenizer(seed=0)

    def decode(ids: Any) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=True))

    text = "naïve café — 東京"
    ids = tokenizer.encode(text, add_special_tokens=False)
    cuts = [i for i in range(1, len(ids)) if decode(ids[:i]).endswith("\ufffd")]
    assert cuts, "the tokenizer should split some character across tokens"
    for cut in cuts:
        head, tail = ids[:cut], ids[cut:]
        prefix = Prefix(head, [], None, [0] * len(head), decode(head))
        assert join_text(prefix, tail, decode(tail), decode) == text
        # The worker trimmed a matched stop string (the last character) from the piece's text.
        assert join_text(prefix, tail, decode(tail)[:-1], decode) == text[:-1]
    clean = Prefix([1], [], None, [0], "ab")
    assert join_text(clean, [2], "cd", decode) == "abcd"  # no cut character: plain concatenation


def test_only_aborts_without_a_client_error_are_resumed() -> None:
    assert resumable(piece([1], "a", "0", {"type": "abort", "message": "Abort by pause_generation"}))
    assert resumable(piece([1], "a", "0", {"type": "abort", "status_code": None}))
    assert not resumable(piece([1], "a", "0", {"type": "abort", "status_code": 400}))
    assert not resumable(piece([1], "a", "0", {"type": "length", "length": 1}))
    assert not resumable(piece([1], "a", "0", None))


def test_a_stop_string_across_the_boundary_ends_the_choice() -> None:
    tokenizer = build_tokenizer(seed=0)

    def decode(ids: Any) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=True))

    text = "the quick brown fox jumps over my lazy dog"
    ids = tokenizer.encode(text, add_special_tokens=False)
    cut = len(ids) // 2
    boundary = len(decode(ids[:cut]))
    stop = text[boundary - 2: boundary + 2]  # the worker of the second piece sees only its half
    assert text.find(stop) == boundary - 2
    first = piece(ids[:cut], decode(ids[:cut]), "0", {"type": "abort"})
    second = piece(ids[cut:], decode(ids[cut:]), "1", {"type": "length", "length": len(ids) - cut})
    ended = end_at_straddling_stop(Prefix.of(first, decode), second, [stop, "zzz"], decode)
    choice = read_choice(ended, 0, final=True)
    assert choice.text == text[: boundary - 2] and choice.finish_reason == "stop"
    kept = len(choice.output_ids)
    assert choice.output_ids == ids[:kept] and len(choice.logprobs) == len(choice.versions) == kept
    assert len(decode(ids[: kept - 1])) < boundary + 2 <= len(decode(ids[:kept]))  # the last completes it
    assert choice.versions == [0] * cut + [1] * (kept - cut)
    untouched = end_at_straddling_stop(Prefix.of(first, decode), second, ["zzz"], decode)
    assert read_choice(untouched, 0, final=True).output_ids == ids
