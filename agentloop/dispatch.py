"""The dispatcher interface, and the in-process implementation the embedded mode uses.

A dispatcher hands two kinds of task to workers: `advance_goal(goal_id)` (the orchestrator's
step, queue `control`) and `generate(model, candidate_ids)` (queue `gen.<model>`). The
Celery implementation lives in `workers`; the in-process one below runs the very same task
functions in threads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

log = logging.getLogger(__name__)


def generation_queue(model: str) -> str:
    """The queue generation tasks for `model` go to."""
    return f"gen.{model}"


class Dispatcher(Protocol):
    """Sends tasks to whoever runs them. Calls must be safe from any thread."""

    def advance_goal(self, goal_id: str) -> None: ...

    def generate(self, model: str, candidate_ids: list[str]) -> None: ...


def queue_depth(dispatcher: Dispatcher, model: str) -> int | None:
    """How many generation messages wait in `model`'s queue, if the dispatcher can tell
    (`waiting(model)`); None when it cannot. The sweep resends a sent-but-unclaimed candidate
    at once when its queue is empty: its message was lost."""
    waiting = getattr(dispatcher, "waiting", None)
    if waiting is None:
        return None
    try:
        return waiting(model)
    except Exception:  # noqa: BLE001 - the broker may be down; then we cannot tell
        log.warning("could not read the depth of %s", generation_queue(model), exc_info=True)
        return None


def dispatch_generation(
    dispatcher: Dispatcher, model: str, candidate_ids: list[str], batch: int
) -> None:
    """Send candidates to generation in tasks of at most `batch` (each runs as one batch)."""
    step = max(1, batch)
    for i in range(0, len(candidate_ids), step):
        dispatcher.generate(model, candidate_ids[i : i + step])


class InProcessDispatcher:
    """Runs task functions in this process: one control thread and one generation thread.

    Generation requests that arrive while the generation thread is busy are coalesced, up to
    `max_coalesce` candidates per call, so goals running side by side share batches (the
    embedded counterpart of a GPU worker that batches whatever is queued for its model).
    The functions are bound later (`bind`) because they need this dispatcher themselves.
    Exceptions are logged and kept in `errors` so a caller waiting on a goal can stop.
    """

    def __init__(self, max_coalesce: int = 64):
        self._control = ThreadPoolExecutor(1, thread_name_prefix="agentloop-control")
        self._gen = ThreadPoolExecutor(1, thread_name_prefix="agentloop-gen")
        self._advance: Callable[[str], Any] | None = None
        self._generate: Callable[[list[str]], Any] | None = None
        self._lock = threading.Lock()
        self._pending: set[Future[None]] = set()
        self._gen_queue: list[str] = []
        self._draining = False
        self._closed = False
        self.max_coalesce = max_coalesce
        self.errors: list[BaseException] = []
        self._stopped = threading.Event()
        self._periodic: list[threading.Thread] = []

    def bind(self, advance: Callable[[str], Any], generate: Callable[[list[str]], Any]) -> None:
        """Set the task functions that the two kinds of task run."""
        self._advance, self._generate = advance, generate

    def advance_goal(self, goal_id: str) -> None:
        assert self._advance is not None, "bind() the task functions first"
        self._submit(self._control, self._advance, goal_id)

    def generate(self, model: str, candidate_ids: list[str]) -> None:
        assert self._generate is not None, "bind() the task functions first"
        with self._lock:
            self._gen_queue.extend(candidate_ids)
            if self._draining:
                return
            self._draining = True
        self._submit(self._gen, self._drain, None)

    def _drain(self, _: object) -> None:
        """Run queued generations in coalesced calls until the queue is empty."""
        assert self._generate is not None
        while True:
            with self._lock:
                ids = self._gen_queue[: self.max_coalesce]
                del self._gen_queue[: self.max_coalesce]
                if not ids or self._closed:
                    self._draining = False
                    return
            self._run(self._generate, ids)

    def _submit(self, pool: ThreadPoolExecutor, fn: Callable[[Any], Any], arg: object) -> None:
        with self._lock:
            if self._closed:
                return
            future = pool.submit(self._run, fn, arg)
            self._pending.add(future)
        future.add_done_callback(self._done)

    def _run(self, fn: Callable[[Any], Any], arg: object) -> None:
        try:
            fn(arg)
        except BaseException as exc:  # noqa: BLE001 - kept for the waiting caller
            log.exception("in-process task failed")
            self.errors.append(exc)

    def _done(self, future: Future[None]) -> None:
        with self._lock:
            self._pending.discard(future)

    def every(self, seconds: float, fn: Callable[[], Any]) -> None:
        """Run `fn` now and then every `seconds` in a thread of its own until `close` (the
        embedded reconciler). Its failures are logged, not kept: the next run tries again."""

        def loop() -> None:
            while not self._stopped.is_set():
                try:
                    fn()
                except Exception:  # noqa: BLE001 - a periodic job outlives one bad run
                    log.exception("periodic task failed")
                self._stopped.wait(seconds)

        thread = threading.Thread(target=loop, name="agentloop-periodic", daemon=True)
        self._periodic.append(thread)
        thread.start()

    def waiting(self, model: str) -> int:
        """Generation requests waiting in this process (any model: one queue serves all)."""
        with self._lock:
            return len(self._gen_queue)

    @property
    def busy(self) -> bool:
        """True while any task is queued or running."""
        with self._lock:
            return bool(self._pending) or bool(self._gen_queue)

    def close(self, wait: bool = True) -> None:
        """Stop taking tasks; with wait, let the running ones finish."""
        with self._lock:
            self._closed = True
        self._stopped.set()
        self._control.shutdown(wait=wait, cancel_futures=not wait)
        self._gen.shutdown(wait=wait, cancel_futures=not wait)
