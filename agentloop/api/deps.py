"""Dependency aliases for routes."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from agentloop.dispatch import Dispatcher
from agentloop.settings import Settings
from agentloop.store import Store


def _store(request: Request) -> Store:
    return request.app.state.store


def _dispatcher(request: Request) -> Dispatcher:
    return request.app.state.dispatcher


def _settings(request: Request) -> Settings:
    return request.app.state.settings


StoreDep = Annotated[Store, Depends(_store)]
DispatcherDep = Annotated[Dispatcher, Depends(_dispatcher)]
SettingsDep = Annotated[Settings, Depends(_settings)]
