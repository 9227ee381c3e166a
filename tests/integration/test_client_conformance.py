"""Our wire bodies against sglang 0.5.23's own schema, and the scripted worker's answers too.

`/generate` and `/abort_request` bodies go through the generated decoders of `api_types.py` (the
server's 400 gate). The weight-update and pause bodies have no generated decoder: they are checked
against the msgspec structs of the wheel's `io_struct.py`, read as source (importing it needs all of
sglang). Decoders that ignore unknown keys are backed by an explicit key check.
"""

from __future__ import annotations

import ast
import asyncio
import zipfile
from collections.abc import AsyncIterator, Sequence
from types import ModuleType
from typing import Any

import pytest

from serving.client import GenerateRequest, SamplingParams, SGLangClient
from serving.config import ClientConfig
from tests.support.scripted_worker import ScriptedWorker, default_token_fn, eventually
from tests.support.sglang_schema import default_cache_dir

CONFIG = ClientConfig(max_retries=0)


@pytest.fixture
async def worker() -> AsyncIterator[ScriptedWorker]:
    async with ScriptedWorker() as running:
        yield running


@pytest.fixture
async def client(worker: ScriptedWorker) -> AsyncIterator[SGLangClient]:
    async with SGLangClient(worker.url, CONFIG) as sglang:
        yield sglang


def fields_of(api: ModuleType, struct: str) -> set[str]:
    return set(getattr(api, struct).__struct_fields__)


def every_sampling_param() -> SamplingParams:
    return SamplingParams(
        max_new_tokens=8, min_new_tokens=1, temperature=0.7, top_p=0.9, top_k=-1, min_p=0.05,
        frequency_penalty=0.1, presence_penalty=0.2, repetition_penalty=1.1, stop=["\n\n", "Observation:"],
        stop_token_ids=[2, 3], stop_regex="END$", ignore_eos=False, skip_special_tokens=False,
        spaces_between_special_tokens=True, no_stop_trim=True, n=2, json_schema=None, regex=None,
        ebnf=None, structural_tag=None, stream_interval=1, logit_bias={"5": -1.0}, sampling_seed=1234,
        custom_params={"k": 1},
    )


REQUESTS: list[GenerateRequest | dict[str, Any]] = [
    GenerateRequest(
        input_ids=[1, 2, 3], sampling_params=SamplingParams(max_new_tokens=4), return_logprob=True
    ),
    GenerateRequest(
        input_ids=[7, 8], sampling_params=every_sampling_param(), return_logprob=True, rid="c-1",
        logprob_start_len=-1, top_logprobs_num=2, return_text_in_logprobs=False,
        return_prompt_token_ids=True, priority=0,
    ),
    GenerateRequest(text="hello", sampling_params=SamplingParams(max_new_tokens=2, n=3, temperature=0.0)),
    GenerateRequest(input_ids=[[1, 2], [3, 4]], sampling_params=SamplingParams(max_new_tokens=2)),
    {"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 3, "sampling_seed": 9},
     "return_logprob": True},
]


def test_schema_rejects_what_sglang_rejects(sglang_api_types: ModuleType) -> None:
    """The validator used below is strict where the server is: else the other tests prove nothing."""
    api = sglang_api_types
    for bad in ({"max_tokens": 3}, {"seed": 1}, {"max_new_tokens": "3"}):
        with pytest.raises(api.JsonContractError):
            api.decode_GenerateRequest({"input_ids": [1], "sampling_params": bad})


def test_sampling_params_use_sglangs_key_names(sglang_api_types: ModuleType) -> None:
    ours, theirs = set(SamplingParams.__struct_fields__), fields_of(sglang_api_types, "SamplingParams")
    assert ours <= theirs, ours - theirs
    assert set(GenerateRequest.__struct_fields__) <= fields_of(sglang_api_types, "GenerateRequest")


@pytest.mark.parametrize("stream", [False, True])
async def test_generate_bodies_validate(
    sglang_api_types: ModuleType, client: SGLangClient, worker: ScriptedWorker, stream: bool
) -> None:
    api = sglang_api_types
    for generate_request in REQUESTS:
        if stream:
            async for _ in client.generate_stream(generate_request):
                pass
        else:
            await client.generate(generate_request)
    bodies = [r.body for r in worker.requests_to("/generate")]
    assert len(bodies) == len(REQUESTS)
    for body in bodies:
        decoded = api.decode_GenerateRequest(body)  # raises JsonContractError like the server's 400
        assert set(body) <= fields_of(api, "GenerateRequest")
        assert bool(decoded.stream) is stream
        assert all(value is not None for value in body.values())
        assert all(value is not None for value in body.get("sampling_params", {}).values())


async def test_abort_bodies_validate(
    sglang_api_types: ModuleType, client: SGLangClient, worker: ScriptedWorker
) -> None:
    api = sglang_api_types
    await client.abort_request(rid="r-1")
    await client.abort_request(abort_all=True)
    for recorded in worker.requests_to("/abort_request"):
        api.decode_AbortRequest(recorded.body)  # a null rid would be refused here
        assert set(recorded.body) <= fields_of(api, "AbortRequest")


# ---- bodies with no generated decoder: io_struct.py's msgspec structs --------------------------------


def io_struct_fields(class_name: str) -> dict[str, str]:
    """Field name -> annotation source of an io_struct.py class (with BaseReq's), from the cached wheel."""
    wheels = sorted(default_cache_dir().glob("sglang-*.whl"))
    if not wheels:
        pytest.skip("sglang 0.5.23 wheel not in the cache (only api_types.py is)")
    with zipfile.ZipFile(wheels[0]) as wheel:
        tree = ast.parse(wheel.read("sglang/srt/managers/io_struct.py"))
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    fields: dict[str, str] = {}
    for name in ("BaseReq", class_name):
        for statement in classes[name].body:
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                fields[statement.target.id] = ast.unparse(statement.annotation)
    return fields


def matches_annotation(value: Any, annotation: str) -> bool:
    kinds = {"str": str, "bool": bool, "int": int, "Optional[str]": (str, type(None))}
    if annotation.startswith("Literal["):
        return value in ast.literal_eval(annotation.removeprefix("Literal"))
    return isinstance(value, kinds[annotation])


async def test_weight_update_pause_continue_bodies_match_io_struct(
    sglang_api_types: ModuleType, client: SGLangClient, worker: ScriptedWorker
) -> None:
    await client.update_weights_from_disk(
        "/ckpt/3", weight_version=3, flush_cache=False, abort_all_requests=True
    )
    await client.update_weights_from_disk("/ckpt/4", weight_version=None)
    for mode in ("abort", "retract", "in_place"):
        await client.pause_generation(mode)  # type: ignore[arg-type]
    await client.continue_generation()
    expected = {
        "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
        "/pause_generation": "PauseGenerationReqInput",
        "/continue_generation": "ContinueGenerationReqInput",
    }
    checked = 0
    for path, struct in expected.items():
        fields = io_struct_fields(struct)
        for recorded in worker.requests_to(path):
            assert set(recorded.body) <= set(fields), (path, set(recorded.body) - set(fields))
            for key, value in recorded.body.items():
                assert matches_annotation(value, fields[key]), (path, key, value, fields[key])
            checked += 1
    assert checked == 6
    assert "model_path" in worker.requests_to("/update_weights_from_disk")[1].body


# ---- the scripted worker speaks sglang's response schema ------------------------------------------


def assert_generate_response(api: ModuleType, answer: dict[str, Any]) -> None:
    decoded = api.decode_GenerateResponse(answer)
    assert set(answer) <= fields_of(api, "GenerateResponse")
    assert set(answer["meta_info"]) <= fields_of(api, "GenerateMetaInfo"), set(answer["meta_info"])
    reason = decoded.meta_info.finish_reason
    if reason is not None:  # an unknown shape would pass through as a plain dict
        assert isinstance(reason, api.FinishStop | api.FinishLength | api.FinishAbort), reason
    for span in answer["meta_info"].get("weight_versions", []):
        api.decode_WeightVersionSpan(span)


async def test_scripted_worker_answers_validate(
    sglang_api_types: ModuleType, client: SGLangClient, worker: ScriptedWorker
) -> None:
    api = sglang_api_types
    answers: list[dict[str, Any]] = []
    for generate_request in REQUESTS:
        result = await client.generate(generate_request)
        answers.extend(result if isinstance(result, list) else [result])
        async for chunk in client.generate_stream(generate_request):
            answers.append(chunk)
    first = answers[0]
    prompt = SamplingParams(max_new_tokens=4)
    answers.append(await client.generate(GenerateRequest(
        input_ids=[1, 2, 3], sampling_params=SamplingParams(stop_token_ids=[first["output_ids"][1]])
    )))
    answers.append(await client.generate(GenerateRequest(
        input_ids=[1, 2, 3], sampling_params=SamplingParams(stop=first["text"][2:3], max_new_tokens=4)
    )))
    await client.pause_generation("in_place")
    held = asyncio.create_task(client.generate(GenerateRequest(input_ids=[1], sampling_params=prompt)))
    await eventually(lambda: worker.in_flight == 1)
    await client.abort_request(abort_all=True)
    answers.append(await held)

    kinds = {a["meta_info"]["finish_reason"]["type"] for a in answers if a["meta_info"]["finish_reason"]}
    assert kinds == {"length", "stop", "abort"}
    for answer in answers:
        assert_generate_response(api, answer)


async def test_weight_change_mid_request_reports_spans(
    sglang_api_types: ModuleType, client: SGLangClient, worker: ScriptedWorker
) -> None:
    """Weights swapped after three tokens: 0.5.23 reports per-run `weight_versions`."""

    def pause_after_third_token(prompt: Sequence[int], position: int, index: int, seed: int) -> int:
        if position == 2:
            worker.paused_mode = "in_place"
        return default_token_fn(prompt, position, index, seed)

    worker.token_fn = pause_after_third_token
    pending = asyncio.create_task(
        client.generate({"input_ids": [1], "sampling_params": {"max_new_tokens": 5}})
    )
    await eventually(lambda: worker.paused_mode is not None)
    await client.update_weights_from_disk("/ckpt/9", weight_version=9)
    await client.continue_generation()
    answer = await asyncio.wait_for(pending, 5)
    assert answer["meta_info"]["weight_version"] == "9"
    assert answer["meta_info"]["weight_versions"] == [
        {"version": "default", "start": 0, "end": 3},
        {"version": "9", "start": 3, "end": 5},
    ]
    assert_generate_response(sglang_api_types, answer)


async def test_model_info_answer_validates(sglang_api_types: ModuleType, client: SGLangClient) -> None:
    info = await client.model_info()
    decoded = sglang_api_types.decode_GetModelInfoResponse(info)
    assert decoded.weight_version == "default"
    assert set(info) <= fields_of(sglang_api_types, "GetModelInfoResponse")
