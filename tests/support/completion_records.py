"""Completion records made by hand, for the unit tests of what is built from them (trajectories)."""

from __future__ import annotations

from storage.records import CompletionRecord


def completion(
    cid: str,
    prompt: list[int],
    output: list[int],
    *,
    parent: str | None = None,
    version: int = 0,
    finish: str = "stop",
    temperature: float = 0.7,
) -> CompletionRecord:
    """A completion of session "s" with made-up logprobs (-0.1, -0.2, ...) and versions counting up from
    `version`."""
    return CompletionRecord(
        id=cid,
        session_id="s",
        parent_id=parent,
        prompt_ids=prompt,
        output_ids=output,
        output_logprobs=[-0.1 * (i + 1) for i in range(len(output))],
        output_versions=[version + i for i in range(len(output))],
        finish_reason=finish,
        temperature=temperature,
        top_p=1.0,
        top_k=-1,
        request_json={},
        response_json={},
    )
