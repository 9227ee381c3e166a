"""Our compatible Scaffolding layer (`integrations.scaffoldings.compat`) behaves as
`tensorrt_llm.scaffolding` does: a controller's `process` is a generator yielding task lists (run by
workers before it resumes) or a `ParallelProcess`; workers dispatch on the exact task type;
`ScaffoldingLlm` drives one controller clone per prompt; majority vote breaks ties towards the answer
given first; best-of-N takes the first highest score."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import pytest

from integrations.scaffoldings.compat import (
    BestOfNController,
    ChatTask,
    Controller,
    GenerationTask,
    MajorityVoteController,
    NativeGenerationController,
    ParallelProcess,
    ScaffoldingLlm,
    ScaffoldingOutput,
    SystemMessage,
    Task,
    TaskStatus,
    Worker,
)
from integrations.scaffoldings.compat.voting import best_index, digit_majority, extract_boxed, majority_answer
from tests.support.scaffoldings_workers import FixedScores, ScriptedGenerationWorker

GENERATION = NativeGenerationController.WorkerTag.GENERATION


def test_native_generation_fills_only_unset_fields_and_drops_unknown_keys(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        controller = NativeGenerationController({"max_tokens": 8, "temperature": 0.5, "beam_width": 3})
    assert controller.sampling_params == {"max_tokens": 8, "temperature": 0.5}
    assert "beam_width is not a field of GenerationTask" in caplog.text
    preset, blank = GenerationTask(input_str="a", temperature=1.2), GenerationTask(input_str="b")
    process = controller.process([preset, blank])
    assert next(process) == [preset, blank]
    assert [t.worker_tag for t in (preset, blank)] == [GENERATION, GENERATION]
    assert (preset.max_tokens, preset.temperature) == (8, 1.2)
    assert (blank.max_tokens, blank.temperature) == (8, 0.5)
    with pytest.raises(StopIteration):
        next(process)


def test_generate_runs_process_then_returns_the_task_output() -> None:
    generate = NativeGenerationController().generate("2 + 2 =")
    (task,) = next(generate)
    assert task.input_str == "2 + 2 ="
    task.output_str, task.output_tokens = " 4", [19]
    with pytest.raises(StopIteration) as stop:
        next(generate)
    assert stop.value.value == ScaffoldingOutput(" 4", [19])


def test_parallel_process_starts_one_generator_per_controller() -> None:
    tasks = [[GenerationTask(input_str="x")], [GenerationTask(input_str="y")]]
    parallel = ParallelProcess([NativeGenerationController(), NativeGenerationController()], tasks, [{}, {}])
    assert [next(gen) for gen in parallel.sub_gens] == tasks
    with pytest.raises(ValueError, match="as many"):
        ParallelProcess([NativeGenerationController()], tasks, [{}])


class EchoWorker(Worker):
    async def echo(self, task: GenerationTask) -> TaskStatus:
        task.output_str = f"echo: {task.input_str}"
        return TaskStatus.SUCCESS

    task_handlers = {GenerationTask: echo}  # noqa: RUF012


class OtherEchoWorker(EchoWorker):
    task_handlers = {GenerationTask: EchoWorker.echo}  # noqa: RUF012


def test_workers_dispatch_on_the_exact_task_type() -> None:
    worker, chat = EchoWorker(), ChatTask.create_from_prompt("hi", [SystemMessage("be brief")])
    assert chat.messages_to_dict_content() == [{"role": "system", "content": "be brief"},
                                               {"role": "user", "content": "hi"}]
    task = GenerationTask(input_str="hi")
    assert asyncio.run(worker.run_task(task)) == TaskStatus.SUCCESS and task.output_str == "echo: hi"
    assert asyncio.run(worker.run_task(chat)) == TaskStatus.WORKER_NOT_SUPPORTED  # a subclass is not enough
    worker.register_task_handler(ChatTask, EchoWorker.echo)
    assert asyncio.run(worker.run_task(chat)) == TaskStatus.SUCCESS
    assert asyncio.run(OtherEchoWorker().run_task(chat)) == TaskStatus.WORKER_NOT_SUPPORTED
    assert asyncio.run(Worker().run_task(task)) == TaskStatus.WORKER_NOT_SUPPORTED


def test_scaffolding_llm_serves_prompts_sync_and_async_then_closes_its_workers() -> None:
    worker = ScriptedGenerationWorker(reply=lambda task: task.input_str.upper(), delay_s=0.01)
    llm = ScaffoldingLlm(NativeGenerationController({"max_tokens": 4}), {GENERATION: worker})
    results = llm.generate(["a", "b", "c"])
    assert [r.outputs[0].text for r in results] == ["A", "B", "C"] and all(r.finished for r in results)
    assert llm.generate("d").outputs[0].text == "D"

    async def from_another_loop() -> str:
        result = await llm.generate_async("e")
        return str(result.outputs[0].text)

    assert asyncio.run(from_another_loop()) == "E"
    assert all(task.max_tokens == 4 for task in worker.seen)
    llm.shutdown()
    assert worker.closed
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate_async("f")


class Picky(Controller):
    """Generates, then fails on the prompt "boom"."""

    def process(self, tasks: list[Task], **kwargs: Any) -> Any:
        yield from NativeGenerationController().process(tasks)
        if tasks[0].input_str == "boom":  # type: ignore[attr-defined]
            raise ValueError("no answer to boom")


def test_a_failed_request_raises_its_own_error_and_spares_the_others() -> None:
    worker = ScriptedGenerationWorker(reply=lambda task: "ok", delay_s=0.01)
    with ScaffoldingLlm(Picky(), {GENERATION: worker}) as llm:
        failing, fine = llm.generate_async("boom"), llm.generate_async("calm")
        with pytest.raises(ValueError, match="no answer to boom"):
            failing.result(timeout=10)
        assert fine.result(timeout=10).outputs[0].text == "ok"
    with ScaffoldingLlm(NativeGenerationController(), {"elsewhere": worker}) as llm:
        with pytest.raises(LookupError, match=r"no worker for tag .*GENERATION.* of GenerationTask"):
            llm.generate("q")


def test_scaffolding_llm_runs_at_most_max_parallel_requests() -> None:
    worker = ScriptedGenerationWorker(reply=lambda task: "x", delay_s=0.05)
    with ScaffoldingLlm(NativeGenerationController(), {GENERATION: worker}) as llm:
        llm.max_parallel_requests = 2
        llm.generate([str(i) for i in range(6)])
    assert worker.most_running == 2


def test_majority_vote_ties_go_to_the_answer_given_first() -> None:
    assert majority_answer(["3", "5", "5", "3"]) == (0, "3")
    assert majority_answer([None, "5", "3", "3", "5", "3"]) == (2, "3")
    assert majority_answer([None, None]) == (0, None)
    assert extract_boxed("so \\boxed{\\frac{1}{2}} and \\boxed{42}") == "42"
    assert extract_boxed("\\boxed{7") is None and extract_boxed(None) is None
    assert digit_majority(["\\boxed{x}", "\\boxed{7}", "\\boxed{8}", "\\boxed{8}"]) == (2, "8")

    replies = ["so \\boxed{3}", "so \\boxed{5}", "so \\boxed{5}", "so \\boxed{3}"]
    worker = ScriptedGenerationWorker(replies)
    with ScaffoldingLlm(MajorityVoteController(NativeGenerationController(), 4), {GENERATION: worker}) as llm:
        output = llm.generate("what?").outputs[0]
    assert len(worker.seen) == 4 and len({id(t) for t in worker.seen}) == 4  # one copy per sample
    assert (output.text, output.token_ids) == ("so \\boxed{3}", [0])


def test_best_of_n_takes_the_first_highest_score() -> None:
    assert best_index([0.1, 0.9, 0.9]) == 1
    assert best_index([None, -math.inf, float("nan"), -5.0]) == 3
    with pytest.raises(ValueError, match="no scores"):
        best_index([])
    scores = FixedScores([0.2, 0.7, 0.7, -math.inf])
    worker = ScriptedGenerationWorker(["a", "b", "c", "d"])
    best_of = BestOfNController(NativeGenerationController(), scores, default_sample_num=4)
    with ScaffoldingLlm(best_of, {GENERATION: worker}) as llm:
        assert llm.generate("q").outputs[0].text == "b"
    # As upstream, process() draws max(sample_num=4, default_sample_num) samples.
    wrong = BestOfNController(NativeGenerationController(), FixedScores([1.0]), default_sample_num=2)
    with ScaffoldingLlm(wrong, {GENERATION: ScriptedGenerationWorker(["a", "b", "c", "d"])}) as llm:
        with pytest.raises(ValueError, match="expected 4 numbers"):
            llm.generate("q")


def test_clones_are_independent() -> None:
    inner = NativeGenerationController({"max_tokens": 3})
    vote = MajorityVoteController(inner, 3)
    twin = vote.clone()
    assert isinstance(twin, MajorityVoteController) and twin.default_sample_num == 3
    assert twin.generation_controller is not inner
    assert twin.generation_controller.sampling_params == {"max_tokens": 3}  # type: ignore[attr-defined]
