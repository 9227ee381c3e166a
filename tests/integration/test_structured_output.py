"""Structured output end to end. The real `openai` client, the proxy and the CPU engine serving the tiny
random model at temperature 1 (which alone writes garbage): every sample of a JSON schema (drawn by
hypothesis), of JSON mode and of a forced tool call holds, and the record says the sample was
constrained, keeping its tokens and the constrained logprobs. Against a scripted worker, the proxy sends
SGLang's grammar parameters; bad formats and choices are 400s naming the field. On the engine alone,
constrained and unconstrained requests batch together, each getting what it gets alone."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from proxy.workers.plan import CONSTRAINT_MARK
from serving.engine.grammar import GrammarCache
from serving.engine.protocol import Constraint
from tests.support import scripted_worker
from tests.support.chat_stream import assemble_stream
from tests.support.engine_server import PROMPT, running_engine
from tests.support.proxy_harness import LoopThread, Proxy, ProxyFactory
from tests.support.scripted_worker import ScriptedWorker
from tests.support.structured import constrained_logprobs, object_schemas
from tests.support.text_script import TextScript

MESSAGES = [{"role": "user", "content": "Describe the weather as JSON."}]
MAX_TOKENS = 256
CITY = {"type": "string", "pattern": "^[A-Z][a-z]{1,7}$"}
DAYS = {"type": "integer", "minimum": 1, "maximum": 7}
WEATHER = {"type": "object", "properties": {"city": CITY, "days": DAYS}, "required": ["city", "days"],
           "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ANY_OBJECT = '{"type": "object"}'
sqlite_only = pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)  # not about the database


@pytest.fixture(scope="module", name="engine_url")
def engine_url_fixture(tiny_model_dir: Path) -> Iterator[str]:
    with running_engine(tiny_model_dir) as url:
        yield url


@pytest.fixture(scope="module", name="tokenizer")
def tokenizer_fixture(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module", name="reference_model")
def reference_model_fixture(tiny_model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(name="served")
def served_fixture(proxies: ProxyFactory, engine_url: str) -> Proxy:
    """A proxy in front of the CPU engine."""
    return proxies.start([engine_url])


def choice_rows(proxy: Proxy, response: Any) -> list[tuple[Any, Any]]:
    """(choice, recorded completion) of every choice of a chat completion."""
    return [(choice, proxy.completion((choice.model_extra or {}).get("completion_id") or response.id))
            for choice in response.choices]


def assert_recorded(row: Any, tokenizer: Any, text: str | None, kind: str) -> None:
    """The record says which grammar constrained it, and keeps the sampled tokens and their logprobs."""
    assert row.request_json[CONSTRAINT_MARK] == kind
    if text is not None:
        assert tokenizer.decode(row.output_ids.tolist(), skip_special_tokens=True) == text
    assert row.finish_reason == "stop" and all(lp <= 0.0 for lp in row.output_logprobs.tolist())


@sqlite_only
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=object_schemas(), seed=st.integers(0, 2**31))
def test_every_sample_matches_a_drawn_json_schema(
    served: Proxy, tokenizer: Any, schema: dict[str, Any], seed: int
) -> None:
    response = served.client().chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=1.0, max_tokens=MAX_TOKENS, n=2, seed=seed,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": schema, "strict": True}},
    )
    for choice, row in choice_rows(served, response):
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), schema)
        assert_recorded(row, tokenizer, choice.message.content, "json_schema")


@sqlite_only
def test_json_mode_answers_are_objects_with_the_constrained_logprobs(
    served: Proxy, tokenizer: Any, reference_model: Any
) -> None:
    response = served.client().chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=1.0, max_tokens=160, n=6, seed=3,
        response_format={"type": "json_object"},
    )
    # Any object may be as long as it likes: the samples that ended (most do) are JSON objects.
    finished = [(c, row) for c, row in choice_rows(served, response) if c.finish_reason == "stop"]
    assert finished
    grammars = GrammarCache(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    for choice, row in finished:
        assert isinstance(json.loads(choice.message.content or ""), dict)
        assert_recorded(row, tokenizer, choice.message.content, "json_schema")
        expected = constrained_logprobs(reference_model, grammars, Constraint("json_schema", ANY_OBJECT),
                                        row.prompt_ids.tolist(), row.output_ids.tolist(), 1.0)
        assert row.output_logprobs.tolist() == pytest.approx(expected, abs=1e-4)


@sqlite_only
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_named_function_is_always_called_with_valid_arguments(
    served: Proxy, tokenizer: Any, stream: bool
) -> None:
    client = served.client()
    for seed in (1, 2, 3):
        kwargs: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "tool_choice": NAMED,
                                  "temperature": 1.0, "max_tokens": MAX_TOKENS, "seed": seed}
        if stream:
            result = assemble_stream(client.chat.completions.create(**kwargs, stream=True))
            calls = [(c["name"], c["arguments"]) for c in result["calls"]]
            finish, content = result["finish"], result["content"]
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]
            calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
            finish, content = choice.finish_reason, choice.message.content
        assert finish == "tool_calls" and not content
        [(name, arguments)] = calls
        assert name == "get_weather"
        jsonschema.validate(json.loads(arguments), WEATHER)
    for row in served.completions():
        assert_recorded(row, tokenizer, None, "structural_tag")


@sqlite_only
def test_required_gives_tool_calls_of_the_offered_functions(served: Proxy, tokenizer: Any) -> None:
    response = served.client().chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
        temperature=1.0, max_tokens=MAX_TOKENS, n=3, seed=5,
    )
    for choice, row in choice_rows(served, response):
        assert choice.finish_reason == "tool_calls"
        calls = choice.message.tool_calls or []
        assert calls
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert_recorded(row, tokenizer, None, "structural_tag")


def generate_request(params: dict[str, Any], index: int) -> dict[str, Any]:
    sampling = {"max_new_tokens": 60, "temperature": 1.0, "sampling_seed": 10 + index, **params}
    return {"input_ids": PROMPT[: 3 + index % 4], "return_logprob": True, "sampling_params": sampling}


YES_NO = r"(yes|no)( and (yes|no)){0,3}"
OK = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
GRAMMARS = [
    ({"regex": YES_NO}, lambda text: re.fullmatch(YES_NO, text)),
    ({"ebnf": 'root ::= "[" digit ("," digit)* "]"\ndigit ::= [0-9]'},
     lambda text: re.fullmatch(r"\[[0-9](,[0-9])*\]", text)),
    ({"json_schema": json.dumps(OK)}, lambda text: isinstance(json.loads(text)["ok"], bool)),
    ({}, None),
    ({"top_k": 30}, None),
]


async def test_constrained_and_free_requests_batch_together_as_they_run_alone(tiny_model_dir: Path) -> None:
    bodies = [generate_request({**params, "n": 2}, i) for i, (params, _) in enumerate(GRAMMARS)]
    with running_engine(tiny_model_dir) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            async def run(body: dict[str, Any]) -> Any:
                answer = await client.post("/generate", json=body)
                assert answer.status_code == 200, answer.text
                return answer.json()
            alone = [await run(body) for body in bodies]
            together = await asyncio.gather(*(run(body) for body in bodies))
    for (_, check), solo, batched in zip(GRAMMARS, alone, together, strict=True):
        for sample, same in zip(solo, batched, strict=True):
            assert sample["output_ids"] == same["output_ids"]
            if check is not None:
                assert sample["meta_info"]["finish_reason"]["type"] == "stop" and check(sample["text"])


async def test_a_retracted_constrained_sequence_keeps_its_place_in_the_grammar(tiny_model_dir: Path) -> None:
    pattern = r"(yes|no)( and (yes|no)){40}"  # long enough to be running when the pause comes
    body = {**generate_request({"regex": pattern, "max_new_tokens": 400}, 0), "stream": True}
    chunks: list[dict[str, Any]] = []
    with running_engine(tiny_model_dir) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            async with client.stream("POST", "/generate", json=body) as answer:
                async for line in answer.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunks.append(json.loads(line[len("data: "):]))
                    if len(chunks) == 1:  # drop its KV cache; it is prefilled again on continue
                        await client.post("/pause_generation", json={"mode": "retract"})
                        await client.post("/continue_generation", json={})
    final = chunks[-1]
    assert final["meta_info"]["num_retractions"] == 1
    assert final["meta_info"]["finish_reason"]["type"] == "stop" and re.fullmatch(pattern, final["text"])


def test_the_proxy_sends_sglangs_grammar_parameters(proxy: Proxy, scripted: ScriptedWorker) -> None:
    client = proxy.client()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    client.chat.completions.create(model="m", messages=MESSAGES, response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    client.chat.completions.create(model="m", messages=MESSAGES, response_format={"type": "json_object"})
    client.chat.completions.create(model="m", messages=MESSAGES, response_format={"type": "text"})
    client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED)
    client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                   parallel_tool_calls=False)
    client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="required")
    client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
                                   response_format={"type": "json_object"})
    sent = [request.body["sampling_params"] for request in scripted.requests_to("/generate")]
    kinds = ("json_schema", "regex", "ebnf", "structural_tag")
    assert [[kind for kind in kinds if kind in params] for params in sent] == [
        ["json_schema"], ["json_schema"], [], ["structural_tag"], ["structural_tag"], ["structural_tag"],
        ["json_schema"],  # response_format wins over a forced call, as in SGLang
    ]
    assert json.loads(sent[0]["json_schema"]) == schema and sent[1]["json_schema"] == ANY_OBJECT
    tags = [json.loads(params["structural_tag"])["format"] for params in sent[3:6]]
    assert [len(tag["tags"]) for tag in tags] == [1, 2, 2]
    assert [tag["stop_after_first"] for tag in tags] == [True, True, False]
    assert all(tag["at_least_one"] and tag["separator"] == "\n" for tag in tags)
    named = tags[0]["tags"][0]
    assert named["begin"] == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert named["content"] == {"type": "json_schema", "json_schema": WEATHER}
    marks = sorted(row.request_json.get(CONSTRAINT_MARK, "") for row in proxy.completions())
    assert marks == ["", "json_schema", "json_schema", "json_schema", "structural_tag", "structural_tag",
                     "structural_tag"]


@sqlite_only
@pytest.mark.parametrize("kwargs, param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}],
      "tool_choice": "required"}, "tools"),
], ids=["format-type", "format-no-schema", "format-bad-schema", "unknown-function", "no-tools", "bad-choice",
        "bad-parameters"])
def test_bad_formats_and_choices_are_400s_naming_the_field(
    proxy: Proxy, scripted: ScriptedWorker, kwargs: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        proxy.client().chat.completions.create(model="m", messages=MESSAGES, **kwargs)
    assert refused.value.param == param
    assert not scripted.requests_to("/generate") and proxy.count_completions() == 0


@sqlite_only
def test_a_schema_the_worker_cannot_compile_is_a_400(served: Proxy) -> None:
    unresolvable = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
    with pytest.raises(openai.BadRequestError) as refused:
        served.client().chat.completions.create(model="tiny", messages=MESSAGES, response_format={
            "type": "json_schema", "json_schema": {"name": "a", "schema": unresolvable}})
    assert "Invalid json_schema" in refused.value.message
    assert served.count_completions() == 0


def test_constrained_output_is_parsed_without_reasoning(
    proxies: ProxyFactory, servers: LoopThread, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = TextScript(tiny_model_dir, lambda prompt: '{"city": "Oslo"}')
    monkeypatch.setattr(scripted_worker, "token_text", script.text)
    worker = servers.start_scripted(token_fn=script, eos_token_id=script.eos)
    try:
        # deepseek-r1 opens every answer in reasoning: unconstrained, all of this would be reasoning.
        proxy = proxies.start([worker.url], reasoning_parser="deepseek-r1")
        message = proxy.client().chat.completions.create(
            model="m", messages=MESSAGES, response_format={"type": "json_object"},
        ).choices[0].message
        assert message.content == '{"city": "Oslo"}'
        assert not (message.model_extra or {}).get("reasoning_content")
    finally:
        servers.call(worker.stop())
