"""The Responses API's tools on a chat template, which renders only functions: which request tools become
which chat functions (and what each function name stands for), the chat form of `tool_choice`, and the
arguments a tool call item of each kind is replayed with.

- `function` tools are offered as they are.
- A `namespace` groups function and custom tools; its tools are offered under Codex's canonical flat
  name `namespace__name` (so two namespaces may share a child name), and a call to one is answered with
  the child's own `name` and its `namespace`, the split Codex and OpenAI's clients read back.
- `custom` (freeform) tools and `local_shell` are client-run tools whose calls are not JSON functions:
  each is offered as a function of its input (`{"input": string}`; `{"command": [...], ...}`), and a
  call is answered as a `custom_tool_call` / `local_shell_call` item, replayed later as the same call.
- Hosted tools (web search, file search, code interpreter, ...) run on OpenAI's servers; this server
  cannot run them, so they are left out of the prompt rather than refusing the request. Client-run
  kinds this server does not map (`shell`, `apply_patch`) and unknown kinds are a 400.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from proxy.errors import OpenAIError

HOSTED_TOOLS = frozenset({
    "web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11",
    "file_search", "code_interpreter", "computer", "computer_use", "computer_use_preview",
    "image_generation", "mcp", "tool_search", "programmatic_tool_calling",
})
NAMESPACE_DELIMITER = "__"
CUSTOM_INPUT = "input"  # the one string parameter a custom tool is offered with
LOCAL_SHELL = "local_shell"
SHELL_FIELDS = ("command", "working_directory", "timeout_ms")  # what a local_shell call's action carries

ToolKind = Literal["function", "custom", "local_shell"]

LOCAL_SHELL_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "command": {"type": "array", "items": {"type": "string"},
                    "description": "The command to run and its arguments, one string each (argv)."},
        "working_directory": {"type": "string", "description": "The directory to run it in."},
        "timeout_ms": {"type": "integer", "description": "How long it may run, in milliseconds."},
    },
    "required": ["command"],
}


@dataclass(frozen=True, slots=True)
class ToolRef:
    """What a function name in the template stands for: a request tool's kind, name and namespace."""

    kind: ToolKind
    name: str
    namespace: str | None = None


def flat_name(name: str, namespace: str | None) -> str:
    """The template's name for a tool: its own name, or in a namespace Codex's canonical flat name (the
    underscores around the delimiter trimmed, as Codex joins them)."""
    if not namespace:
        return name
    return f"{namespace.rstrip('_')}{NAMESPACE_DELIMITER}{name.lstrip('_')}"


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """The chat functions a request's tools are offered as (None when it sent none)."""
    if tools is None:
        return None
    return [function for _ref, function in _offered(tools)]


def tool_refs(tools: list[Any] | None) -> dict[str, ToolRef]:
    """Each offered function's name → the request tool it stands for."""
    return {function["function"]["name"]: ref for ref, function in _offered(tools or [])}


def _offered(tools: list[Any]) -> Iterator[tuple[ToolRef, dict[str, Any]]]:
    for index, tool in enumerate(tools):
        kind = _kind(tool)
        if kind == "namespace":
            yield from _namespace(tool, f"tools[{index}]")
        elif kind not in HOSTED_TOOLS:
            yield _tool(tool, f"tools[{index}]", None)


def _namespace(tool: dict[str, Any], param: str) -> Iterator[tuple[ToolRef, dict[str, Any]]]:
    namespace = _name(tool, param)
    children = tool.get("tools")
    if not isinstance(children, list):
        raise _tool_error(param, "a namespace tool needs 'tools', a list of function and custom tools")
    for position, child in enumerate(children):
        yield _tool(child, f"{param}.tools[{position}]", namespace)


def _tool(tool: Any, param: str, namespace: str | None) -> tuple[ToolRef, dict[str, Any]]:
    kind = _kind(tool)
    if kind == "local_shell" and namespace is None:
        ref = ToolRef("local_shell", LOCAL_SHELL)
        function: dict[str, Any] = {"description": "Runs a shell command on the user's machine.",
                                    "parameters": LOCAL_SHELL_PARAMETERS}
    elif kind == "function":
        ref = ToolRef("function", _name(tool, param), namespace)
        function = {key: tool[key] for key in ("description", "parameters", "strict") if key in tool}
    elif kind == "custom":
        ref = ToolRef("custom", _name(tool, param), namespace)
        function = _custom_function(tool, param)
    else:
        offered = "function and custom" if namespace else "function, custom, namespace, local_shell"
        raise _tool_error(param, f"tools of type {kind!r} are not supported by this server; it runs "
                                 f"{offered} tools and leaves hosted tools out",
                          code="unsupported_tool_type")
    return ref, {"type": "function", "function": {"name": flat_name(ref.name, namespace), **function}}


def _custom_function(tool: dict[str, Any], param: str) -> dict[str, Any]:
    """A custom tool as a function of one string: its format (free text or a grammar) is described to
    the model, not enforced."""
    parameter = {"type": "string", "description": _format_description(tool.get("format"), param)}
    function: dict[str, Any] = {"parameters": {
        "type": "object", "properties": {CUSTOM_INPUT: parameter}, "required": [CUSTOM_INPUT],
        "additionalProperties": False,
    }}
    if "description" in tool:
        function = {"description": tool["description"], **function}
    return function


def _format_description(format_: Any, param: str) -> str:
    if format_ is None or (isinstance(format_, dict) and format_.get("type") == "text"):
        return "The tool's input, as free text."
    if isinstance(format_, dict) and format_.get("type") == "grammar":
        syntax, definition = format_.get("syntax"), format_.get("definition")
        if isinstance(syntax, str) and isinstance(definition, str):
            return f"The tool's input, as text in this {syntax} grammar:\n{definition}"
    raise _tool_error(f"{param}.format", "a custom tool's format must be {'type': 'text'} or "
                                         "{'type': 'grammar', 'syntax', 'definition'}")


def _kind(tool: Any) -> str | None:
    """A tool's (or tool choice's) `type`; None unless it is a string."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    return kind if isinstance(kind, str) else None


def _name(tool: dict[str, Any], param: str) -> str:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise _tool_error(param, f"a {tool.get('type')} tool needs 'name' as a non-empty string")
    return name


def _tool_error(param: str, message: str, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}.", "invalid_request_error", param=param, code=code)


def chat_tool_choice(tool_choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """A named function or custom tool (`{type, name, namespace?}`) becomes chat's `{type: function,
    function: {name}}` under its template name; an allowed-tools choice its mode (every offered tool
    reaches the template). Forcing a hosted tool, which is not in the prompt, is a 400."""
    if not isinstance(tool_choice, dict):
        return tool_choice
    kind = _kind(tool_choice)
    name = tool_choice.get("name")
    if kind in ("function", "custom") and isinstance(name, str):
        namespace = tool_choice.get("namespace")
        flat = flat_name(name, namespace if isinstance(namespace, str) else None)
        return {"type": "function", "function": {"name": flat}}
    if kind == "allowed_tools":
        return str(tool_choice.get("mode", "auto"))
    reason = "a hosted tool this server cannot run" if kind in HOSTED_TOOLS else "not supported"
    raise OpenAIError(400, f"tool_choice of type {kind!r} is {reason}.", "invalid_request_error",
                      param="tool_choice")


def custom_arguments(tool_input: str) -> str:
    """The arguments of the function a custom tool is offered as, for a call with this input."""
    return json.dumps({CUSTOM_INPUT: tool_input}, ensure_ascii=False)


def custom_input(arguments: str) -> str:
    """The input of a call to a custom tool: its `input` argument; arguments of another shape (the model
    is not constrained) are passed on as the raw text."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(parsed, dict) and isinstance(parsed.get(CUSTOM_INPUT), str):
        return str(parsed[CUSTOM_INPUT])
    return parsed if isinstance(parsed, str) else arguments


def shell_arguments(action: dict[str, Any]) -> str:
    """The arguments of the `local_shell` function for a call with this `exec` action."""
    return json.dumps({key: action[key] for key in SHELL_FIELDS if action.get(key) is not None},
                      ensure_ascii=False)


def shell_action(arguments: str) -> dict[str, Any] | None:
    """The `exec` action of a call to `local_shell`; None when the arguments name no command (a list of
    strings), and the call is answered as a plain function call instead."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return None
    command = parsed.get("command") if isinstance(parsed, dict) else None
    if not isinstance(command, list) or not command or not all(isinstance(part, str) for part in command):
        return None
    action: dict[str, Any] = {"type": "exec", "command": command, "timeout_ms": None,
                              "working_directory": None, "env": {}, "user": None}
    for key in ("timeout_ms", "working_directory"):
        if parsed.get(key) is not None:
            action[key] = parsed[key]
    return action
