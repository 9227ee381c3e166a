"""proxy/openai/streaming.py without servers: what a streamed choice sends as a worker's cumulative
answers arrive, holding back half a UTF-8 character and a possible stop string, never unsending text."""

from __future__ import annotations

from proxy.openai.streaming import ChoiceStream
from tests.support.worker_answers import chunk


def test_stream_holds_back_incomplete_utf8_until_it_completes() -> None:
    stream = ChoiceStream(0, [])
    assert stream.advance(chunk("ab", 2)) == ("ab", 0, 2)
    assert stream.advance(chunk("ab\ufffd", 3)) == ("", 2, 2)  # half a character: wait
    assert stream.advance(chunk("abé", 4)) == ("é", 2, 4)  # its tokens travel with its text
    assert stream.advance(chunk("abé\ufffd", 5, finish="length")) == ("\ufffd", 4, 5)  # final: all of it


def test_stream_holds_back_a_possible_stop_string() -> None:
    stream = ChoiceStream(0, ["STOP"])
    assert stream.advance(chunk("hello S", 2)) == ("hello ", 0, 2)
    assert stream.advance(chunk("hello ST", 3)) == ("", 2, 2)
    assert stream.advance(chunk("hello STA", 4)) == ("STA", 2, 4)  # not a stop after all
    assert stream.advance(chunk("hello STAY", 5, finish="stop")) == ("Y", 4, 5)
    trimmed = ChoiceStream(0, ["STOP"])
    trimmed.advance(chunk("ok STO", 3))
    assert trimmed.sent_text == "ok "
    assert trimmed.advance(chunk("ok ", 4, finish="stop")) == ("", 3, 4)  # the worker trimmed the stop


def test_stream_never_unsends_text() -> None:
    stream = ChoiceStream(0, [])
    stream.advance(chunk("abc", 3))
    assert stream.advance(chunk("abX", 4)) == ("", 3, 3)
