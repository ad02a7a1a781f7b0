"""A swapper's driver and scheduler on the fake runtime and a hand-moved clock, with
fake llama-servers whose slots save and restore (tests/support/fake_runtime.py): the
world of the prompt-cache tests (swapper/kvcache.py, swapper/conversations.py)."""
from pathlib import Path
from types import SimpleNamespace

from swapper.driver import Driver
from swapper.metrics import SwapperMetrics
from swapper.registry import ModelSpec
from swapper.scheduler import Scheduler
from swapper.settings import Settings

from .fake_runtime import FakeRuntime
from tests.support.clock import Clock


def sample(registry, name, **labels):
    return registry.get_sample_value(name, labels)


ARGS = ("-m", "/models/m.gguf", "-c", "2048", "--parallel", "2", "-t", "1")


def spec(model_id, idle_ttl=0.0, args=ARGS, kv=True, slots=2):
    return ModelSpec(id=model_id, kind="llamacpp", image="llama:1", port=8080,
                     health_path="/health", start_timeout=10, slots=slots, source="test",
                     idle_ttl=idle_ttl, args=args, kv_cache=kv)


def inline(fn, *args):
    fn(*args)
    return SimpleNamespace(join=lambda: None)


def make(tmp_path, servers, models=None, **settings):
    clock = Clock(100.0)
    models = models or {m.id: m for m in (spec("a"), spec("b"), spec("ttl", idle_ttl=30))}
    sched = Scheduler(lambda m: models[m].slots, clock=clock)
    runtime = FakeRuntime({m: s.url for m, s in servers.items()})
    s = Settings(KV_CACHE_DIR=str(tmp_path), **settings)
    metrics = SwapperMetrics()
    events = []
    sched.listeners.subscribe(lambda e, f: events.append((e, f)))
    driver = Driver(sched, runtime, SimpleNamespace(models=models), s, metrics,
                    sleep=clock.sleep, clock=clock, spawn=inline)
    return SimpleNamespace(sched=sched, runtime=runtime, driver=driver, clock=clock,
                           metrics=metrics, events=events, root=tmp_path, models=models)


def turn(w, n=1):
    for _ in range(n):
        w.driver.step(timeout=0)


def files(folder: Path):
    return sorted(p.name for p in folder.iterdir())
