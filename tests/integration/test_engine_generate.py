"""/generate on a real uvicorn server with the tiny model: exact logprobs, greedy, seeds, stops, n, stream,
and SGLang 0.5.23 schema conformance of every answer."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from serving.models.loading import load_model
from tests.support.engine_server import PROMPT, assert_logprobs_match, conforms, generate, running_engine


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir) -> Iterator[str]:
    with running_engine(tiny_model_dir, default_max_new_tokens=24) as url:
        yield url


@pytest.fixture(scope="module")
def reference_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def stream_chunks(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The SSE data chunks of a streamed /generate; asserts it ends with [DONE]."""
    chunks: list[Any] = []
    with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line:
                assert line.startswith("data: ")
                payload = line[len("data: "):]
                chunks.append(payload if payload == "[DONE]" else json.loads(payload))
    assert chunks[-1] == "[DONE]"
    return chunks[:-1]


def test_greedy_is_the_argmax_with_exact_logprobs(engine_url, reference_model, sglang_api_types):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 20, "temperature": 0.0},
            "return_logprob": True}
    answer = generate(engine_url, body)
    conforms(sglang_api_types, body, answer)
    logits = assert_logprobs_match(reference_model, PROMPT, answer, temperature=1.0)
    assert answer["output_ids"] == logits.argmax(dim=-1).tolist()
    assert generate(engine_url, body)["output_ids"] == answer["output_ids"]
    meta = answer["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 20}
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == 20
    assert meta["weight_version"] == "default"
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": 20}]
    assert meta["output_token_logprobs"][0][2] is None


@pytest.mark.parametrize("params", [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_p": 0.9, "top_k": 40},
    {"temperature": 0.7, "min_p": 0.05},
])
def test_sampled_logprobs_are_of_the_tempered_full_distribution(engine_url, reference_model, params):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 24, "sampling_seed": 5, **params},
            "return_logprob": True}
    answer = generate(engine_url, body)
    logits = assert_logprobs_match(reference_model, PROMPT, answer, temperature=params["temperature"])
    ranks = (logits > logits[torch.arange(len(logits)), answer["output_ids"]].unsqueeze(1)).sum(dim=1)
    if "top_k" in params:  # truncation restricts what is drawn, not what is reported
        assert int(ranks.max()) < params["top_k"]


def test_sampling_seed_makes_sampling_reproducible(engine_url):
    def sample(seed: int) -> list[int]:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 24, "temperature": 1.0,
                                                         "sampling_seed": seed}}
        return generate(engine_url, body)["output_ids"]
    assert sample(11) == sample(11)
    assert sample(11) != sample(12)


def test_stop_token_ids_end_the_output_and_stay_in_output_ids(engine_url, tiny_model_dir):
    tokenizer = load_model(str(tiny_model_dir)).tokenizer
    greedy = {"max_new_tokens": 24, "temperature": 0.0}
    full = generate(engine_url, {"input_ids": PROMPT, "sampling_params": greedy})["output_ids"]
    stop = full[-1]  # the tiny model's greedy output settles into a repeat: this first shows up mid-way
    cut = full.index(stop) + 1
    assert 1 < cut < len(full)
    answer = generate(engine_url, {"input_ids": PROMPT,
                                   "sampling_params": {**greedy, "stop_token_ids": [stop]}})
    assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert answer["output_ids"] == full[:cut]
    assert answer["text"] == tokenizer.decode(full[: cut - 1])
    kept = generate(engine_url, {"input_ids": PROMPT, "sampling_params": {
        **greedy, "stop_token_ids": [stop], "no_stop_trim": True}})
    assert kept["text"] == tokenizer.decode(full[:cut])
    ignored = generate(engine_url, {"input_ids": PROMPT, "sampling_params": {
        **greedy, "stop_token_ids": [stop], "ignore_eos": True}})
    assert ignored["output_ids"] == full


def test_stop_strings_end_the_output_and_trim_the_text(engine_url, tiny_model_dir):
    tokenizer = load_model(str(tiny_model_dir)).tokenizer
    greedy = {"max_new_tokens": 24, "temperature": 0.0}
    full = generate(engine_url, {"input_ids": PROMPT, "sampling_params": greedy})
    stop = next(t for t in (tokenizer.decode([i]) for i in full["output_ids"][8:]) if t.strip())
    answer = generate(engine_url, {"input_ids": PROMPT, "sampling_params": {**greedy, "stop": [stop]}})
    ids = answer["output_ids"]
    assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert ids == full["output_ids"][: len(ids)] and 1 < len(ids) < len(full["output_ids"])
    assert stop in tokenizer.decode(ids) and stop not in tokenizer.decode(ids[:-1])
    assert answer["text"] == tokenizer.decode(ids)[: tokenizer.decode(ids).find(stop)]
    kept = generate(engine_url, {"input_ids": PROMPT, "sampling_params": {**greedy, "stop": stop,
                                                                          "no_stop_trim": True}})
    assert kept["text"].endswith(stop) and kept["output_ids"] == ids


def test_n_returns_a_list_of_distinct_reproducible_samples(engine_url, sglang_api_types):
    body = {"input_ids": PROMPT, "rid": "many", "sampling_params": {"max_new_tokens": 12, "temperature": 1.0,
                                                                    "n": 3, "sampling_seed": 21}}
    answer = generate(engine_url, body)
    conforms(sglang_api_types, body, answer)
    assert isinstance(answer, list) and len(answer) == 3
    assert [a["meta_info"]["id"] for a in answer] == ["many_0", "many_1", "many_2"]
    assert len({tuple(a["output_ids"]) for a in answer}) == 3
    second = generate(engine_url, {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 22}})
    assert second["output_ids"] == answer[1]["output_ids"]  # sample j draws with seed + j


def test_batch_input_returns_a_list_in_order(engine_url):
    greedy = {"max_new_tokens": 6, "temperature": 0.0}
    answer = generate(engine_url, {"input_ids": [PROMPT, PROMPT[:3]], "sampling_params": greedy})
    alone = [generate(engine_url, {"input_ids": p, "sampling_params": greedy})["output_ids"]
             for p in (PROMPT, PROMPT[:3])]
    assert [a["output_ids"] for a in answer] == alone


def test_stream_sends_cumulative_chunks_then_done(engine_url, sglang_api_types):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 200, "temperature": 0.0,
                                                     "ignore_eos": True}, "return_logprob": True}
    chunks = stream_chunks(engine_url, body)
    conforms(sglang_api_types, {**body, "stream": True}, chunks)
    assert len(chunks) > 1
    for earlier, later in itertools.pairwise(chunks):
        assert later["output_ids"][: len(earlier["output_ids"])] == earlier["output_ids"]
        assert len(earlier["meta_info"]["output_token_logprobs"]) == len(earlier["output_ids"])
        assert earlier["meta_info"]["finish_reason"] is None
    final = generate(engine_url, body)
    assert chunks[-1]["output_ids"] == final["output_ids"] and chunks[-1]["text"] == final["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 200}
    streamed = chunks[-1]["meta_info"]["output_token_logprobs"]
    plain = final["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in streamed] == [e[1] for e in plain]
    assert [e[0] for e in streamed] == pytest.approx([e[0] for e in plain], abs=1e-5)


def test_stream_with_n_indexes_each_chunk(engine_url, sglang_api_types):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "n": 2}}
    chunks = stream_chunks(engine_url, body)
    conforms(sglang_api_types, {**body, "stream": True}, chunks)
    assert {c["index"] for c in chunks} == {0, 1}
    finals = [c for c in chunks if c["meta_info"]["finish_reason"] is not None]
    assert sorted(c["index"] for c in finals) == [0, 1]


def test_text_input_default_length_and_logprob_extras(engine_url, tiny_model_dir, sglang_api_types):
    tokenizer = load_model(str(tiny_model_dir)).tokenizer
    body = {"text": "the weather in the city", "sampling_params": {"temperature": 0.0, "ignore_eos": True},
            "return_logprob": True, "return_text_in_logprobs": True, "top_logprobs_num": 3,
            "return_prompt_token_ids": True}
    answer = generate(engine_url, body)
    conforms(sglang_api_types, body, answer)
    assert answer["prompt_token_ids"] == tokenizer("the weather in the city")["input_ids"]
    meta = answer["meta_info"]
    assert meta["completion_tokens"] == 24  # the engine's default_max_new_tokens
    first = meta["output_token_logprobs"][0]
    assert first[2] == tokenizer.decode([first[1]])
    top = meta["output_top_logprobs"][0]
    assert len(top) == 3 and top[0][1] == first[1] and top[0][0] == pytest.approx(first[0])


def test_max_new_tokens_zero_answers_at_once(engine_url):
    answer = generate(engine_url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0}})
    assert answer["output_ids"] == [] and answer["meta_info"]["finish_reason"] == {"type": "length",
                                                                                  "length": 0}
