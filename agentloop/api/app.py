"""The FastAPI application: `agentloop serve`, OpenAPI at /docs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from agentloop.api.errors import BodyLimit, install_error_handlers
from agentloop.api.openapi import openapi_with_limits
from agentloop.api.routes import router
from agentloop.dispatch import Dispatcher
from agentloop.domain import SWEEP_HEARTBEAT
from agentloop.mcp_server import mount_mcp
from agentloop.settings import Settings, get_settings
from agentloop.store import Store


def default_dispatcher(store: Store, settings: Settings) -> tuple[Dispatcher, object | None]:
    """Celery when a broker is configured; else the in-process runtime (embedded mode)."""
    if settings.broker_url:
        from workers.app import app as celery_app
        from workers.celery_dispatch import CeleryDispatcher

        return CeleryDispatcher(celery_app), None
    from workers.embedded import embedded_runtime

    dispatcher, _ctx = embedded_runtime(store, settings)
    return dispatcher, dispatcher


def create_app(
    settings: Settings | None = None, store: Store | None = None,
    dispatcher: Dispatcher | None = None,
) -> FastAPI:
    """The API over a store and a dispatcher (built from the settings when not given).

    The schema must already be migrated (`agentloop db upgrade`); the app never creates it.
    """
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        own_store = store is None
        app.state.settings = settings
        app.state.store = store or Store(
            settings.resolved_database_url(), settings.db_connect_timeout
        )
        closer = None
        if dispatcher is None:
            app.state.dispatcher, closer = default_dispatcher(app.state.store, settings)
        else:
            app.state.dispatcher = dispatcher
        async with mcp_running():
            yield
        if closer is not None:
            closer.close(wait=False)  # type: ignore[attr-defined]
        if own_store:
            app.state.store.dispose()

    app = FastAPI(
        title="agentloop",
        version="0.1.0",
        description="Agent-driven generation loops on diffusion models. Scores are "
        "CLIPScore = 2.5 * max(cos, 0) (Hessel et al. 2021).",
        lifespan=lifespan,
    )
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.include_router(router)
    # The MCP tools over streamable HTTP at /mcp (agentloop.mcp_server; docs/agents.md).
    mcp_running = mount_mcp(app, "/mcp", settings.mcp_allowed_hosts)
    app.openapi = lambda: openapi_with_limits(app, settings)  # type: ignore[method-assign]

    install_error_handlers(app, settings)

    @app.get("/healthz", responses={503: {"description": "the database does not answer"}},
             tags=["health"], operation_id="healthz", summary="Liveness, database and sweep check")
    def healthz() -> JSONResponse:
        """Liveness and database reachability (503 when the database does not answer), and
        whether the sweep that recovers lost work runs: `sweep` is "ok", "stale" (its last run
        is older than three intervals: Celery beat or the worker that runs it has stopped) or
        "never", with `sweep_last` its last run (ISO 8601 UTC, "" if none). A sweep that is not
        "ok" makes `status` "degraded", still with 200: this process itself is fine."""
        try:
            beat = app.state.store.heartbeat(SWEEP_HEARTBEAT)
        except Exception as exc:  # noqa: BLE001 - any database failure means unhealthy
            return JSONResponse({"status": "unavailable", "detail": str(exc)[:200]}, status_code=503)
        sweep = "never" if beat is None else "stale" if beat.stale else "ok"
        return JSONResponse({
            "status": "ok" if sweep == "ok" else "degraded",
            "database": "ok",
            "sweep": sweep,
            "sweep_last": "" if beat is None else beat.beat_at.isoformat(timespec="seconds") + "Z",
        })  # fmt: skip

    return app
