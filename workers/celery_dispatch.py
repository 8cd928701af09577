"""The dispatcher that sends tasks through the Celery broker."""

from __future__ import annotations

from celery import Celery
from kombu.exceptions import ChannelError

from agentloop.dispatch import generation_queue


class CeleryDispatcher:
    """advance_goal → queue `control`; generate → queue `gen.<model>`."""

    def __init__(self, app: Celery):
        self.app = app

    def advance_goal(self, goal_id: str) -> None:
        self.app.send_task("agentloop.advance_goal", args=[goal_id], queue="control")

    def generate(self, model: str, candidate_ids: list[str]) -> None:
        self.app.send_task(
            "agentloop.generate", args=[list(candidate_ids)], queue=generation_queue(model)
        )

    def waiting(self, model: str) -> int:
        """Messages waiting in `model`'s generation queue (a passive declare: an empty Redis
        queue does not exist, which counts as none waiting)."""
        with self.app.connection_for_write() as conn:
            try:
                ok = conn.default_channel.queue_declare(generation_queue(model), passive=True)
            except ChannelError:
                return 0
            return int(ok.message_count)
