"""proxy/workers/plan.py without servers: policy versions per token, a worker's answer read into a
choice, and an OpenAI request planned as an SGLang /generate request."""

from __future__ import annotations

import pytest

from proxy.errors import OpenAIError
from proxy.openai.schemas import ChatCompletionRequest
from proxy.tokenize import ChatTokenizer
from proxy.workers.plan import plan_generation, policy_version, read_choice, token_versions
from serving.errors import WorkerProtocolError
from tests.support.worker_answers import chunk


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
