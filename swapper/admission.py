"""What a request handler does to get a slot: submit, wait (noticing a client
that goes away), and turn scheduler errors into OpenAI-envelope errors."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

from common.disconnect import POLL, client_gone
from common.errors import ApiError

from .scheduler import Cancelled, LoadFailed, QueueFull, Scheduler, Ticket


def wait_admitted(scheduler: Scheduler, model: str | None, environ: dict, metrics=None) -> Ticket:
    """Queue for `model` and block until admitted. Raises ApiError on failure."""
    try:
        ticket = scheduler.submit(model)
    except QueueFull as e:
        if metrics is not None:
            metrics.rejected("queue_full")
        raise ApiError(str(e), 503, code="queue_full",
                       headers={"Retry-After": str(e.retry_after)}) from None
    t0 = time.monotonic()
    try:
        while not scheduler.wait(ticket, POLL):
            if client_gone(environ):
                scheduler.cancel(ticket)
                raise ApiError("client disconnected while queued", 499, code="client_closed")
    except LoadFailed as e:
        raise ApiError(str(e), e.status, type_="upstream_error", code="load_failed") from None
    except Cancelled as e:
        raise ApiError(str(e), 499, code="client_closed") from None
    if metrics is not None and model is not None:
        metrics.queued(model, time.monotonic() - t0)
    return ticket


@contextmanager
def slot(scheduler: Scheduler, model: str, environ: dict, metrics=None) -> Iterator[Ticket]:
    """A slot held for the duration of a with-block (non-streaming uses)."""
    ticket = wait_admitted(scheduler, model, environ, metrics)
    ok = False
    try:
        yield ticket
        ok = True
    finally:
        scheduler.release(ticket, ok=ok)
