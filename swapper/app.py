"""The swapper's app factory: it builds the parts of one swapper process, wires
them together, and registers the routes (swapper.routes). State lives in the
scheduler; Docker effects in the runtime (performed by the driver)."""
from __future__ import annotations

from dataclasses import dataclass

from flask import Flask

from common.errors import install_error_handlers
from common.guard import harden
from common.origins import OriginGuard, split_list

from . import routes
from .driver import Driver
from .events import EventHub
from .fanout import FanOut
from .forward import Forwarder
from .lease import Admission, EndsLeases
from .loadtimes import LoadTimes
from .metrics import SwapperMetrics
from .policy import SwapPolicy
from .prefetch import Prefetcher, local_view, model_files
from .registry import Registry
from .runtime import DockerRuntime, Runtime
from .scheduler import Scheduler
from .settings import Settings


@dataclass
class Parts:
    """The parts of one swapper process, wired together."""
    settings: Settings
    registry: Registry
    scheduler: Scheduler
    runtime: Runtime
    driver: Driver
    admission: Admission
    forwarder: Forwarder
    fanout: FanOut
    metrics: SwapperMetrics
    events: EventHub


def build(settings: Settings, runtime: Runtime | None = None) -> Parts:
    registry = Registry.load(settings.BACKENDS_DIR, settings.env, settings.DEFAULT_MODEL)
    scheduler = Scheduler(lambda m: registry.models[m].slots, max_queue=settings.MAX_QUEUE,
                          backoff_base=settings.CRASH_BACKOFF, backoff_max=settings.CRASH_BACKOFF_MAX,
                          load_times=LoadTimes.for_settings(settings),
                          policy=SwapPolicy.from_settings(settings))
    runtime = runtime or DockerRuntime(settings, registry)
    metrics = SwapperMetrics(scheduler.snapshot, tenants=settings.METRICS_TENANTS)
    events = EventHub()
    scheduler.listeners.subscribe(events.publish)
    scheduler.listeners.subscribe(metrics.scheduler_event)
    view = local_view(settings)
    prefetcher = Prefetcher(lambda m: model_files(registry.models[m], view),
                            int(settings.PREFETCH_RESERVE_GB * 2**30), settings.PREFETCH)
    scheduler.listeners.subscribe(prefetcher.scheduler_event)
    driver = Driver(scheduler, runtime, registry, settings, metrics)
    admission = Admission(scheduler, driver, metrics)
    forwarder = Forwarder(admission, settings)
    return Parts(settings, registry, scheduler, runtime, driver, admission, forwarder,
                 FanOut(forwarder), metrics, events)


def create_app(settings: Settings | None = None, runtime: Runtime | None = None) -> Flask:
    settings = settings or Settings.from_env()
    sw = build(settings, runtime)
    sw.driver.start()

    app = Flask("swapper")
    app.extensions["swapper"] = sw          # the parts: routes.parts(), tests, debugging
    harden(app)
    install_error_handlers(app)
    for bp in (routes.status, routes.control, routes.traffic):
        app.register_blueprint(bp)
    app.wsgi_app = EndsLeases(app.wsgi_app)  # where every request's leases end
    # Outermost: Host checked (the compose service name, loopback names, IP
    # addresses, ALLOWED_HOSTS), browsers from other origins refused, backends'
    # CORS fields dropped (common.origins). The proxy sends no browser fields.
    app.wsgi_app = OriginGuard(app.wsgi_app,
                               allowed_hosts=("swapper",) + split_list(settings.ALLOWED_HOSTS))
    return app
