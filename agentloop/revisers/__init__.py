"""Revisers: plug-ins that turn a scored history into the next candidates."""

from agentloop.revisers.base import Proposal, Reviser, ReviserContext, derive_seed, objective
from agentloop.revisers.external import ExternalReviser
from agentloop.revisers.search import SearchReviser

REVISERS: dict[str, Reviser] = {"search": SearchReviser(), "external": ExternalReviser()}


def get_reviser(name: str) -> Reviser:
    """The registered reviser called `name`."""
    try:
        return REVISERS[name]
    except KeyError:
        raise ValueError(f"unknown reviser {name!r}; known: {sorted(REVISERS)}") from None


__all__ = [
    "REVISERS", "ExternalReviser", "Proposal", "Reviser", "ReviserContext", "SearchReviser",
    "derive_seed", "get_reviser", "objective",
]
