"""Reading a goal into parts with a language model (`Settings.goal_parser = "llm"`).

The rule parser (`agentloop.parts.RuleParser`) reads the grammar around objects; a language
model also reads what the grammar hides ("a cat chasing two mice", "the sun setting behind a
lighthouse"). It is asked once, when the goal is created, through the same OpenAI-compatible
endpoint as the `llm` reviser (`agentloop.llm.ChatClient`); its parts are stored in the goal's
spec (`GoalSpec.parts`), so the orchestrator and every worker judge the goal by the same parts
however many times they read it, and the answer is never asked for again. An answer that is
malformed, breaks the schema or comes too late is retried as the client's settings say; when
no valid answer comes, the goal keeps no parts and the rules parse its text, as without an
endpoint (the goal is never refused for it: the parse is an aid, not a gate).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import Any

from agentloop.domain import MAX_PART_SCALE, MIN_PART_SCALE, GoalSpec
from agentloop.llm import AnswerInvalid, ChatClient, ChatFailed, LlmConfig, Usage
from agentloop.parts import MAX_PARTS, part_from_json, part_to_json
from agentloop.settings import Settings

log = logging.getLogger(__name__)

PARSER_NAME = "llm"

SYSTEM = f"""You read a request for an image into the separate objects it asks for.
Answer JSON: {{"parts": [{{"text": ..., "place": [x, y] or null, "scale": ...}}, ...]}}.
- One part per object, in the order the request names them, each "text" a short noun phrase
  with that object's own attributes only (colour, size, material, count words removed),
  written as the request words it, with its place words when it states one
  ("a red circle on the left").
- A count makes that many parts: "two red circles" gives "a red circle (1 of 2)" and
  "a red circle (2 of 2)". Every "text" must be different.
- "place": where the request puts the object, [x, y] from the top-left corner in [0, 1]
  (left 0.25, right 0.75, top 0.25, bottom 0.75, centre 0.5; a relation such as "above"
  places both objects); null when the request does not say.
- "scale": 1.0, or its size word's share of the image: tiny 0.7, small 0.85, large 1.2,
  huge 1.4 (between {MIN_PART_SCALE} and {MAX_PART_SCALE}).
- A request for one object, or a scene that is one thing, is one part. At most {MAX_PARTS}
  parts; the background is not a part."""

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "parts": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "text": {"type": "string"},
                    "place": {"anyOf": [
                        {"type": "array", "items": {"type": "number"}, "minItems": 2,
                         "maxItems": 2},
                        {"type": "null"},
                    ]},
                    "scale": {"type": "number"},
                },
                "required": ["text", "place", "scale"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["parts"],
    "additionalProperties": False,
}
"""The answer's JSON schema (strict: every field required, nothing else)."""

MAX_PART_CHARS = 300


def validate_answer(answer: Any) -> tuple[dict[str, Any], ...]:
    """The answer's parts as stored (`part_to_json`); () for a goal of one object. Raises
    AnswerInvalid saying what is wrong (the model is shown it on the next attempt)."""
    if not isinstance(answer, dict) or not isinstance(answer.get("parts"), list):
        raise AnswerInvalid('answer {"parts": [...]}, a list of objects')
    parts = answer["parts"]
    if not parts:
        raise AnswerInvalid("list at least one part (a request for one object is one part)")
    if len(parts) > MAX_PARTS:
        raise AnswerInvalid(f"at most {MAX_PARTS} parts, not {len(parts)}")
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for k, part in enumerate(parts):
        if not isinstance(part, dict):
            raise AnswerInvalid(f"part {k} is not an object")
        text = part.get("text")
        if not isinstance(text, str) or not text.strip() or len(text) > MAX_PART_CHARS:
            raise AnswerInvalid(f"part {k}: text must be 1 to {MAX_PART_CHARS} characters")
        text = " ".join(text.split())
        if text.lower() in seen:
            raise AnswerInvalid(f"part {k}: text {text!r} repeats an earlier part's; number "
                                "repeated objects, '(1 of 2)', '(2 of 2)'")
        seen.add(text.lower())
        place = part.get("place")
        if place is not None and not (
            isinstance(place, list) and len(place) == 2
            and all(isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v <= 1
                    for v in place)
        ):
            raise AnswerInvalid(f"part {k}: place must be [x, y] with both in [0, 1], or null")
        scale = part.get("scale", 1.0)
        if not isinstance(scale, int | float) or isinstance(scale, bool) or not (
                MIN_PART_SCALE <= scale <= MAX_PART_SCALE):
            raise AnswerInvalid(f"part {k}: scale must be a number in "
                                f"[{MIN_PART_SCALE}, {MAX_PART_SCALE}]")
        out.append(part_to_json(part_from_json(
            {"text": text, "place": place, "scale": float(scale)})))
    return tuple(out) if len(out) > 1 else ()


_clients: dict[LlmConfig, ChatClient] = {}
_clients_lock = threading.Lock()


def _client(config: LlmConfig) -> ChatClient:
    with _clients_lock:
        if config not in _clients:
            _clients[config] = ChatClient(config)
        return _clients[config]


def ask_parts(goal: str, config: LlmConfig, seed: int | None = None) -> tuple[
        tuple[dict[str, Any], ...], Usage]:
    """The model's parts of ``goal`` (() for one object) and what asking cost; ChatFailed
    when no valid answer came."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": goal}]
    answer = _client(config).ask_json(messages, SCHEMA, "goal_parts", validate_answer, seed=seed)
    return answer.value, answer.usage


def with_parsed_parts(spec: GoalSpec, settings: Settings) -> GoalSpec:
    """``spec`` with the language model's parts stored, when the settings parse goals with
    it and the caller gave none; unchanged otherwise, and when no valid answer came (the
    rules will parse the text)."""
    if settings.goal_parser != PARSER_NAME or spec.parts is not None:
        return spec
    config = LlmConfig.of(settings)
    if config is None:  # Settings refuse goal_parser "llm" without an endpoint
        return spec
    try:
        parts, usage = ask_parts(spec.goal, config, seed=spec.seed)
    except ChatFailed as exc:
        log.warning("goal parse by %s failed after %d attempt(s) (%s); the rules parse %r",
                    config.model, exc.usage.attempts, exc.reason, spec.goal)
        return spec
    log.info("goal parse by %s: %d part(s) in %.2f s, %d+%d tokens", config.model, len(parts),
             usage.latency_s, usage.prompt_tokens, usage.completion_tokens)
    return replace(spec, parts=parts)
