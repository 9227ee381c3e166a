"""Proxy sub-config (`proxy` in the root config): where the OpenAI-compatible proxy listens and how it
answers and records."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from proxy.parsers import reasoning_parser, tool_call_parser
from rewards.config import FinalizerConfig

DEFAULT_MAX_SESSIONS = 4096  # conversation trees held in memory (proxy.conversation_sessions_max)
DEFAULT_MAX_NODES = 20_000  # completions per session tree (proxy.conversation_nodes_max)


class ProxyConfig(BaseModel):
    """The OpenAI-compatible proxy (`flywheel proxy`)."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    """Interface to listen on; 0.0.0.0 to accept connections from other machines."""
    port: int = Field(8000, ge=0, le=65535)
    """Port to listen on (0 picks a free one; tests only)."""
    public_base_url: str | None = None
    """The OpenAI base URL handed to agents (`/rl/v1/sessions` returns it as `base_url`);
    None means http://{host}:{port}/v1."""
    default_max_tokens: int = Field(4096, ge=1)
    """Output length when a request gives neither max_tokens nor max_completion_tokens; always bounded
    by what is left of the context after the prompt."""
    context_length: int | None = Field(None, ge=16)
    """Longest prompt + output in tokens. None takes serving's configured context length, else the
    model's max_position_embeddings. A prompt that leaves no room is a 400 context_length_exceeded;
    a requested max_tokens beyond the room left is lowered to fit."""
    record_batch_max: int = Field(256, ge=1)
    """Most completions written in one transaction by the recorder's group commit."""
    tokenize_in_thread_chars: int = Field(8192, ge=0)
    """Render and tokenize prompts of more characters than this in a worker thread, so long prompts
    do not stall the event loop; shorter ones are faster inline."""
    worker_failure_cooldown_s: float = Field(5.0, ge=0)
    """Without health checks (`health_check_interval_s: 0`), a worker whose call failed is out of rotation
    (tried last) for this long."""
    health_check_interval_s: float = Field(2.0, ge=0)
    """Seconds between `GET /health` polls of every worker. A worker failing one (or a call to it failing:
    connection refused or dropped, a 5xx) is out of rotation until a poll passes. 0 disables polling:
    a failed worker then comes back after `worker_failure_cooldown_s`."""
    sticky_slack: int = Field(4, ge=0)
    """Sticky routing: a session's calls go to the worker that served it last (its prefix cache) unless
    that worker is down or runs more than this many requests beyond the least busy worker."""
    sticky_sessions_max: int = Field(100_000, ge=1)
    """Sessions whose worker is remembered for sticky routing; the least recently used are forgotten."""
    resume_max_attempts: int = Field(20, ge=0)
    """A generation interrupted by a weight push (finish_reason abort) or a lost worker is re-issued as
    prompt + tokens so far at most this many times (per choice); then it is recorded as aborted."""
    resume_timeout_s: float = Field(600.0, ge=0)
    """Longest time spent re-issuing one interrupted choice (waiting while workers are paused)."""
    key_cache_ttl_s: float = Field(2.0, ge=0)
    """How long a key found valid is trusted without asking the database again. Sessions ended or
    keys rebound through this proxy's RL API stop working at once regardless; a change made by
    another process (a second proxy, the CLI) or the finalizer's idle-session expiry takes up to this
    long. 0 asks the database on every call."""
    tool_call_parser: str = "hermes"
    """How tool calls are read from generated text when a request offers tools (SGLang's
    `--tool-call-parser`): `hermes` (Qwen/Hermes `<tool_call>{json}</tool_call>`) or `none` (all text
    is content). Only the response changes; the recorded tokens are the generated ones."""
    reasoning_parser: str | None = None
    """How reasoning is split from the answer into `reasoning_content` (SGLang's `--reasoning-parser`):
    `qwen3` (`<think>…</think>` when the output or the prompt's end opens it) or `deepseek-r1` (the
    output always starts inside reasoning, up to `</think>`). None leaves the text whole."""
    drift_check_every: int = Field(16, ge=0)
    """Compare one chained conversation turn in this many with a fresh render of its messages (the
    `flywheel_proxy_conversation_drift` metric); 1 checks every turn, 0 never. The check runs in the
    background beside the generation, off the answer's path, but costs a full render of the whole
    conversation: checking every turn would make a T-turn session cost O(T²) tokenizer work again, the
    cost chaining exists to avoid. A sample is enough for a diagnostic."""
    conversation_sessions_max: int = Field(DEFAULT_MAX_SESSIONS, ge=1)
    """Sessions whose conversation trees (token-exact multi-turn chaining: docs/architecture.md,
    "The token-exact rule") stay in memory,
    least recently used first out; a session that dropped out is reloaded from the database on its next
    call, so this bounds memory, never correctness."""
    conversation_nodes_max: int = Field(DEFAULT_MAX_NODES, ge=1)
    """Completions a session's tree keeps in memory: beyond this the oldest leaves (finished
    conversations' last turns) are forgotten; a call that extends a forgotten turn reloads the tree."""
    gc_freeze: bool = True
    """Once started, exempt everything allocated so far (tokenizer, libraries) from Python's cyclic
    garbage collector (`gc.freeze`): full collections then walk only what requests allocate, instead of
    stalling every request in flight for tens of milliseconds."""
    log_requests: bool = False
    """Log one line per request (method, path, status, latency, request id)."""
    otel_telemetry: bool = False
    """FastAPI's OpenTelemetry spans, metrics and logs per request (exported only where OTel providers
    are configured). Off by default: the proxy has its own Prometheus metrics, and even unexported,
    FastAPI asks the environment for OTel providers on every request, which shows in profiles."""
    finalizer: FinalizerConfig = Field(default_factory=FinalizerConfig)
    """The session finalizer the proxy runs: turn discount, missing rewards, session TTL, sweeps."""

    @field_validator("tool_call_parser")
    @classmethod
    def _known_tool_call_parser(cls, name: str) -> str:
        tool_call_parser(name)
        return name

    @field_validator("reasoning_parser")
    @classmethod
    def _known_reasoning_parser(cls, name: str | None) -> str | None:
        reasoning_parser(name)
        return name

    def base_url(self) -> str:
        """The OpenAI base URL agents should use."""
        if self.public_base_url:
            return self.public_base_url.rstrip("/")
        return f"http://{self.host}:{self.port}/v1"
