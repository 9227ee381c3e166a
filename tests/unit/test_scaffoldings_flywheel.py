"""The Flywheel side of the Scaffolding integration, without a proxy: session pools (every sample a
session of its own, however controllers copy tasks), the majority vote on GSM8K answers and best-of-N
over sessions, the reward controller's settings, the choice of backend, and the example's reward."""

from __future__ import annotations

import copy
import math

import pytest

from integrations.gsm8k.scoring import extract_answer
from integrations.scaffoldings import api
from integrations.scaffoldings.compat import GenerationTask, NativeGenerationController, ScaffoldingLlm
from integrations.scaffoldings.controllers import FlywheelBestOfNController, FlywheelMajorityVoteController
from integrations.scaffoldings.gsm8k import ExampleSettings, gsm8k_reward, trajectory_maker
from integrations.scaffoldings.reward_controller import FlywheelRewardController
from integrations.scaffoldings.sessions import (
    COMPLETION_ID,
    CONTROLLER_NOTES,
    SESSION_ID,
    SessionPool,
    SessionPoolExhausted,
    SessionRef,
    bind,
    lease_session,
    results_of,
    task_data_of,
)
from integrations.scaffoldings.trajectory import FlywheelTrajectoryMaker
from tests.support.scaffoldings_workers import FixedScores, OnTask, ScriptedGenerationWorker

GENERATION = NativeGenerationController.WorkerTag.GENERATION


def pool_of(size: int) -> SessionPool:
    return SessionPool("grp-1", [SessionRef(f"sess-{i}", f"key-{i}") for i in range(size)])


def bound_task(pool: SessionPool, prompt: str = "How many?") -> GenerationTask:
    task = GenerationTask.create_from_prompt(prompt)
    bind(task, pool, {"answer": "5"})
    return task


def test_copies_of_a_bound_task_each_lease_a_session_of_the_shared_pool() -> None:
    pool = pool_of(3)
    task = bound_task(pool)
    first, second = copy.deepcopy(task), copy.deepcopy(task)
    assert task_data_of(first) == {"answer": "5"}
    assert [lease_session(t) for t in (first, second)] == pool.sessions[:2]
    assert lease_session(first) == pool.sessions[0]  # a task keeps its session
    later = copy.deepcopy(first)  # a copy made after the lease continues that session
    assert lease_session(later) == pool.sessions[0]
    assert pool.leased_tasks() == [first, second] and pool.unleased() == pool.sessions[2:]
    assert lease_session(task) == pool.sessions[2]
    with pytest.raises(SessionPoolExhausted, match="group grp-1 has 3 sessions"):
        lease_session(copy.deepcopy(bound_task(pool)))
    assert lease_session(GenerationTask(input_str="unbound")) is None


def test_majority_vote_on_gsm8k_answers_gives_every_sample_a_session() -> None:
    replies = ["It is 4.\n#### 4", "The answer is 5.", "5 apples in all", "#### 4"]
    worker, pool = ScriptedGenerationWorker(replies, lease=True), pool_of(4)
    task = bound_task(pool)
    vote = FlywheelMajorityVoteController(NativeGenerationController(), 4, answer_of=extract_answer)
    assert isinstance(vote.clone(), FlywheelMajorityVoteController)
    with ScaffoldingLlm(OnTask(vote, task), {GENERATION: worker}) as llm:
        output = llm.generate("any").outputs[0]
    assert [results_of(t)[SESSION_ID] for t in worker.seen] == ["sess-0", "sess-1", "sess-2", "sess-3"]
    assert pool.leased_tasks() == worker.seen
    notes = results_of(task)[CONTROLLER_NOTES]
    assert notes == {"vote": "4", "answers": ["4", "5", "5", "4"], "index": 0}  # 4 and 5 tie: 4 came first
    assert output.text == task.output_str == replies[0] and results_of(task)[COMPLETION_ID] == "cmpl-0"


def test_best_of_n_takes_the_first_best_scored_sample() -> None:
    worker, pool = ScriptedGenerationWorker(["a", "b", "c"], lease=True), pool_of(3)
    task = bound_task(pool)
    scores = FixedScores([0.5, -math.inf, 0.5])
    best = FlywheelBestOfNController(NativeGenerationController(), scores, 3)
    assert isinstance(best.clone(), FlywheelBestOfNController)
    with ScaffoldingLlm(OnTask(best, task), {GENERATION: worker}) as llm:
        assert llm.generate("any").outputs[0].text == "a"
    assert scores.scored == worker.seen == pool.leased_tasks()
    assert results_of(task)[COMPLETION_ID] == "cmpl-0"
    assert results_of(task)[CONTROLLER_NOTES] == {"scores": [0.5, None, 0.5], "index": 0}
    short = FlywheelBestOfNController(NativeGenerationController(), FixedScores([1.0]), 2)
    worker = ScriptedGenerationWorker(["a", "b"], lease=True)
    with ScaffoldingLlm(OnTask(short, bound_task(pool_of(2))), {GENERATION: worker}) as llm:
        with pytest.raises(ValueError, match="gave 1 scores for 2 samples"):
            llm.generate("any")


def test_reward_controller_takes_exactly_one_way_to_reward() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        FlywheelRewardController()
    with pytest.raises(ValueError, match="exactly one"):
        FlywheelRewardController(hook="math", reward_fn=gsm8k_reward)
    with pytest.raises(ValueError, match="target"):
        FlywheelRewardController(reward_fn=gsm8k_reward, target="group")  # type: ignore[arg-type]
    hook = FlywheelRewardController(hook={"hook": "math", "args": {"format_bonus": 0.1}})
    assert hook.hook_source == "hook:math"
    assert hook.session_hooks() == [{"hook": "math", "args": {"format_bonus": 0.1}}]
    named = FlywheelRewardController(hook={"hook": "exact", "name": "strict"})
    assert named.hook_source == "hook:strict" and named.describe() == "hook:strict"
    local = FlywheelRewardController(reward_fn=gsm8k_reward, source="mine")
    assert (local.hook_source, local.session_hooks(), local.describe()) == (None, [], "local:mine")


def test_gsm8k_reward_in_areals_shape() -> None:
    value, details = gsm8k_reward("q", "So 3 + 2 = 5.\n#### 5", [1], [2], answer="5", question="q")
    assert value == pytest.approx(1.1)
    assert details == {"predicted": "5", "gold": "5", "correct": True, "formatted": True}
    assert gsm8k_reward("q", "#### 6", [], [], answer="5", format_bonus=0.5)[0] == pytest.approx(0.5)
    assert gsm8k_reward("q", "I think 5", [], [], answer="5")[0] == pytest.approx(1.0)


def test_the_example_builds_each_controller_with_one_session_per_sample() -> None:
    task_for = {"q": {"answer": "1"}}.__getitem__
    plain = trajectory_maker(ExampleSettings(controller="plain", samples=3), task_for)
    assert (plain.rollouts, plain.samples_per_rollout, plain.group_size) == (3, 1, 3)
    for kind, cls in (("majority", FlywheelMajorityVoteController), ("best-of-n", FlywheelBestOfNController)):
        maker = trajectory_maker(ExampleSettings(controller=kind, samples=5, reward="local"), task_for)
        assert isinstance(maker.controller, cls) and maker.group_size == 5
        assert maker.controller_kwargs == {"sample_num": 5}
        assert maker.reward_controller.hook is None
    with pytest.raises(ValueError, match="controller must be one of"):
        ExampleSettings(controller="beam")
    with pytest.raises(ValueError, match=">= 1"):
        FlywheelTrajectoryMaker(NativeGenerationController(), FlywheelRewardController(hook="math"),
                                task_for=task_for, rollouts=0)


def test_the_backend_is_chosen_by_scaffolding_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(api.BACKEND_ENV, "compat")
    assert api.chosen_backend() == api.COMPAT
    monkeypatch.setenv(api.BACKEND_ENV, "trtllm")
    with pytest.raises(ValueError, match="choose one of auto, tensorrt_llm, compat"):
        api.chosen_backend()
    monkeypatch.delenv(api.BACKEND_ENV)
    installed = api.tensorrt_llm_available()
    assert api.chosen_backend() == (api.TENSORRT_LLM if installed else api.COMPAT) == api.BACKEND
    if not installed:
        monkeypatch.setenv(api.BACKEND_ENV, "tensorrt_llm")
        with pytest.raises(ValueError, match="tensorrt_llm is not installed"):
            api.chosen_backend()
