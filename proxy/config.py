"""Proxy sub-config (`proxy` in the root config): where the OpenAI-compatible proxy listens and how it
answers and records."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from proxy.online_config import OnlineConfig
from proxy.parsers import reasoning_parser, tool_call_parser
from proxy.privacy import PrivacyConfig
from rewards.config import FinalizerConfig

DEFAULT_MAX_SESSIONS = 4096  # conversation trees held in memory (proxy.conversation_sessions_max)
DEFAULT_MAX_NODES = 20_000  # completions per session tree (proxy.conversation_nodes_max)


class LimitsConfig(BaseModel):
    """What one request may ask of the proxy (`proxy.limits`). Each limit is checked before the work it
    bounds (the key before the body is read, the body's size before it is buffered, a prompt's length
    before it is tokenized), so one bad client is refused cheaply instead of slowing every other."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(32 * 2**20, ge=1024)
    """Largest request body in bytes, for every POST (the OpenAI and the RL API). A larger one is a 413
    `request_too_large`: refused from its Content-Length before any of it is read, or, sent without one
    (chunked), as soon as what was read passes the limit; nothing beyond it is buffered. 32 MiB holds
    the longest prompt `max_prompt_chars` allows in any encoding, with room for tools."""
    max_json_depth: int = Field(64, ge=2, le=512)
    """Deepest nesting of arrays and objects in a JSON body; deeper is a 400 `json_too_deep`, checked on
    the decoded body before validation. Real requests, tool schemas included, stay far below it; it
    keeps recursive code (validation, the chat template's JSON, storage) away from Python's recursion
    limit."""
    max_prompt_chars: int = Field(4_000_000, ge=1)
    """Most characters of text in one call's prompt, counted before tokenization: every message of a
    chat call (content, reasoning, tool-call arguments), the input items and instructions of a Responses
    call, every text prompt of a legacy call. More is a 400 `prompt_too_long` naming the field. Four
    million characters is about a million tokens of English, beyond any served context; after
    tokenization the context length bounds the prompt in tokens (400 `context_length_exceeded`)."""
    max_n: int = Field(128, ge=1)
    """Most choices (`n`) one prompt may ask for."""
    max_prompts: int = Field(256, ge=1)
    """Most prompts in one legacy completions call (a batch)."""
    max_choices: int = Field(1024, ge=1)
    """Most choices one call generates in all, `n` × the prompts of a legacy batch: each is a generation
    on a worker and a recorded completion."""
    max_top_logprobs: int = Field(20, ge=0)
    """Most alternatives per token: chat's and the Responses API's `top_logprobs`, legacy completions'
    `logprobs` (which OpenAI caps at 5 in any case)."""
    max_rl_json_bytes: int = Field(256 * 1024, ge=2)
    """Largest `task`, `metadata` or reward `details` the RL API stores (AReaL's `task_id` too), in
    bytes of its compact JSON with non-ASCII characters escaped, as it is stored. A larger one is a 413
    `request_too_large` naming the field: these are copied into every session of a group and read back
    by the finalizer, so they describe a task (a prompt, a dataset row), they do not carry data sets."""


class KeyRateLimit(BaseModel):
    """How much one API key may ask of the proxy (proxy/rate_limits.py); None: no limit."""

    model_config = ConfigDict(extra="forbid")

    requests_per_s: float | None = Field(None, gt=0)
    """Inference calls per second, sustained (a token bucket, per proxy)."""
    burst: int | None = Field(None, ge=1)
    """Calls allowed at once above the sustained rate (the bucket's size); None: the rate, rounded up."""
    tokens_per_day: int | None = Field(None, ge=1)
    """Prompt and completion tokens per UTC day, counted in the database across every proxy."""


class RateLimitsConfig(BaseModel):
    """Rate limits and token quotas per key (`proxy.rate_limits`): the defaults of each kind of key; a
    key's own limits (`flywheel keys create --requests-per-s ... --tokens-per-day ...`) replace its
    kind's. Refusals are 429 with `Retry-After` and `x-ratelimit-*` headers."""

    model_config = ConfigDict(extra="forbid")

    admin: KeyRateLimit = Field(default_factory=KeyRateLimit)
    """Admin keys: unlimited by default (drivers and evaluations run on them)."""
    session: KeyRateLimit = Field(default_factory=lambda: KeyRateLimit(requests_per_s=50, burst=100))
    """A session's key: one agent's episode, far below this unless it runs away."""
    online: KeyRateLimit = Field(default_factory=lambda: KeyRateLimit(requests_per_s=500, burst=1000))
    """An online key: all the live traffic of one deployment goes through it."""
    feedback: KeyRateLimit = Field(default_factory=lambda: KeyRateLimit(requests_per_s=100, burst=200))
    """`POST /rl/v1/feedback` calls per key of any kind, in a bucket of their own (inference does not
    spend it); `requests_per_s: null` lifts it. `tokens_per_day` does not apply here."""
    flush_interval_s: float = Field(1.0, gt=0)
    """How often each proxy adds the tokens it served to the database's daily counts (and reads the
    totals back): several proxies together may pass a quota by what they serve in one interval."""

    def of(self, scope: str) -> KeyRateLimit:
        """The default limits of a kind of key ("admin", "session" or "online")."""
        limit: KeyRateLimit = getattr(self, scope)
        return limit


class AdmissionConfig(BaseModel):
    """Admission control of the RL API (`proxy.admission`; docs/architecture.md, "Admission control"):
    creating sessions (`POST /rl/v1/sessions`, `/rl/v1/groups`, AReaL's `/rl/start_session`) is a 429
    with `Retry-After` once the sessions admitted would pass (η + v + 1) · B, v the newest policy
    version, so that generation runs at most η + 1 batches ahead of training. Online keys' traffic is
    never refused."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    """Refuse RL API sessions past the capacity. Off by default: the trainer drops samples older than η
    either way (never training on them), so admission saves the generation they would waste; turn it on
    for asynchronous runs whose agents open sessions as fast as they are let in. Its clients must wait
    out the 429 (the `openai` client and the GSM8K agent's `RLClient` do)."""
    retry_after_s: float = Field(2.0, gt=0)
    """The refusal's `Retry-After` (whole seconds, rounded up) and `retry-after-ms`: about how long a
    slot takes to free (a training step)."""
    batch_size: int | None = Field(None, ge=1)
    """B, in sessions. None: `trainer.batch_size`, which the Flywheel config fills in (the proxy is
    handed only its own section); set it where the trainer's is not in this config."""
    max_head_offpolicyness: int | None = Field(None, ge=0)
    """η. None: `trainer.max_head_offpolicyness`, filled in the same way."""

    @model_validator(mode="after")
    def _knows_its_batch(self) -> AdmissionConfig:
        if self.enabled and (self.batch_size is None or self.max_head_offpolicyness is None):
            raise ValueError(
                "proxy.admission.enabled needs the trainer's batch_size and max_head_offpolicyness: set "
                "proxy.admission.batch_size and .max_head_offpolicyness (the Flywheel config takes "
                "trainer.batch_size and trainer.max_head_offpolicyness)"
            )
        return self


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
    record_retry_s: float = Field(60.0, ge=0)
    """How long the recorder keeps retrying a write while the database is unreachable. The calls being
    recorded wait (a stream's last events, a JSON answer); past this they fail with 503 and nothing was
    handed out as a completed answer."""
    database_retry_after_s: float = Field(2.0, gt=0)
    """The `Retry-After` of the 503 that refuses new work while the database is unreachable."""
    database_probe_interval_s: float = Field(0.5, gt=0)
    """While the database is unreachable, how often the proxy asks it `SELECT 1` to accept work again."""
    tokenize_in_thread_chars: int = Field(8192, ge=0)
    """Render and tokenize prompts of more characters than this in a worker thread, so long prompts
    do not stall the event loop; shorter ones are faster inline."""
    parse_in_thread_bytes: int = Field(256 * 1024, ge=0)
    """Decode, check and validate JSON bodies of more bytes than this in a worker thread, so that a
    large request (thousands of messages, a long document) leaves the event loop answering others;
    smaller ones are faster inline."""
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
    ephemeral_messages: int = Field(1, ge=0, le=8)
    """How many trailing messages of a call (user, system or developer ones, after at least one other new
    message) its agent may leave out of its next call, which then still extends it: ephemeral context
    such as OpenClaw's internal-context message, re-sent fresh at the end of every request. The next call
    chains onto the earlier one token-exactly, the dropped message staying in the tokens where the model
    saw it, never trained on. 0 treats every dropped message as a history edit (a new branch)."""
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
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    """What one request may ask: body size, JSON depth, prompt length, choices, logprobs, RL fields."""
    rate_limits: RateLimitsConfig = Field(default_factory=RateLimitsConfig)
    """Requests per second and tokens per day, per API key."""
    online: OnlineConfig = Field(default_factory=OnlineConfig)
    """How online keys' calls are grouped into sessions: whether a new conversation ends the last."""
    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig)
    """Redaction of the stored request/response JSON, and how long raw JSON is kept (docs/privacy.md)."""
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    """Admission control of RL API sessions: how far generation may run ahead of training."""

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
