"""SGLang 0.5.23's `/generate` request contract: parse, type-check and validate a body into plain records.

Three kinds of refusal, each with the body SGLang answers with (all HTTP 400):
`MalformedRequest` (not a JSON object: FastAPI's validation shape), `ContractError` (the schema gate:
an unknown `sampling_params` key or a wrong type, `{"error": "<text>"}`) and `BadRequest` (a value
SGLang's tokenizer manager refuses, `{"error": {"message": "<text>"}}`).
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from serving.protocol import SamplingParams

# SGLang 0.5.23's SamplingParams fields, in schema order: its unknown-field message lists them so.
SAMPLING_FIELDS: tuple[str, ...] = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
    "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width",
    "watermark", "choice",
)
TOP_K_ALL = 1 << 30
"""SGLang's "whole vocabulary" top_k."""
GREEDY_EPS = 1e-6
"""Temperatures below this are greedy (SGLang's _SAMPLING_EPS)."""
MAX_STOP_COUNT = 32


class MalformedRequest(Exception):
    """The body is not a JSON object at all."""


class ContractError(Exception):
    """The body breaks SGLang's JSON schema: an unknown sampling key or a wrong type."""


class BadRequest(Exception):
    """A well-typed request SGLang would still refuse (bad value, too long, unsupported here)."""


CONSTRAINT_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")
"""SGLang's constrained-decoding sampling parameters; a request sets at most one."""


@dataclass(frozen=True, slots=True)
class Constraint:
    """The grammar one request's output must follow: a `CONSTRAINT_KINDS` name and its text."""

    kind: str
    text: str


# The client's record is the wire schema: one definition of SGLang 0.5.23's sampling_params
# (unknown keys are a 400). Keys we cannot honour are refused by `validate_sampling` with a reason.
SamplingParamsWire = SamplingParams


class GenerateWire(msgspec.Struct):
    """The `/generate` body; unknown top-level keys are ignored, as SGLang's schema does."""

    text: str | list[str] | None = None
    input_ids: list[Any] | None = None
    sampling_params: SamplingParamsWire | list[SamplingParamsWire] | None = None
    rid: str | list[str] | None = None
    stream: bool | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool | None = None
    return_prompt_token_ids: bool = False
    lora_path: str | list[str | None] | None = None
    """The name of a loaded LoRA adapter (`/load_lora_adapter`), or one per input of a batch."""
    # Accepted by SGLang, not served by the CPU engine: refused when set (see UNSUPPORTED_FIELDS).
    token_ids_logprob: Any = None
    return_hidden_states: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    session_params: Any = None
    custom_logit_processor: Any = None
    return_sampling_mask: Any = None
    max_thinking_tokens: Any = None
    session_id: Any = None


UNSUPPORTED_FIELDS = (
    "token_ids_logprob", "return_hidden_states", "image_data", "video_data", "audio_data", "session_params",
    "custom_logit_processor", "return_sampling_mask", "max_thinking_tokens", "session_id",
)


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """One sequence's validated sampling parameters, normalised as SGLang's SamplingParams does."""

    max_new_tokens: int | None
    """None: the engine default, clipped to the context."""
    min_new_tokens: int
    temperature: float
    """1.0 for greedy requests: their logprobs are of the T=1 distribution, as in SGLang."""
    greedy: bool
    top_p: float
    top_k: int
    min_p: float
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    logit_bias: tuple[tuple[int, float], ...]
    stop_strs: tuple[str, ...]
    stop_regex: tuple[str, ...]
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    no_stop_trim: bool
    stream_interval: int
    n: int
    sampling_seed: int | None
    constraint: Constraint | None = None

    @property
    def truncates(self) -> bool:
        return not self.greedy and (self.top_k < TOP_K_ALL or self.top_p < 1.0 or self.min_p > 0.0)

    @property
    def penalises(self) -> bool:
        return (self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or self.repetition_penalty != 1.0 or bool(self.logit_bias))


@dataclass(frozen=True, slots=True)
class PlannedSequence:
    """One output sequence a request asks for (a batch input and `n` multiply them)."""

    rid: str
    index: int
    text: str | None
    input_ids: list[int] | None
    sampling: SamplingOptions
    seed: int | None
    return_logprob: bool
    top_logprobs_num: int
    return_text_in_logprobs: bool
    return_prompt_token_ids: bool
    lora_name: str | None = None
    """The loaded LoRA adapter to generate with; None: the base model."""


@dataclass(frozen=True, slots=True)
class GeneratePlan:
    """The sequences of one `/generate` call and how to answer it."""

    sequences: list[PlannedSequence]
    stream: bool
    as_list: bool
    """True for a batch input or n > 1: the answer is a JSON array (or indexed stream chunks)."""


def decode_body(body: bytes) -> GenerateWire:
    """Parse and type-check a `/generate` body against SGLang's contract."""
    try:
        raw = msgspec.json.decode(body) if body else None
    except msgspec.DecodeError as exc:
        raise MalformedRequest(f"JSON decode error: {exc}") from exc
    if not isinstance(raw, dict):
        raise MalformedRequest("The request body must be a JSON object.")
    check_sampling_keys(raw.get("sampling_params"))
    try:
        return msgspec.convert(raw, GenerateWire, strict=True)
    except msgspec.ValidationError as exc:
        raise ContractError(str(exc)) from exc


def check_sampling_keys(sampling_params: Any) -> None:
    """Refuse unknown sampling keys with serde's own text, as SGLang 0.5.23's schema gate does."""
    items = sampling_params if isinstance(sampling_params, list) else [sampling_params]
    for item in items:
        if not isinstance(item, dict):
            continue
        for key in item:
            if key not in SAMPLING_FIELDS:
                listed = ", ".join(f"`{name}`" for name in SAMPLING_FIELDS)
                raise ContractError(f"unknown field `{key}`, expected one of {listed}")


def plan_generate(wire: GenerateWire, *, vocab_size: int) -> GeneratePlan:
    """Expand a request into its sequences (batch inputs x n), validating every value."""
    for name in UNSUPPORTED_FIELDS:
        value = getattr(wire, name)
        if value not in (None, False, [], {}):
            raise BadRequest(f"`{name}` is not supported by the CPU engine.")
    if wire.logprob_start_len not in (None, -1):
        raise BadRequest("`logprob_start_len` (input logprobs) is not supported by the CPU engine.")
    prompts = _prompts(wire, vocab_size)
    batch = len(prompts)
    sampling = _per_input(wire.sampling_params, batch, "sampling_params")
    options = [validate_sampling(sp or SamplingParamsWire(), vocab_size) for sp in sampling]
    n = options[0].n
    if any(opt.n != n for opt in options):
        raise BadRequest("The parallel_sample_num should be the same for all samples in sample params.")
    as_list = isinstance(wire.text, list) or _is_batch_ids(wire.input_ids) or n > 1
    rids = _rids(wire.rid, batch, n, as_list)
    return_logprob = _per_input(wire.return_logprob, batch, "return_logprob")
    top_logprobs = _per_input(wire.top_logprobs_num, batch, "top_logprobs_num")
    loras = _per_input(wire.lora_path, batch, "lora_path")
    sequences: list[PlannedSequence] = []
    for i, (text, ids) in enumerate(prompts):
        top_n = top_logprobs[i] or 0
        if top_n < 0:
            raise BadRequest(f"top_logprobs_num must be at least 0, got {top_n}.")
        for j in range(n):
            seed = options[i].sampling_seed
            sequences.append(PlannedSequence(
                rid=rids[i * n + j], index=i * n + j, text=text, input_ids=ids, sampling=options[i],
                # Each of n samples gets its own stream: seed + j keeps them reproducible yet distinct.
                seed=None if seed is None else seed + j,
                return_logprob=bool(return_logprob[i]), top_logprobs_num=top_n,
                return_text_in_logprobs=bool(wire.return_text_in_logprobs),
                return_prompt_token_ids=wire.return_prompt_token_ids, lora_name=loras[i] or None,
            ))
    return GeneratePlan(sequences=sequences, stream=bool(wire.stream), as_list=as_list)


def _is_batch_ids(input_ids: list[Any] | None) -> bool:
    return input_ids is not None and len(input_ids) > 0 and isinstance(input_ids[0], list)


def _prompts(wire: GenerateWire, vocab_size: int) -> list[tuple[str | None, list[int] | None]]:
    if wire.text is None and wire.input_ids is None:
        raise BadRequest("Either text, input_ids or input_embeds should be provided.")
    if wire.text is not None and wire.input_ids is not None:
        raise BadRequest("Give either text or input_ids, not both.")
    if wire.text is not None:
        texts = wire.text if isinstance(wire.text, list) else [wire.text]
        if not texts:
            raise BadRequest("texts cannot be empty and tokenizer must be initialized")
        return [(text, None) for text in texts]
    ids = wire.input_ids or []
    if not ids:
        raise BadRequest("input_ids cannot be empty.")
    rows = ids if _is_batch_ids(ids) else [ids]
    for row in rows:
        if not isinstance(row, list) or not row:
            raise ContractError("invalid type: input_ids must be a list of token ids or a list of such lists")
        for token in row:
            if not isinstance(token, int) or isinstance(token, bool):
                raise ContractError(f"invalid type: {token!r} in input_ids, expected i64")
            if not 0 <= token < vocab_size:
                raise BadRequest(f"input_ids contains out-of-vocabulary token id {token}; "
                                 f"valid range is [0, {vocab_size}).")
    return [(None, list(row)) for row in rows]


def _per_input(value: Any, batch: int, name: str) -> list[Any]:
    if not isinstance(value, list):
        return [value] * batch
    if len(value) != batch:
        raise BadRequest(f"The length of {name} ({len(value)}) does not match the batch size ({batch}).")
    return value


def _rids(rid: str | list[str] | None, batch: int, n: int, as_list: bool) -> list[str]:
    total = batch * n
    if rid is None:
        return [uuid.uuid4().hex for _ in range(total)]
    if isinstance(rid, str):
        # SGLang suffixes a shared rid per sequence; the prefix still matches /abort_request {rid}.
        return [rid] if not as_list else [f"{rid}_{i}" for i in range(total)]
    if len(rid) != batch:
        raise BadRequest("The specified rids length mismatch with the batch_size for batch processing.")
    if len(set(rid)) != len(rid):
        raise BadRequest(f"Duplicate request IDs detected within the request: {sorted(rid)}")
    return [r if n == 1 else f"{r}_{j}" for r in rid for j in range(n)]


def validate_sampling(wire: SamplingParamsWire, vocab_size: int) -> SamplingOptions:
    """SGLang's SamplingParams.__post_init__ + verify + normalize, with its messages."""
    constraint = _constraint(wire)
    if wire.beam_width not in (None, 1):
        raise BadRequest("`beam_width` (beam search) is not supported by the CPU engine.")
    if wire.choice:
        raise BadRequest("`choice` is not supported by the CPU engine.")
    if wire.watermark and wire.watermark.get("enabled"):
        raise BadRequest("`watermark` is not supported by the CPU engine.")
    temperature = 1.0 if wire.temperature is None else wire.temperature
    top_k = -1 if wire.top_k is None else wire.top_k
    _verify_ranges(wire, temperature, top_k, vocab_size)
    greedy = 0.0 <= temperature < GREEDY_EPS
    stop_strs = _as_tuple(wire.stop)
    stop_regex = _as_tuple(wire.stop_regex)
    if len(stop_strs) > MAX_STOP_COUNT:
        raise BadRequest(f"at most {MAX_STOP_COUNT} stop strings are allowed, got {len(stop_strs)}")
    return SamplingOptions(
        max_new_tokens=wire.max_new_tokens,
        min_new_tokens=wire.min_new_tokens or 0,
        temperature=1.0 if greedy else temperature,
        greedy=greedy,
        top_p=1.0 if wire.top_p is None else wire.top_p,
        top_k=1 if greedy else (TOP_K_ALL if top_k == -1 else top_k),
        min_p=wire.min_p or 0.0,
        frequency_penalty=wire.frequency_penalty or 0.0,
        presence_penalty=wire.presence_penalty or 0.0,
        repetition_penalty=1.0 if wire.repetition_penalty is None else wire.repetition_penalty,
        logit_bias=tuple((int(k), v) for k, v in (wire.logit_bias or {}).items()),
        stop_strs=tuple(s for s in stop_strs if s),
        stop_regex=stop_regex,
        stop_token_ids=frozenset(wire.stop_token_ids or ()),
        ignore_eos=bool(wire.ignore_eos),
        skip_special_tokens=True if wire.skip_special_tokens is None else wire.skip_special_tokens,
        spaces_between_special_tokens=(True if wire.spaces_between_special_tokens is None
                                       else wire.spaces_between_special_tokens),
        no_stop_trim=bool(wire.no_stop_trim),
        stream_interval=max(1, wire.stream_interval or 1),
        n=1 if wire.n is None else wire.n,
        sampling_seed=wire.sampling_seed,
        constraint=constraint,
    )


def _constraint(wire: SamplingParamsWire) -> Constraint | None:
    """The request's grammar: at most one of SGLang's four (an empty string is unset, as SGLang has it)."""
    given = [Constraint(kind, text) for kind in CONSTRAINT_KINDS if (text := getattr(wire, kind))]
    if len(given) > 1:
        raise BadRequest("Only one of regex, json_schema, ebnf or structural_tag can be set.")
    return given[0] if given else None


def _as_tuple(value: str | list[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _verify_ranges(wire: SamplingParamsWire, temperature: float, top_k: int, vocab_size: int) -> None:
    top_p = 1.0 if wire.top_p is None else wire.top_p
    min_p = wire.min_p or 0.0
    min_new = wire.min_new_tokens or 0
    checks = [
        (math.isfinite(temperature) and temperature >= 0.0,
         f"temperature must be a non-negative finite number, got {temperature}."),
        (0.0 < top_p <= 1.0, f"top_p must be in (0, 1], got {top_p}."),
        (0.0 <= min_p <= 1.0, f"min_p must be in [0, 1], got {min_p}."),
        (top_k == -1 or top_k >= 1, f"top_k must be -1 (disable) or at least 1, got {top_k}."),
        (-2.0 <= (wire.frequency_penalty or 0.0) <= 2.0,
         f"frequency_penalty must be in [-2, 2], got {wire.frequency_penalty}."),
        (-2.0 <= (wire.presence_penalty or 0.0) <= 2.0,
         f"presence_penalty must be in [-2, 2], got {wire.presence_penalty}."),
        (wire.repetition_penalty is None or 0.0 < wire.repetition_penalty <= 2.0,
         f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {wire.repetition_penalty}."),
        (min_new >= 0, f"min_new_tokens must be in [0, max_new_tokens], got {min_new}."),
        (wire.max_new_tokens is None or wire.max_new_tokens >= 0,
         f"max_new_tokens must be at least 0, got {wire.max_new_tokens}."),
        (wire.max_new_tokens is None or min_new <= wire.max_new_tokens,
         f"min_new_tokens must be in [0, max_new_tokens({wire.max_new_tokens})], got {min_new}."),
        (wire.n is None or wire.n >= 1, f"n must be at least 1, got {wire.n}."),
        (wire.sampling_seed is None or -(2**63) <= wire.sampling_seed <= 2**63 - 1,
         f"sampling_seed must be in [-2**63, 2**63 - 1], got {wire.sampling_seed}."),
        (all(-1 <= t for t in wire.stop_token_ids or ()), "stop_token_ids must be token ids."),
    ]
    for ok, message in checks:
        if not ok:
            raise BadRequest(message)
    for key in wire.logit_bias or {}:
        if not key.lstrip("-").isdigit() or not 0 <= int(key) < vocab_size:
            raise BadRequest(f"logit_bias must has keys in [0, {vocab_size - 1}], got {key}.")
