"""The engine's pure pieces: token choice, truncation, draws, version spans and request validation."""

from __future__ import annotations

import math

import pytest
import torch

from serving.engine.protocol import (
    TOP_K_ALL,
    BadRequest,
    ContractError,
    MalformedRequest,
    SamplingParamsWire,
    decode_body,
    plan_generate,
    validate_sampling,
)
from serving.engine.sampling import RowSampling, choose_tokens, draw, truncate_probs
from serving.engine.sequence import weight_version_spans

VOCAB = 8


def options(**kwargs):
    return validate_sampling(SamplingParamsWire(**kwargs), VOCAB)


def test_greedy_normalises_like_sglang():
    opts = options(temperature=0.0)
    assert opts.greedy and opts.temperature == 1.0 and opts.top_k == 1
    sampled = options(temperature=0.7, top_k=-1)
    assert not sampled.greedy and sampled.temperature == 0.7 and sampled.top_k == TOP_K_ALL


def test_logprobs_are_of_the_tempered_full_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0, -4.0],
                           [0.0, 3.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    rows = [RowSampling(options(temperature=0.5, top_k=2, top_p=0.5), [], torch.Generator().manual_seed(1)),
            RowSampling(options(temperature=0.0), [], None)]
    choice = choose_tokens(logits.clone(), rows)
    assert choice.token_ids[1] == 1  # greedy = argmax
    expected0 = torch.log_softmax(logits[0] / 0.5, -1)[choice.token_ids[0]].item()
    expected1 = torch.log_softmax(logits[1], -1)[1].item()  # greedy reports T=1
    assert choice.logprobs == pytest.approx([expected0, expected1], abs=1e-6)
    assert choice.token_ids[0] in (0, 1)  # top_k=2 keeps the two likeliest


def test_truncation_order_top_k_then_top_p_then_min_p():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    assert truncate_probs(probs, top_k=2, top_p=1.0, min_p=0.0).tolist() == pytest.approx([0.4, 0.3, 0, 0])
    assert truncate_probs(probs, top_k=TOP_K_ALL, top_p=0.6, min_p=0.0).tolist() == pytest.approx(
        [0.4, 0.3, 0, 0])  # 0.4 < 0.6 so the second token is still needed
    assert truncate_probs(probs, top_k=TOP_K_ALL, top_p=1.0, min_p=0.6).tolist() == pytest.approx(
        [0.4, 0.3, 0, 0])  # min_p keeps p >= 0.6 * 0.4
    assert truncate_probs(probs, top_k=TOP_K_ALL, top_p=0.1, min_p=0.0).tolist() == pytest.approx(
        [0.4, 0, 0, 0])  # the most likely token always survives


def test_draw_is_an_inverse_cdf_that_never_picks_a_zero():
    probs = torch.tensor([[0.5, 0.0, 0.5], [0.0, 1.0, 0.0], [0.2, 0.0, 0.8]])
    picked = draw(probs, torch.tensor([0.49, 0.99, 0.2]))
    assert picked.tolist() == [0, 1, 2]


def test_sampling_follows_the_distribution_and_the_seed():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1, 0, 0, 0, 0, 0]]) + 1e-9)
    opts = options(temperature=1.0)

    def run(seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return [choose_tokens(logits.clone(), [RowSampling(opts, [], gen)]).token_ids[0] for _ in range(2000)]
    first = run(7)
    assert first == run(7)
    assert first != run(8)
    share = first.count(0) / len(first)
    assert 0.65 < share < 0.75


def test_penalties_bias_and_blocked_tokens_change_the_distribution():
    logits = torch.zeros(1, VOCAB)
    opts = options(temperature=0.0, frequency_penalty=1.0, logit_bias={"3": 5.0})
    choice = choose_tokens(logits.clone(), [RowSampling(opts, [3, 3], None)])
    assert choice.token_ids == [3]  # bias 5 beats two counts of frequency penalty 1
    assert choice.logprobs[0] == pytest.approx(math.log(math.exp(3) / (math.exp(3) + 7)), abs=1e-5)
    blocked = choose_tokens(logits.clone(), [RowSampling(options(temperature=0.0, logit_bias={"3": 5.0}),
                                                         [], None, blocked_ids=(3,))])
    assert blocked.token_ids != [3]
    repeat = choose_tokens(torch.tensor([[2.0, 1.9, 0, 0, 0, 0, 0, 0]]),
                           [RowSampling(options(temperature=0.0, repetition_penalty=2.0), [0], None)])
    assert repeat.token_ids == [1]


def test_top_logprobs_are_the_best_alternatives():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, 0, 0, 0, 0]])
    choice = choose_tokens(logits.clone(), [RowSampling(options(temperature=0.0), [], None,
                                                        top_logprobs_num=2)])
    top = choice.top_logprobs[0]
    assert [token for _, token in top] == [1, 3]
    assert top[0][0] == pytest.approx(choice.logprobs[0])


def test_weight_version_spans_match_sglang():
    assert weight_version_spans([], "v0", 5) == (("v0", 0, 5),)
    assert weight_version_spans([("v0", 3)], "v1", 7) == (("v0", 0, 3), ("v1", 3, 7))
    assert weight_version_spans([("v0", 3), ("v1", 3)], "v2", 4) == (("v0", 0, 3), ("v2", 3, 4))
    assert weight_version_spans([("v0", 2), ("v0", 4)], "v1", 4) == (("v0", 0, 4),)


def test_unknown_sampling_key_is_refused_with_sglangs_own_text(sglang_api_types):
    body = b'{"input_ids": [1], "sampling_params": {"max_tokens": 5}}'
    with pytest.raises(ContractError) as ours:
        decode_body(body)
    with pytest.raises(sglang_api_types.JsonContractError) as theirs:
        sglang_api_types.decode_GenerateRequest({"input_ids": [1], "sampling_params": {"max_tokens": 5}})
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("body, error", [
    (b"{", MalformedRequest),
    (b"[1, 2]", MalformedRequest),
    (b'{"input_ids": [1], "sampling_params": {"temperature": "hot"}}', ContractError),
    (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 1.5}}', ContractError),
    (b'{"input_ids": [1], "stream": "yes"}', ContractError),
    (b'{"input_ids": ["a"]}', ContractError),
])
def test_decode_body_refusals(body, error):
    with pytest.raises(error):
        plan_generate(decode_body(body), vocab_size=VOCAB)


@pytest.mark.parametrize("body", [
    b"{}",
    b'{"text": "a", "input_ids": [1]}',
    b'{"input_ids": []}',
    b'{"input_ids": [99]}',
    b'{"input_ids": [1], "sampling_params": {"temperature": -1}}',
    b'{"input_ids": [1], "sampling_params": {"top_p": 0}}',
    b'{"input_ids": [1], "sampling_params": {"top_k": 0}}',
    b'{"input_ids": [1], "sampling_params": {"n": 0}}',
    b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 3}}',
    b'{"input_ids": [1], "sampling_params": {"json_schema": "{}", "regex": "a"}}',
    b'{"input_ids": [1], "sampling_params": {"logit_bias": {"99": 1.0}}}',
    b'{"input_ids": [1], "image_data": "x.png"}',
    b'{"input_ids": [1], "logprob_start_len": 0}',
])
def test_plan_refusals(body):
    with pytest.raises(BadRequest):
        plan_generate(decode_body(body), vocab_size=VOCAB)


def test_plan_expands_batches_and_n():
    plan = plan_generate(decode_body(b'{"input_ids": [[1, 2], [3]], "rid": ["a", "b"], "sampling_params": '
                                     b'{"n": 2, "sampling_seed": 10, "temperature": 1.0}}'), vocab_size=VOCAB)
    assert plan.as_list
    assert [s.rid for s in plan.sequences] == ["a_0", "a_1", "b_0", "b_1"]
    assert [s.seed for s in plan.sequences] == [10, 11, 10, 11]
    assert [s.input_ids for s in plan.sequences] == [[1, 2], [1, 2], [3], [3]]
    single = plan_generate(decode_body(b'{"input_ids": [1], "rid": "x", "unknown_top_level": 1}'),
                           vocab_size=VOCAB)
    assert not single.as_list and single.sequences[0].rid == "x"
