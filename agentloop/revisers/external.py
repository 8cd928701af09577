"""The external reviser: the caller supplies each iteration's prompts over HTTP."""

from __future__ import annotations

from agentloop.revisers.base import Proposal, ReviserContext


class ExternalReviser:
    """Proposes nothing by itself: the goal waits for `POST /v1/goals/{id}/iterations`."""

    name = "external"

    def propose(self, ctx: ReviserContext) -> Proposal:
        return Proposal([], {"strategy": "external", "reason": "waiting for the caller's prompts"})
