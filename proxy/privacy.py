"""Privacy settings of the proxy (`proxy.privacy`, docs/privacy.md): redaction of the text in the request
and response JSON it stores, and how long that raw JSON is kept once its session was trained on.

This module holds the settings, the built-in detectors and the mark a redacted record carries; the
redaction itself is proxy/recording/redaction.py, the purge storage/retention.py."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DetectorName = Literal["secret", "email", "credit_card", "phone", "ipv4"]

REDACTED_MARK = "flywheel_redacted"
"""Key of the recorded request of a completion whose stored JSON redaction changed (its value: the mode).
Its stored text is not what the model saw: a reloaded conversation tree never chains onto it, and
`previous_response_id` refuses to rebuild a history from it."""


def is_redacted(request_json: Mapping[str, Any]) -> bool:
    """Whether a recorded request (and its response) holds redacted text."""
    return request_json.get(REDACTED_MARK) in ("patterns", "all")


@dataclass(frozen=True, slots=True)
class Detector:
    """A built-in detector: what it matches, what replaces a match, and a check a match must pass."""

    regex: re.Pattern[str]
    replacement: str
    accept: Callable[[str], bool] | None = None


def _luhn(text: str) -> bool:
    """Whether the digits of `text` pass the Luhn checksum (every payment card number does)."""
    digits = [int(c) for c in text if c.isdigit()]
    total = 0
    for position, digit in enumerate(reversed(digits)):
        if position % 2 == 1:
            digit = digit * 2 - 9 if digit > 4 else digit * 2
        total += digit
    return total % 10 == 0


_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_SECRETS = "|".join(
    (
        r"\b(?i:bearer)\s+[A-Za-z0-9._~+/=-]{8,}",  # an Authorization header's value
        r"\b(?:sk|pk|rk|fw)-[A-Za-z0-9_-]{16,}",  # OpenAI-, Stripe- and Flywheel-style keys
        r"\bAKIA[0-9A-Z]{16}\b",  # AWS access key ids
        r"\bgh[pousr]_[A-Za-z0-9]{30,}",  # GitHub tokens
        r"\bxox[abprs]-[A-Za-z0-9-]{10,}",  # Slack tokens
        r"\bAIza[0-9A-Za-z_-]{35}",  # Google API keys
        r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}",  # JSON web tokens
        r"\b(?i:api[_-]?key|secret|token|password|passwd)\b[\"']?\s*[:=]\s*[\"']?[^\s\"',;]{8,}",
    )
)

DETECTORS: dict[DetectorName, Detector] = {
    "secret": Detector(re.compile(f"(?:{_SECRETS})"), "[SECRET]"),
    "email": Detector(
        re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}"), "[EMAIL]"
    ),
    "credit_card": Detector(re.compile(r"(?<![\d-])\d(?:[ -]?\d){12,18}(?![\d-])"), "[CARD]", _luhn),
    "phone": Detector(
        re.compile(
            r"(?<![\w+])(?:\+\d{1,3}(?:[ .-]?\(?\d{2,4}\)?){2,5}"  # +country code, then groups
            r"|(?:\(\d{3}\) ?|\d{3}[ .-])\d{3}[ .-]\d{4})(?!\w)"  # (415) 555-0100, 415-555-0100
        ),
        "[PHONE]",
    ),
    "ipv4": Detector(re.compile(rf"(?<![\w.]){_OCTET}(?:\.{_OCTET}){{3}}(?!\.?\d)"), "[IP]"),
}
"""The built-in detectors, in the order they take precedence where matches overlap."""
DEFAULT_DETECTORS: tuple[DetectorName, ...] = ("secret", "email", "credit_card", "phone", "ipv4")


class RedactionPattern(BaseModel):
    """One regular expression of your own (`proxy.privacy.patterns`), applied in `redact: patterns` mode
    before the built-in detectors."""

    model_config = ConfigDict(extra="forbid")

    pattern: str
    """A Python regular expression (`re` syntax; `(?i)` at its start ignores case). Every match in a
    stored text is replaced. One that does not compile, or that matches the empty string, is a config
    error naming it."""
    replacement: str = "[REDACTED]"
    """The text put in place of each match, literally (no group references)."""

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            regex = re.compile(pattern)
        except re.error as exc:
            raise ValueError(
                f"redaction pattern {pattern!r} is not a valid regular expression: {exc}"
            ) from None
        if regex.fullmatch(""):
            raise ValueError(f"redaction pattern {pattern!r} matches the empty string")
        return pattern

    def compiled(self) -> re.Pattern[str]:
        return re.compile(self.pattern)


class PrivacyConfig(BaseModel):
    """What the proxy keeps of the text it serves (`proxy.privacy`, docs/privacy.md). Token ids are always
    kept whole: training needs them, and they encode the text."""

    model_config = ConfigDict(extra="forbid")

    redact: Literal["none", "patterns", "all"] = "none"
    """Redaction of the stored request and response JSON, before anything is written: `none` keeps it as
    served; `patterns` replaces what `detectors` and `patterns` match in every text string (message
    content, reasoning, tool-call arguments, prompts, outputs, Responses items, instructions,
    metadata), `all` replaces every such string with `placeholder`. Ids, model names, roles, types,
    function names, tool definitions and numbers are kept. Clients always get the unredacted answer."""
    detectors: list[DetectorName] = Field(default_factory=lambda: list(DEFAULT_DETECTORS))
    """The built-in detectors `patterns` mode applies: `secret` (bearer tokens, API-key-like strings,
    `password=...`), `email`, `credit_card` (13 to 19 digits passing the Luhn check), `phone` (a `+`
    and country code, or North American `(415) 555-0100` forms), `ipv4`. Default: all of them."""
    patterns: list[RedactionPattern] = Field(default_factory=list)
    """Your own regular expressions for `patterns` mode, each `{pattern, replacement}`."""
    placeholder: str = "[redacted]"
    """What `redact: all` puts in place of every non-empty text string."""
    raw_json_retention_s: float | None = Field(None, ge=0)
    """Seconds the raw request/response JSON of a completion is kept after its session ended, once the
    session is finalized and every trajectory made from it was consumed by a train step (a session
    without trajectories: once finalized). Past that it is replaced by `{"purged": true}`; token ids,
    logprobs, rewards and trajectories stay. None keeps it forever."""
    purge_interval_s: float = Field(300.0, gt=0)
    """How often the proxy purges raw JSON past `raw_json_retention_s` (when that is set)."""
    purge_batch: int = Field(500, ge=1)
    """Completions purged per transaction: a purge pass writes batches of this many until none is left."""

    @model_validator(mode="after")
    def _patterns_mode_has_patterns(self) -> PrivacyConfig:
        if self.redact == "patterns" and not self.detectors and not self.patterns:
            raise ValueError("redact: patterns needs at least one of `detectors` or `patterns`")
        return self
