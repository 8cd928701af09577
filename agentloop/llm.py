"""A client for OpenAI-compatible chat-completions endpoints that answers validated JSON.

vLLM, llama.cpp's server, Ollama and the hosted APIs all speak `POST {base_url}/chat/completions`.
`ChatClient.ask_json` sends one conversation, asks for JSON (a `response_format` JSON schema
where the server takes one, else `json_object`, else plain words), validates the answer with the
caller's function and, per `LlmConfig`, retries what may pass on a second try: timeouts, lost
connections, 5xx, 429 (waiting its Retry-After), malformed or invalid JSON (the next attempt is
told what was wrong). It never raises anything but `ChatFailed`, which says why and what the
attempts cost. Used by the `llm` reviser; nothing in it is specific to revising.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

import httpx
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt

if TYPE_CHECKING:
    from agentloop.settings import Settings

T = TypeVar("T")

ResponseFormat = Literal["auto", "json_schema", "json_object", "none"]
FORMATS: tuple[str, ...] = ("json_schema", "json_object", "none")
"""What `auto` tries, in order: a server that refuses one (400 or 422 naming it) gets the next."""


@dataclass(frozen=True)
class LlmConfig:
    """Where the model is and how patiently to ask it (see the `llm_*` settings)."""

    base_url: str
    model: str
    api_key: str | None = field(default=None, repr=False)
    timeout_seconds: float = 60.0
    max_attempts: int = 3
    max_tokens: int = 2048
    temperature: float = 0.0
    response_format: ResponseFormat = "auto"
    backoff_seconds: float = 1.0
    max_wait_seconds: float = 30.0

    @classmethod
    def of(cls, settings: Settings) -> LlmConfig | None:
        """The settings' endpoint, or None when none is configured."""
        if not (settings.llm_base_url and settings.llm_model):
            return None
        return cls(
            base_url=settings.llm_base_url.rstrip("/"), model=settings.llm_model,
            api_key=settings.llm_api_key, timeout_seconds=settings.llm_timeout_seconds,
            max_attempts=settings.llm_max_attempts, max_tokens=settings.llm_max_tokens,
            temperature=settings.llm_temperature, response_format=settings.llm_response_format,
            backoff_seconds=settings.llm_backoff_seconds,
            max_wait_seconds=settings.llm_max_wait_seconds,
        )


@dataclass
class Usage:
    """What the attempts of one question cost, summed over them."""

    model: str
    served_model: str | None = None
    """The model the server says answered (its `model` field), when it names one."""
    attempts: int = 0
    latency_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    response_format: str = ""
    errors: list[str] = field(default_factory=list)
    """Why each failed attempt failed, in order (short lines)."""

    def notes(self) -> dict[str, Any]:
        return {
            "model": self.model, "served_model": self.served_model, "attempts": self.attempts, "latency_s": round(self.latency_s, 3),
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "response_format": self.response_format, "errors": self.errors,
        }


@dataclass
class ChatAnswer(Generic[T]):
    """A validated answer and what asking cost."""

    value: T
    usage: Usage


class ChatFailed(Exception):
    """No valid answer: `reason` says why (the last attempt's error), `usage` what it cost."""

    def __init__(self, reason: str, usage: Usage):
        super().__init__(reason)
        self.reason = reason
        self.usage = usage


class AnswerInvalid(ValueError):
    """The caller's validator refuses an answer; the message is shown to the model next try."""


class _Retryable(Exception):
    """An attempt failed in a way another attempt may not (`wait`: the server's Retry-After)."""

    def __init__(self, reason: str, wait: float | None = None, feedback: str | None = None,
                 content: str | None = None):
        super().__init__(reason)
        self.wait = wait
        self.feedback = feedback
        self.content = content


class _Final(Exception):
    """An attempt failed in a way every further attempt would too (401, a refusal, ...)."""


class ChatClient:
    """Asks one OpenAI-compatible endpoint for JSON answers. Thread-safe; keep one per config."""

    def __init__(self, config: LlmConfig, transport: httpx.BaseTransport | None = None):
        self.config = config
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._http = httpx.Client(
            base_url=config.base_url, headers=headers, transport=transport,
            timeout=httpx.Timeout(config.timeout_seconds),
        )
        first = config.response_format
        self._format_index = 0 if first == "auto" else FORMATS.index(first)
        self._format_fixed = first != "auto"
        self._tokens_key = "max_tokens"
        self._dropped: set[str] = set()
        """Optional parameters this server refused (`temperature`, `seed`): no longer sent."""

    def close(self) -> None:
        self._http.close()

    def ask_json(
        self, messages: list[dict[str, str]], schema: dict[str, Any], schema_name: str,
        validate: Callable[[Any], T], seed: int | None = None,
    ) -> ChatAnswer[T]:
        """Ask until an answer passes `validate` (which raises AnswerInvalid or pydantic's
        ValidationError to refuse one) or the attempts run out (ChatFailed)."""
        cfg = self.config
        usage = Usage(model=cfg.model)
        conversation = list(messages)
        started = time.monotonic()

        def attempt() -> T:
            usage.attempts += 1
            try:
                return self._attempt(conversation, schema, schema_name, validate, seed, usage)
            except _Retryable as exc:
                usage.errors.append(str(exc))
                if exc.feedback is not None:  # show the model its answer and what was wrong
                    del conversation[len(messages):]
                    conversation.append({"role": "assistant", "content": exc.content or ""})
                    conversation.append({"role": "user", "content": exc.feedback})
                raise
            except _Final as exc:
                usage.errors.append(str(exc))
                raise
            except Exception as exc:  # noqa: BLE001 - whatever else went wrong ends the asking
                usage.errors.append(f"{type(exc).__name__}: {exc}")
                raise _Final(f"{type(exc).__name__}: {exc}") from exc

        retrying = Retrying(
            stop=stop_after_attempt(max(1, cfg.max_attempts)),
            retry=retry_if_exception(lambda e: isinstance(e, _Retryable) and self._may_wait(e)),
            wait=self._wait, reraise=True,
        )
        try:
            value = retrying(attempt)
        except (_Retryable, _Final) as exc:
            usage.latency_s = time.monotonic() - started
            reason = str(exc)
            if isinstance(exc, _Retryable) and not self._may_wait(exc):
                reason += f" (Retry-After {exc.wait:g} s is longer than the {cfg.max_wait_seconds:g} s allowed)"
            raise ChatFailed(reason, usage) from None
        usage.latency_s = time.monotonic() - started
        return ChatAnswer(value, usage)

    def _adapt(self, error: str, fmt: str) -> str | None:
        """Learn from a 400 that names a request field this server does not take; say what
        changes for the next attempts (None: nothing to learn, the 400 stands)."""
        text = error.lower()
        if "max_completion_tokens" in text and self._tokens_key == "max_tokens":
            self._tokens_key = "max_completion_tokens"  # OpenAI's reasoning models
            return "the server wants max_completion_tokens instead of max_tokens"
        if fmt != "none" and not self._format_fixed and any(
                w in text for w in ("response_format", "json_schema", "json_object")):
            self._format_index += 1  # this server takes no such response_format: ask plainer
            return f"the server refused response_format {fmt}"
        for name in ("temperature", "seed"):
            if name not in self._dropped and re.search(
                    rf"(unsupported|not supported|unrecognized|unknown)[^.]*\b{name}\b"
                    rf"|\b{name}\b[^.]*(unsupported|not supported|not allowed)", text):
                self._dropped.add(name)
                return f"the server does not take {name}; no longer sent"
        return None

    def _may_wait(self, exc: _Retryable) -> bool:
        return exc.wait is None or exc.wait <= self.config.max_wait_seconds

    def _wait(self, state: RetryCallState) -> float:
        """The server's Retry-After when it gave one, else exponential backoff."""
        exc = state.outcome.exception() if state.outcome else None
        if isinstance(exc, _Retryable) and exc.wait is not None:
            return exc.wait
        backoff = self.config.backoff_seconds * 2 ** (state.attempt_number - 1)
        return min(backoff, self.config.max_wait_seconds)

    def _attempt(
        self, conversation: list[dict[str, str]], schema: dict[str, Any], schema_name: str,
        validate: Callable[[Any], T], seed: int | None, usage: Usage,
    ) -> T:
        cfg = self.config
        body: dict[str, Any] = {
            "model": cfg.model, "messages": conversation, self._tokens_key: cfg.max_tokens,
            "temperature": cfg.temperature, "stream": False,
        }
        if seed is not None:
            body["seed"] = seed
        for name in self._dropped:
            body.pop(name, None)
        fmt = FORMATS[self._format_index]
        usage.response_format = fmt
        if fmt == "json_schema":
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": schema_name, "schema": schema, "strict": True},
            }
        elif fmt == "json_object":
            body["response_format"] = {"type": "json_object"}
        try:
            response = self._http.post("/chat/completions", json=body)
        except httpx.TimeoutException:
            raise _Retryable(f"timed out after {cfg.timeout_seconds:g} s") from None
        except httpx.HTTPError as exc:
            raise _Retryable(f"{type(exc).__name__}: {exc}") from None
        code = response.status_code
        if code in (400, 422) and (adapted := self._adapt(response.text, fmt)):
            raise _Retryable(f"HTTP {code}: {adapted}", wait=0.0)
        if code == 429 or code >= 500:
            raise _Retryable(f"HTTP {code}: {_snippet(response.text)}", wait=_retry_after(response))
        if code != 200:
            raise _Final(f"HTTP {code}: {_snippet(response.text)}")
        try:
            data = response.json()
            choice = data["choices"][0]
            message = choice["message"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise _Retryable(f"not a chat completion: {_snippet(response.text)}") from None
        _count(usage, data.get("usage"))
        if isinstance(data.get("model"), str):
            usage.served_model = data["model"][:200]
        if message.get("refusal"):
            raise _Final(f"refused: {_snippet(str(message['refusal']))}")
        finish = choice.get("finish_reason")
        if finish == "content_filter":
            raise _Final("refused: the server's content filter stopped the answer")
        content = message.get("content") or ""
        if not isinstance(content, str):
            raise _Retryable("the answer's content is not text")
        cut = " (it was cut off at max_tokens: answer with fewer, shorter moves)" \
            if finish == "length" else ""
        try:
            parsed = _read_json(content)
        except ValueError as exc:
            raise _Retryable(
                f"answer is not JSON: {exc}{cut}",
                feedback=f"That answer was not valid JSON ({exc}){cut}. Answer again with one "
                "JSON object that follows the schema, and nothing else.", content=content,
            ) from None
        try:
            return validate(parsed)
        except (AnswerInvalid, ValueError) as exc:  # pydantic's ValidationError is a ValueError
            problems = _problems(exc)
            raise _Retryable(
                f"answer does not follow the schema: {_snippet(problems, 300)}",
                feedback=f"That answer does not follow the rules: {problems}. Answer again with "
                "one corrected JSON object, and nothing else.", content=content,
            ) from None


def _count(usage: Usage, reported: Any) -> None:
    if not isinstance(reported, dict):
        return
    for key in ("prompt_tokens", "completion_tokens"):
        value = reported.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            setattr(usage, key, getattr(usage, key) + value)


def _retry_after(response: httpx.Response) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date), else None."""
    value = response.headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def _read_json(content: str) -> Any:
    """The JSON of an answer. Models asked in plain words (no response_format) often wrap it:
    a reasoning block (<think>...</think>) before it, a ```json fence around it, a sentence
    before or after it; the object is read from the first `{` to the last `}` then."""
    text = re.sub(r"<think>.*?</think>", "", content, flags=re.DOTALL).strip()
    if text.startswith("```"):
        text = text.split("\n", 1)[1] if "\n" in text else ""
        text = text.rsplit("```", 1)[0]
    try:
        return json.loads(text)
    except ValueError:
        start, end = text.find("{"), text.rfind("}")
        if 0 <= start < end and (start > 0 or end < len(text) - 1):
            return json.loads(text[start: end + 1])
        raise


def _problems(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            return "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'answer'}: {e['msg']}" for e in errors()
            )
        except Exception:  # noqa: BLE001 - fall back to the message
            pass
    return str(exc)


def _snippet(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
