"""`FlywheelWorker`: the generation role on a Flywheel proxy. It answers GenerationTask (a chat call with
the prompt as the user message, or a legacy completion) and ChatTask with the `openai` client, each call
on the key of the task's session, and fills in the output and what rewards need to target it."""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Literal, cast

import openai

from integrations.gsm8k.rl_api import root_url_of
from integrations.scaffoldings.api import (
    AssistantMessage,
    ChatTask,
    GenerationTask,
    NativeGenerationController,
    TaskStatus,
    Worker,
)
from integrations.scaffoldings.rl_tasks import FlywheelTag
from integrations.scaffoldings.rl_worker import FlywheelRLWorker
from integrations.scaffoldings.sessions import (
    COMPLETION_ID,
    COMPLETION_TOKENS,
    ERROR,
    PROMPT_TOKEN_IDS,
    PROMPT_TOKENS,
    SESSION_ID,
    SessionRef,
    lease_session,
    results_of,
)

logger = logging.getLogger(__name__)

SESSION_HEADER = "x-flywheel-session-id"
GenerationApi = Literal["chat", "completions"]
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "frequency_penalty", "presence_penalty",
                    "logit_bias", "user")


class UnboundTaskError(RuntimeError):
    """A task reached a worker that has no session for it."""


def sampling_params(task: Any) -> dict[str, Any]:
    """The OpenAI request fields a task sets (None: the proxy's default), `top_k` through extra_body, and
    Flywheel's `return_token_ids` so the task gets its output token ids."""
    params = {name: value for name in _SAMPLING_FIELDS if (value := getattr(task, name, None)) is not None}
    if getattr(task, "stop", None):
        params["stop"] = task.stop
    if getattr(task, "n", 1) not in (None, 1):
        params["n"] = task.n
    extra: dict[str, Any] = {"return_token_ids": True}
    if getattr(task, "top_k", None) is not None:
        extra["top_k"] = task.top_k
    params["extra_body"] = extra
    return params


class FlywheelWorker(Worker):
    """Generation through the proxy at `base_url` (its root or /v1). A task bound to a session (by a
    `FlywheelTrajectoryMaker`) is served on that session's key; any other task on `api_key`, the session
    key this worker is bound to. `api="completions"` sends a GenerationTask's prompt to /v1/completions
    as it is, instead of as a chat's user message after `system_prompt`."""

    def __init__(
        self, base_url: str, api_key: str | None = None, *, model: str, system_prompt: str | None = None,
        api: GenerationApi = "chat", timeout_s: float = 600.0, max_retries: int = 2,
    ) -> None:
        if api not in ("chat", "completions"):
            raise ValueError(f"api must be 'chat' or 'completions', got {api!r}")
        self.model = model
        self.system_prompt = system_prompt
        self.api = api
        self._api_key = api_key
        self._client = openai.AsyncOpenAI(base_url=f"{root_url_of(base_url)}/v1",
                                          api_key=api_key or "unbound", timeout=timeout_s,
                                          max_retries=max_retries)

    def _session(self, task: Any) -> SessionRef:
        session = lease_session(task)
        if session is not None:
            return session
        if self._api_key is None:
            raise UnboundTaskError(
                f"a {type(task).__name__} is bound to no Flywheel session: run it under a "
                "FlywheelTrajectoryMaker, or give the FlywheelWorker a session key")
        return SessionRef(None, self._api_key)

    def _messages(self, task: GenerationTask) -> Any:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": task.input_str or ""}]

    async def generation_handler(self, task: GenerationTask) -> TaskStatus:
        session = self._session(task)
        client = self._client.with_options(api_key=session.api_key)
        try:
            if self.api == "chat":
                raw: Any = await client.chat.completions.with_raw_response.create(
                    model=self.model, messages=self._messages(task), **sampling_params(task))
            else:
                raw = await client.completions.with_raw_response.create(
                    model=self.model, prompt=task.input_str or "", **sampling_params(task))
        except openai.APIError as error:
            return _failed(task, session, error)
        response = raw.parse()
        choice = response.choices[0]
        text = choice.message.content if self.api == "chat" else choice.text
        _fill(task, raw.headers.get(SESSION_HEADER) or session.session_id, response, choice, text)
        return TaskStatus.SUCCESS

    async def chat_handler(self, task: ChatTask) -> TaskStatus:
        session = self._session(task)
        client = self._client.with_options(api_key=session.api_key)
        params = sampling_params(task)
        if task.tools:
            params["tools"] = [tool.to_dict() if hasattr(tool, "to_dict") else tool for tool in task.tools]
        try:
            raw = await client.chat.completions.with_raw_response.create(
                model=self.model, messages=cast(Any, task.messages_to_dict_content()), **params)
        except openai.APIError as error:
            return _failed(task, session, error)
        response = raw.parse()
        choice = response.choices[0]
        message = choice.message
        calls = [call.model_dump() for call in message.tool_calls or []] or None
        task.add_message(AssistantMessage(message.content, tool_calls=calls))
        _fill(task, raw.headers.get(SESSION_HEADER) or session.session_id, response, choice, message.content)
        task.prompt_tokens_num = results_of(task)[PROMPT_TOKENS] or 0
        task.completion_tokens_num = results_of(task)[COMPLETION_TOKENS] or 0
        return TaskStatus.SUCCESS

    async def async_shutdown(self) -> None:
        await self._client.close()

    task_handlers: ClassVar[dict[type, Any]] = {GenerationTask: generation_handler, ChatTask: chat_handler}


def _fill(task: Any, session_id: str | None, response: Any, choice: Any, text: str | None) -> None:
    extra = choice.model_extra or {}
    task.output_str = text or ""
    task.output_tokens = list(extra.get("token_ids") or [])
    task.finish_reason = choice.finish_reason
    usage = response.usage
    prompt_ids = extra.get("prompt_token_ids") or (response.model_extra or {}).get("prompt_token_ids")
    results_of(task).update({
        SESSION_ID: session_id,
        COMPLETION_ID: extra.get("completion_id") or response.id,
        PROMPT_TOKENS: usage.prompt_tokens if usage else None,
        COMPLETION_TOKENS: usage.completion_tokens if usage else None,
        PROMPT_TOKEN_IDS: list(prompt_ids or []),
    })


def _failed(task: Any, session: SessionRef, error: openai.APIError) -> TaskStatus:
    """A failed call leaves the task without output and with the error; the session stays usable."""
    logger.warning("session %s: the call failed: %s", session.session_id, error)
    results_of(task).update({SESSION_ID: session.session_id, ERROR: f"{type(error).__name__}: {error}"})
    return TaskStatus.WORKER_EXECEPTION


def flywheel_workers(
    base_url: str, admin_key: str, *, model: str, system_prompt: str | None = None,
    api: GenerationApi = "chat", timeout_s: float = 600.0,
) -> dict[Any, Worker]:
    """The workers a `FlywheelTrajectoryMaker` needs, by role: generation and the RL control API."""
    return {
        NativeGenerationController.WorkerTag.GENERATION: FlywheelWorker(
            base_url, model=model, system_prompt=system_prompt, api=api, timeout_s=timeout_s),
        FlywheelTag.RL: FlywheelRLWorker(base_url, admin_key),
    }
