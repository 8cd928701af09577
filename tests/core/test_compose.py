"""docker-compose.yml cannot run here (no Docker engine); parse it and check it against the code."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from agentloop.dispatch import generation_queue
from agentloop.settings import Settings
from workers.app import app as celery_app

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def _cmd(name: str) -> list[str]:
    return SERVICES[name]["command"]


def test_has_every_service_with_a_healthcheck() -> None:
    expected = {"postgres", "redis", "migrate", "api", "control-worker", "gen-worker", "beat",
                "flower"}
    assert expected <= set(SERVICES)
    for name in expected - {"migrate", "beat"}:
        assert "healthcheck" in SERVICES[name], name
    assert SERVICES["migrate"]["restart"] == "no"


def test_every_long_running_service_restarts_when_it_exits() -> None:
    """A worker that dies (a crash, an out-of-memory kill, a library bug on a broker restart)
    must come back by itself: the sweep can only repair what a live worker runs."""
    for name, service in SERVICES.items():
        if name != "migrate":
            assert service.get("restart") in ("unless-stopped", "always"), name


def test_commands_match_the_cli_and_celery_app() -> None:
    from agentloop.cli import app as cli

    cli_commands = {c.name or c.callback.__name__ for c in cli.registered_commands}
    assert _cmd("migrate")[:3] == ["agentloop", "db", "upgrade"]
    assert _cmd("api")[:2] == ["agentloop", "serve"] and "serve" in cli_commands
    for name in ("control-worker", "gen-worker", "beat", "flower"):
        assert _cmd(name)[:3] == ["celery", "-A", "workers.app"]
    assert celery_app.main == "agentloop"


def test_queues_match_the_dispatcher() -> None:
    control, gen = _cmd("control-worker"), _cmd("gen-worker")
    assert control[control.index("-Q") + 1] == "control"
    env = SERVICES["gen-worker"]["environment"]
    assert gen[gen.index("-Q") + 1] == generation_queue(env["AGENTLOOP_DEFAULT_MODEL"])
    # a thread pool of one: one CUDA context, and a consumer that answers while a batch runs
    assert gen[gen.index("--pool") + 1] == "threads" and gen[gen.index("-c") + 1] == "1"
    assert celery_app.conf.task_routes["agentloop.advance_goal"]["queue"] == "control"


def test_beat_sends_the_sweep_to_the_control_queue() -> None:
    assert _cmd("beat")[3] == "beat"
    schedule = celery_app.conf.beat_schedule
    assert set(schedule) == {"agentloop-sweep", "agentloop-webhooks"}
    entry = schedule["agentloop-sweep"]
    assert entry["task"] == "agentloop.sweep" and entry["task"] in celery_app.tasks
    assert entry["options"]["queue"] == "control"
    assert entry["schedule"] == Settings().sweep_interval_seconds
    hooks = schedule["agentloop-webhooks"]
    assert hooks["task"] == "agentloop.deliver_webhooks" and hooks["task"] in celery_app.tasks
    assert hooks["options"] == {"queue": "control",
                                "expires": Settings().webhook_interval_seconds}
    assert hooks["schedule"] == Settings().webhook_interval_seconds


def test_gen_worker_may_finish_its_batch_on_a_deploy() -> None:
    grace = SERVICES["gen-worker"]["stop_grace_period"]
    assert grace.endswith("m") and int(grace[:-1]) >= 5


def test_environment_names_are_settings() -> None:
    fields = {f"AGENTLOOP_{name.upper()}" for name in Settings.model_fields}
    for name, service in SERVICES.items():
        for key in service.get("environment", {}) if name not in ("postgres",) else ():
            if key.startswith("AGENTLOOP_") and key != "AGENTLOOP_MODELS_DIR":
                assert key in fields, f"{name}: {key} is not a Settings field"
    url = SERVICES["api"]["environment"]["AGENTLOOP_DATABASE_URL"]
    assert url.startswith("postgresql+psycopg://")
    pg = SERVICES["postgres"]["environment"]
    assert re.search(rf"{pg['POSTGRES_USER']}:{pg['POSTGRES_PASSWORD']}@postgres:5432/{pg['POSTGRES_DB']}$", url)


def test_gpu_worker_reserves_an_nvidia_device() -> None:
    devices = SERVICES["gen-worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]


def test_workers_share_the_artifacts_volume_with_the_api() -> None:
    assert "artifacts:/data/artifacts" in SERVICES["api"]["volumes"]
    assert "artifacts:/data/artifacts" in SERVICES["gen-worker"]["volumes"]
    assert SERVICES["api"]["environment"]["AGENTLOOP_ARTIFACTS_DIR"] == "/data/artifacts"


def test_gen_worker_keeps_its_compiled_code_across_restarts() -> None:
    """A worker compiles its denoiser (AGENTLOOP_ENGINE_COMPILE=auto); its Inductor and Triton
    caches live on a named volume, so a restarted worker reuses them."""
    gen = SERVICES["gen-worker"]
    env = gen["environment"]
    assert env["AGENTLOOP_BROKER_URL"] == SERVICES["api"]["environment"]["AGENTLOOP_BROKER_URL"]
    mounts = dict(v.split(":", 1)[::-1] for v in gen["volumes"])
    assert mounts.get("/data/compile-cache") in COMPOSE["volumes"]
    for key in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        assert env[key].startswith("/data/compile-cache/")
