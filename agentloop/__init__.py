"""agentloop: agent-driven generation loops on diffusion models.

`from agentloop import Client` stays light: nothing here imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["AsyncClient", "Client", "__version__"]

if TYPE_CHECKING:
    from agentloop.sdk import AsyncClient, Client


def __getattr__(name: str) -> Any:
    if name in ("Client", "AsyncClient"):
        from agentloop import sdk

        return getattr(sdk, name)
    raise AttributeError(name)
