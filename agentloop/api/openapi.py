"""The OpenAPI schema, with this deployment's goal limits written into `GoalRequest`.

`check_goal` checks ranges against the settings (so that one answer names every bad field);
here the same ranges are written into the schema, so that a body the schema calls valid is
one the API accepts, and a client (or schemathesis) can read the limits off `/openapi.json`.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from agentloop.domain import (
    GOAL_PATTERN,
    MAX_ITERATIONS,
    MAX_PART_SCALE,
    MAX_SEED,
    MIN_PART_SCALE,
    WEBHOOK_SECRET_PATTERN,
    WEBHOOK_URL_PATTERN,
    available_revisers,
)
from agentloop.parts import MAX_PARTS
from agentloop.settings import Settings


def _constrain(prop: dict[str, Any], **rules: Any) -> None:
    """Add JSON Schema rules to a property, or to the non-null branch of an optional one."""
    for branch in prop.get("anyOf", [prop]):
        if branch.get("type") != "null":
            branch.update(rules)


def goal_request_limits(settings: Settings) -> dict[str, dict[str, Any]]:
    """JSON Schema rules per `GoalRequest` field: what `check_goal` enforces, as data."""
    from engine.catalog import known_models, known_scorers

    return {
        "goal": {"maxLength": settings.max_goal_chars, "pattern": GOAL_PATTERN},
        "budget": {"minimum": 1, "maximum": settings.max_budget},
        "fanout": {"minimum": 1, "maximum": settings.max_fanout},
        "max_iterations": {"minimum": 1, "maximum": MAX_ITERATIONS},
        "patience": {"minimum": 1, "maximum": MAX_ITERATIONS},
        "target_score": {"exclusiveMinimum": 0, "maximum": 2.5},
        "init_strength": {"exclusiveMinimum": 0, "maximum": 1},
        "parts": {"minItems": 2, "maxItems": MAX_PARTS},
        "guidance": {"minimum": 0},
        "seed": {"minimum": 0, "maximum": MAX_SEED},
        "steps": {"minimum": 1, "maximum": settings.max_steps},
        "size": {"minimum": 8, "maximum": settings.max_size - settings.max_size % 8,
                 "multipleOf": 8},
        # Local pipeline folders and open_clip "<model>:<tag>" names are accepted too; the
        # enum lists what this deployment has at hand.
        "model": {"enum": known_models(settings.extra_models)},
        "scorer": {"enum": known_scorers()},
        "reviser": {"enum": available_revisers(settings)},
    }


def _webhook_limits(webhook: dict[str, Any], settings: Settings) -> None:
    """The webhook's URL and secret rules; without a server secret, a goal must bring one."""
    props = webhook["properties"]
    _constrain(props["url"], pattern=WEBHOOK_URL_PATTERN)
    _constrain(props["secret"], pattern=WEBHOOK_SECRET_PATTERN)
    if not settings.webhook_secret:
        webhook["required"] = sorted({*webhook.get("required", []), "secret"})
        branches = [b for b in props["secret"].get("anyOf", []) if b.get("type") != "null"]
        if branches:
            props["secret"] = {k: v for k, v in props["secret"].items() if k != "anyOf"}
            props["secret"] |= branches[0]
            props["secret"].pop("default", None)


def openapi_with_limits(app: FastAPI, settings: Settings) -> dict[str, Any]:
    """The app's OpenAPI schema (built once) with `goal_request_limits` applied."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes,
        )
        props = schema["components"]["schemas"]["GoalRequest"]["properties"]
        for name, rules in goal_request_limits(settings).items():
            _constrain(props[name], **rules)
        _webhook_limits(schema["components"]["schemas"]["WebhookRequest"], settings)
        part = schema["components"]["schemas"]["PartRequest"]["properties"]
        _constrain(part["text"], pattern=GOAL_PATTERN)
        _constrain(part["place"], items={"type": "number", "minimum": 0, "maximum": 1})
        _constrain(part["scale"], minimum=MIN_PART_SCALE, maximum=MAX_PART_SCALE)
        app.openapi_schema = schema
    return app.openapi_schema
