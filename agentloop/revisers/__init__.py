"""Revisers: plug-ins that turn a scored history into the next candidates."""

from __future__ import annotations

from functools import lru_cache

from agentloop.llm import LlmConfig
from agentloop.revisers.base import Proposal, Reviser, ReviserContext, derive_seed, objective
from agentloop.revisers.external import ExternalReviser
from agentloop.revisers.llm import LlmReviser
from agentloop.revisers.search import SearchReviser

REVISERS: dict[str, Reviser] = {
    "search": SearchReviser(), "external": ExternalReviser(), "llm": LlmReviser(None),
}
"""The revisers by name. The `llm` entry has no endpoint (it falls back to `search`); the
orchestrator gets the configured one from `get_reviser(name, llm=config)`."""

REVISER_NAMES: tuple[str, ...] = ("search", "external", "llm")
"""Every name a goal's `reviser` may take."""


def get_reviser(name: str, llm: LlmConfig | None = None) -> Reviser:
    """The reviser called `name`; `llm` is the endpoint the `llm` reviser asks."""
    if name == "llm" and llm is not None:
        return _llm_reviser(llm)
    try:
        return REVISERS[name]
    except KeyError:
        raise ValueError(f"unknown reviser {name!r}; known: {sorted(REVISERS)}") from None


@lru_cache(maxsize=8)
def _llm_reviser(config: LlmConfig) -> LlmReviser:
    """One `llm` reviser (and so one HTTP connection pool) per endpoint configuration."""
    return LlmReviser(config)


__all__ = [
    "REVISERS", "REVISER_NAMES", "ExternalReviser", "LlmReviser", "Proposal", "Reviser",
    "ReviserContext", "SearchReviser", "derive_seed", "get_reviser", "objective",
]
