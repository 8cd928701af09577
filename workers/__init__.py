"""Celery workers: the app, its tasks, and per-process model residency."""
