"""What a client builds from a streamed chat completion (the `openai` client's chunks): content,
reasoning, the finish reason and whole tool calls."""

from __future__ import annotations

from typing import Any


def assemble_stream(stream: Any) -> dict[str, Any]:
    """What a client builds from streamed chunks, checking each tool delta's shape on the way."""
    content, reasoning, finish = "", "", None
    calls: dict[int, dict[str, Any]] = {}
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for call in delta.tool_calls or ():
                if call.index not in calls:  # the first delta of a call: id, type, name, empty arguments
                    assert call.id and call.id.startswith("call_") and call.type == "function"
                    assert call.function.name and call.function.arguments == ""
                    calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
                else:  # later deltas: only the index and argument text
                    assert call.id is None and call.type is None and call.function.name is None
                    calls[call.index]["arguments"] += call.function.arguments
            finish = choice.finish_reason or finish
    return {"content": content, "reasoning": reasoning, "finish": finish,
            "calls": [calls[i] for i in sorted(calls)]}
