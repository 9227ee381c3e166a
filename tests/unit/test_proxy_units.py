"""Pure pieces of the proxy: streaming hold-back, worker answers read into choices, version spans,
generation planning, validation messages, token bytes, balancing."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from proxy.errors import OpenAIError, describe_validation_errors
from proxy.metrics import ProxyMetrics
from proxy.openai.schemas import ChatCompletionRequest
from proxy.openai.streaming import ChoiceStream
from proxy.tokenize import ChatTokenizer
from proxy.workers.plan import plan_generation, policy_version, read_choice, token_versions
from proxy.workers.routing import Balancer
from serving.client import SGLangClient
from serving.config import ClientConfig
from serving.errors import WorkerProtocolError
from serving.models.tiny import build_tokenizer


@pytest.fixture(scope="module")
def chat_tokenizer() -> ChatTokenizer:
    return ChatTokenizer(build_tokenizer(seed=0), context_length=64)


def chunk(text: str, n_tokens: int, finish: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "finish_reason": {"type": finish} if finish else None, "id": "r1",
        "output_token_logprobs": [[-0.5, 7, None]] * n_tokens, "weight_version": "default",
    }
    return {"text": text, "output_ids": [7] * n_tokens, "meta_info": meta}


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


def test_policy_versions_per_token() -> None:
    assert policy_version("default") == 0 and policy_version("7") == 7 and policy_version(None) == 0
    spans = [{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 2, "end": 5}]
    assert token_versions({"weight_version": "2", "weight_versions": spans}, 5) == [1, 1, 2, 2, 2]
    assert token_versions({"weight_version": "3"}, 3) == [3, 3, 3]
    with pytest.raises(WorkerProtocolError, match="not an integer"):
        policy_version("latest")


def test_read_choice_maps_finish_reasons_and_checks_lengths() -> None:
    result = read_choice(chunk("abc", 3, finish="abort"), 1, final=True)
    assert (result.index, result.output_ids, result.logprobs) == (1, [7] * 3, [-0.5] * 3)
    assert result.finish_reason == "abort"
    short = chunk("abc", 3, finish="stop")
    short["meta_info"]["output_token_logprobs"] = short["meta_info"]["output_token_logprobs"][:2]
    with pytest.raises(OpenAIError) as error:
        read_choice(short, 0, final=True)
    assert error.value.status == 502
    partial = read_choice(short, 0, final=False)  # mid-stream: keep the tokens whose logprobs arrived
    assert len(partial.output_ids) == len(partial.logprobs) == 2


def test_plan_maps_openai_fields_to_sglang(chat_tokenizer: ChatTokenizer) -> None:
    body = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 500,
        "max_tokens": 3, "seed": 11, "stop": "END", "n": 3, "top_p": 0.0, "logprobs": True, "top_logprobs": 2,
    })
    plan = plan_generation(body, [1, 2, 3, 4], chat_tokenizer, 4096, "s", "served")
    sampling = plan.worker_request.sampling_params
    assert sampling is not None
    assert sampling.max_new_tokens == 60  # max_completion_tokens wins, lowered to the room left (64 - 4)
    assert (sampling.sampling_seed, sampling.stop, sampling.n, sampling.temperature) == (11, ["END"], 3, 1.0)
    assert sampling.top_p is not None and 0 < sampling.top_p < 1e-5 and plan.top_p == 0.0
    assert plan.worker_request.top_logprobs_num == 2 and plan.worker_request.return_logprob
    assert plan.completion_ids[1:] == (f"{plan.response_id}-1", f"{plan.response_id}-2")
    assert plan.model == "m" and plan.top_k == -1
    with pytest.raises(OpenAIError) as error:
        plan_generation(body, list(range(64)), chat_tokenizer, 4096, "s", "served")
    assert error.value.code == "context_length_exceeded"


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({}, "messages", "missing_required_parameter"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n", "invalid_value"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": 5}, "stop", "invalid_type"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "messages[0].content[0]",
         "invalid_value"),
        ({"messages": [{"role": "tool"}]}, "messages[0]", "invalid_value"),
    ],
)
def test_validation_errors_name_the_field(body: dict[str, Any], param: str, code: str) -> None:
    with pytest.raises(ValidationError) as error:
        ChatCompletionRequest.model_validate(body)
    errors = [{**e, "loc": ("body", *e["loc"])} for e in error.value.errors()]
    message, named, kind = describe_validation_errors(errors)
    assert (named, kind) == (param, code) and param in message


def test_content_parts_flatten_and_tool_arguments_become_objects() -> None:
    body = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "f", "arguments": '{"k": 1}'}}]},
    ], "brand_new_field": True})
    user, assistant = body.template_messages()
    assert user == {"role": "user", "content": "a\nb"}
    assert assistant["tool_calls"][0]["function"] == {"name": "f", "arguments": {"k": 1}}


def test_token_bytes_are_exact_for_byte_level_bpe(chat_tokenizer: ChatTokenizer) -> None:
    text = "héllo wörld 日本 <tool_call> ok"
    ids = chat_tokenizer.encode(text)
    assert b"".join(chat_tokenizer.token_bytes(i) for i in ids).decode() == text
    assert chat_tokenizer.token_bytes(2) == b"<|im_end|>"


def test_developer_role_renders_as_system_where_the_template_lacks_it() -> None:
    tokenizer = build_tokenizer(seed=0)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role not in ('system', 'user', 'assistant') %}"
        "{{ raise_exception('unknown role ' + m.role) }}{% endif %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    )
    chat = ChatTokenizer(tokenizer, 64)
    ids = chat.render([{"role": "developer", "content": "be brief"}], None)
    assert chat.decode(ids) == "<system>be brief"
    with pytest.raises(OpenAIError) as error:
        chat.render([{"role": "tool", "content": "x"}], None)
    assert error.value.status == 400 and "unknown role tool" in error.value.message


def test_balancer_prefers_idle_healthy_workers_in_turn() -> None:
    clients = [SGLangClient(f"http://w{i}", ClientConfig()) for i in range(3)]
    balancer = Balancer(clients, ProxyMetrics(), failure_cooldown_s=60)
    picks = []
    for _ in range(6):
        worker = balancer.candidates()[0]
        with balancer.lease(worker):
            picks.append(worker.url)
    assert picks == ["http://w0", "http://w1", "http://w2"] * 2
    busy = balancer.workers[0]
    balancer.acquire(busy)
    assert balancer.candidates()[-1] is busy
    balancer.release(busy)
    balancer.mark_failed(balancer.workers[1], "connect")
    assert balancer.candidates()[-1] is balancer.workers[1]
