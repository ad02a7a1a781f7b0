"""`python -m proxy`: serve the app with gunicorn and the gevent worker.

A bad setting stops it here with one line naming the variable (exit status 2).
With several workers, the metrics go to prometheus_client's multiprocess files
(set up before any worker imports the library), so /metrics answers for all."""
from __future__ import annotations

from common.config import exit_on_error
from common.metrics import multiprocess_setup
from common.serve import serve

from .settings import Settings


def main() -> None:
    settings = exit_on_error(Settings.from_env, "proxy")
    child_exit, cleanup = multiprocess_setup(settings.PROXY_WORKERS)

    def factory():
        from .app import create_app
        return create_app(settings)

    serve(factory, settings.PROXY_HOST, settings.PROXY_PORT, workers=settings.PROXY_WORKERS,
          name="coding-stack-proxy", loglevel=settings.LOG_LEVEL,
          header_timeout=settings.HEADER_TIMEOUT, child_exit=child_exit, on_exit=cleanup)


if __name__ == "__main__":
    main()
