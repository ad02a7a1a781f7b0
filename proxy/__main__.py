"""`python -m proxy`: serve the app with gunicorn and the gevent worker."""
from __future__ import annotations

from common.serve import serve

from .settings import Settings


def main() -> None:
    settings = Settings.from_env()

    def factory():
        from .app import create_app
        return create_app(settings)

    serve(factory, settings.PROXY_HOST, settings.PROXY_PORT, workers=settings.PROXY_WORKERS,
          name="coding-stack-proxy", loglevel=settings.LOG_LEVEL)


if __name__ == "__main__":
    main()
