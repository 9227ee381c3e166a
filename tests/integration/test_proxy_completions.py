"""`POST /v1/completions` (OpenAI's legacy text completions) through the proxy in front of a scripted
SGLang worker, on SQLite and Postgres, driven by the real `openai` client: raw prompts (text, token
ids, batches) reach the worker untemplated, and every returned choice is recorded token-exactly."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.support.proxy_harness import Proxy
from tests.support.recorded import assert_recorded, scripted_text
from tests.support.scripted_worker import ScriptedWorker

PROMPT = "Once upon a time, in a land far away"


@pytest.fixture(name="tokenizer")
def tokenizer_fixture(tiny_model_dir: Any) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_string_prompt_is_tokenized_without_template_and_recorded(
    proxy: Proxy, scripted: ScriptedWorker, tokenizer: Any
) -> None:
    response = proxy.client().completions.create(
        model="m", prompt=PROMPT, max_tokens=6, temperature=0.5, seed=3, user="u-1",
    )
    assert response.object == "text_completion" and response.id.startswith("cmpl-")
    (choice,) = response.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.logprobs is None
    row = assert_recorded(proxy, response.id, choice.text)
    expected_ids = tokenizer.encode(PROMPT)  # the tokenizer's own default: no chat template
    assert row.prompt_ids.tolist() == expected_ids and tokenizer.decode(expected_ids) == PROMPT
    assert response.usage is not None
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(expected_ids), 6)
    assert row.temperature == pytest.approx(0.5) and row.finish_reason == "length"
    assert row.request_json["prompt"] == PROMPT
    assert row.response_json["object"] == "text_completion"
    assert row.response_json["choices"][0]["text"] == choice.text
    (sent,) = scripted.requests_to("/generate")
    assert sent.body["input_ids"] == expected_ids and sent.body["rid"] == response.id
    assert sent.body["sampling_params"] == {
        "max_new_tokens": 6, "temperature": 0.5, "top_p": 1.0, "sampling_seed": 3,
    }


def test_token_id_prompt_is_sent_as_given_with_default_max_tokens(
    proxy: Proxy, scripted: ScriptedWorker
) -> None:
    prompt = [5, 17, 300, 2, 1000]
    response = proxy.client().completions.create(model="m", prompt=prompt)
    row = assert_recorded(proxy, response.id, response.choices[0].text)
    assert row.prompt_ids.tolist() == prompt
    assert len(row.output_ids) == 16  # OpenAI's default max_tokens for this endpoint
    (sent,) = scripted.requests_to("/generate")
    assert sent.body["input_ids"] == prompt and sent.body["sampling_params"]["max_new_tokens"] == 16


@pytest.mark.parametrize("prompts", [["Hello there", "Goodbye, old friend"], [[7, 8, 9], [10, 11]]])
def test_batch_of_two_prompts_with_n2_records_four_completions(
    proxy: Proxy, scripted: ScriptedWorker, tokenizer: Any, prompts: list[Any]
) -> None:
    response = proxy.client().completions.create(model="m", prompt=prompts, n=2, max_tokens=4)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    ids = [c.model_extra["completion_id"] for c in response.choices]  # type: ignore[index]
    assert ids[0] == response.id and len(set(ids)) == 4
    assert proxy.count_completions() == 4
    expected_prompts = [p if isinstance(p, list) else tokenizer.encode(p) for p in prompts]
    for choice, completion_id in zip(response.choices, ids, strict=True):
        row = assert_recorded(proxy, completion_id, choice.text)
        assert row.prompt_ids.tolist() == expected_prompts[choice.index // 2]
        (own,) = row.response_json["choices"]
        assert own["index"] == choice.index and own["text"] == choice.text
    assert len({c.text for c in response.choices}) == 4  # each prompt and sample generated its own
    assert response.usage is not None and response.usage.completion_tokens == 16
    assert response.usage.prompt_tokens == sum(len(p) for p in expected_prompts)
    sent = scripted.requests_to("/generate")
    assert sorted(r.body["input_ids"] for r in sent) == sorted(expected_prompts)
    assert all(r.body["sampling_params"]["n"] == 2 for r in sent)


def test_stream_text_equals_recorded_text(proxy: Proxy, scripted: ScriptedWorker) -> None:
    stream = proxy.client().completions.create(
        model="m", prompt=PROMPT, max_tokens=9, stream=True, stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert {c.object for c in chunks} == {"text_completion"} and len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 9
    assert all(c.usage is None for c in chunks[:-1])
    row = assert_recorded(proxy, chunks[0].id, text)
    assert len(row.output_ids) == 9 and row.response_json["choices"][0]["text"] == text
    assert scripted.requests_to("/generate")[0].body["stream"] is True


def test_stream_with_n2_echo_and_logprobs_matches_non_stream(proxy: Proxy) -> None:
    client = proxy.client()
    kwargs: dict[str, Any] = {"model": "m", "prompt": PROMPT, "max_tokens": 5, "n": 2, "seed": 1,
                              "echo": True, "logprobs": 1}
    plain = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    for index in (0, 1):
        own = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert "".join(c.text for c in own) == plain.choices[index].text
        streamed = [lp for c in own if c.logprobs for lp in c.logprobs.token_logprobs or ()]
        offsets = [o for c in own if c.logprobs for o in c.logprobs.text_offset or ()]
        served = plain.choices[index].logprobs
        assert served is not None
        assert streamed == served.token_logprobs and offsets == served.text_offset


def test_streamed_batch_interleaves_prompts_and_records_each_choice(
    proxy: Proxy, tokenizer: Any
) -> None:
    client = proxy.client()
    prompts = ["Hello there", "Goodbye, old friend"]
    kwargs: dict[str, Any] = {"model": "m", "prompt": prompts, "n": 2, "max_tokens": 5, "seed": 2}
    plain = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert len({c.id for c in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 20
    expected_prompts = [tokenizer.encode(prompt) for prompt in prompts]
    assert chunks[-1].usage.prompt_tokens == sum(len(ids) for ids in expected_prompts)
    rows = [c for c in proxy.completions() if c.request_json.get("stream")]
    assert len(rows) == 4
    by_index = {row.response_json["choices"][0]["index"]: row for row in rows}
    assert sorted(by_index) == [0, 1, 2, 3]
    for index in range(4):
        own = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        text = "".join(c.text for c in own)
        assert text == plain.choices[index].text
        assert [c.finish_reason for c in own if c.finish_reason] == ["length"]
        row = assert_recorded(proxy, by_index[index].id, text)
        assert row.prompt_ids.tolist() == expected_prompts[index // 2]


def test_logprobs_2_in_the_legacy_shape(proxy: Proxy, scripted: ScriptedWorker, tokenizer: Any) -> None:
    response = proxy.client().completions.create(model="m", prompt=PROMPT, max_tokens=7, logprobs=2)
    choice = response.choices[0]
    row = assert_recorded(proxy, response.id, choice.text)
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.tokens is not None
    output_ids = row.output_ids.tolist()
    assert logprobs.tokens == [tokenizer.decode([t]) for t in output_ids]
    assert logprobs.token_logprobs == pytest.approx(row.output_logprobs.tolist(), abs=1e-6)
    assert logprobs.top_logprobs is not None and len(logprobs.top_logprobs) == 7
    for position, top in enumerate(logprobs.top_logprobs):
        assert 1 <= len(top) <= 2 and max(top.values()) == pytest.approx(logprobs.token_logprobs[position])
    lengths = [len(t) for t in logprobs.tokens]
    assert logprobs.text_offset == [sum(lengths[:i]) for i in range(7)]
    assert scripted.requests_to("/generate")[0].body["top_logprobs_num"] == 2


def test_echo_prepends_the_prompt(proxy: Proxy, tokenizer: Any) -> None:
    client = proxy.client()
    response = client.completions.create(model="m", prompt=PROMPT, max_tokens=4, echo=True, logprobs=0)
    choice = response.choices[0]
    assert choice.text.startswith(PROMPT)
    row = assert_recorded(proxy, response.id, choice.text[len(PROMPT):])
    prompt_ids = tokenizer.encode(PROMPT)
    assert row.prompt_ids.tolist() == prompt_ids
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert choice.logprobs.token_logprobs[: len(prompt_ids)] == [None] * len(prompt_ids)
    assert len(choice.logprobs.token_logprobs) == len(prompt_ids) + 4
    assert choice.logprobs.top_logprobs == [None] * len(prompt_ids) + [{}] * 4
    ids_prompt = client.completions.create(model="m", prompt=prompt_ids, max_tokens=2, echo=True)
    assert ids_prompt.choices[0].text.startswith(PROMPT)


def test_root_route_and_admin_call_session(proxy: Proxy) -> None:
    response = httpx.post(
        f"{proxy.base_url}/completions", headers={"Authorization": f"Bearer {proxy.admin_key}"},
        json={"model": "m", "prompt": "hi", "max_tokens": 2}, timeout=30,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    session_id = response.headers["x-flywheel-session-id"]
    assert_recorded(proxy, body["id"], body["choices"][0]["text"], session_id=session_id)
    (session,) = [s for s in proxy.sessions() if s.id == session_id]
    assert session.status != "active"


def test_dropped_stream_records_partial_abort(proxy: Proxy, scripted: ScriptedWorker) -> None:
    scripted.token_delay_s = 0.02
    stream = proxy.client().completions.create(model="m", prompt=PROMPT, max_tokens=500, stream=True)
    received = ""
    for chunk in stream:
        received += chunk.choices[0].text
        if len(received) >= 3:
            break
    stream.close()
    row = None
    deadline = time.monotonic() + 20
    while row is None and time.monotonic() < deadline:
        row = next((c for c in proxy.completions() if c.id == chunk.id), None)
        time.sleep(0.05)
    assert row is not None, "the dropped stream was not recorded"
    assert row.finish_reason == "abort" and 3 <= len(row.output_ids) < 500
    assert scripted_text(row.output_ids).startswith(received)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m"}, "prompt"),
        ({"model": "m", "prompt": []}, "prompt"),
        ({"model": "m", "prompt": [[]]}, "prompt"),
        ({"model": "m", "prompt": [1, 2, 10**6]}, "prompt"),
        ({"model": "m", "prompt": [[1, 2], [-1]]}, "prompt"),
        ({"model": "m", "prompt": [1.5]}, "prompt[0]"),
        ({"model": "m", "prompt": "x", "n": 0}, "n"),
        ({"model": "m", "prompt": "x", "logprobs": 6}, "logprobs"),
        ({"model": "m", "prompt": "x", "suffix": "end"}, "suffix"),
        ({"model": "m", "prompt": "x", "n": 2, "best_of": 3}, "best_of"),
    ],
)
def test_bad_bodies_are_400_and_write_nothing(proxy: Proxy, body: dict[str, Any], param: str) -> None:
    sessions_before = len(proxy.sessions())
    client = proxy.client(key=proxy.admin_key)  # an admin call would create a session: it must not
    with pytest.raises(openai.BadRequestError) as error:
        client.post("/completions", body=body, cast_to=object)
    assert error.value.status_code == 400
    assert error.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    assert error.value.param == param
    assert proxy.count_completions() == 0 and len(proxy.sessions()) == sessions_before
