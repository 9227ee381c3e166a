"""The balancer's ordering (sticky sessions, slack, least busy, down workers last) and the stitching of
resumed generations (tokens, logprobs, versions, text cut inside a UTF-8 character), without servers."""

from __future__ import annotations

from typing import Any

from proxy.metrics import ProxyMetrics
from proxy.workers.plan import read_choice
from proxy.workers.resume import Prefix, end_at_straddling_stop, join_text, merge, resumable, version_spans
from proxy.workers.routing import Balancer, RoutingPolicy
from serving.client import SGLangClient
from serving.config import ClientConfig
from serving.models.tiny import build_tokenizer


def balancer(n: int = 3, health_checks: bool = False, **policy: Any) -> Balancer:
    clients = [SGLangClient(f"http://w{i}", ClientConfig()) for i in range(n)]
    b = Balancer(clients, ProxyMetrics(), failure_cooldown_s=60, policy=RoutingPolicy(**policy))
    b.health_checking = health_checks
    return b


def pick(b: Balancer, session: str | None) -> str:
    worker = b.candidates(session)[0]
    with b.lease(worker, session):
        return worker.url


def test_sessions_stick_and_new_sessions_take_turns() -> None:
    b = balancer()
    assert [pick(b, f"s{i}") for i in range(3)] == ["http://w0", "http://w1", "http://w2"]
    assert [pick(b, "s1") for _ in range(3)] == ["http://w1"] * 3  # round-robin would move it
    assert pick(b, "s3") == "http://w0"  # least recently used among the idle


def test_a_busy_sticky_worker_is_left_beyond_the_slack() -> None:
    b = balancer(n=2, sticky_slack=1)
    assert pick(b, "s") == "http://w0"
    home = b.workers[0]
    b.acquire(home)
    assert b.candidates("s")[0] is home  # one more in flight: within the slack
    b.acquire(home)
    assert b.candidates("s")[0] is b.workers[1]  # two more: moves
    b.release(home)
    b.release(home)
    assert b.candidates("s")[0] is home


def test_down_workers_come_last_and_sessions_leave_them() -> None:
    b = balancer(n=2, health_checks=True)
    assert pick(b, "s") == "http://w0"
    b.mark_failed(b.workers[0], "connect")
    assert [w.url for w in b.candidates("s")] == ["http://w1", "http://w0"]
    assert [w.url for w in b.candidates(None)] == ["http://w1", "http://w0"]
    b.mark_ok(b.workers[0])
    assert b.candidates("s")[0] is b.workers[0]


def test_without_health_checks_a_failed_worker_returns_after_the_cooldown() -> None:
    b = balancer(n=2)
    b.mark_failed(b.workers[0], "connect")
    assert b.candidates()[-1] is b.workers[0]
    b.workers[0].failed_until = 0.0  # the cooldown is over
    assert b.candidates()[0] is b.workers[0] and b.workers[0].up


def test_the_session_map_forgets_the_least_recently_used() -> None:
    b = balancer(n=2, sticky_sessions_max=2)
    for session in ("a", "b", "c"):
        pick(b, session)
    assert b.sticky_worker("a") is None and b.sticky_worker("c") is not None


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
