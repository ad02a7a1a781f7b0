"""`python -m swapper` serves the swapper (gunicorn, ONE gevent worker: it owns
in-memory state). `python -m swapper --check` validates the registry."""
from __future__ import annotations

import argparse
import sys

from common.config import exit_on_error

from .registry import Registry, RegistryError
from .settings import Settings


def validate_registry(settings: Settings) -> int:
    """0 when the registry and the settings naming its models are valid; else
    1 (registry) or 2 (a setting), with the reason on stderr."""
    try:
        registry = Registry.load(settings.BACKENDS_DIR, settings.env, settings.DEFAULT_MODEL)
    except RegistryError as e:
        print(f"invalid registry: {e}", file=sys.stderr)
        return 1
    for var, name in (("PRELOAD", settings.PRELOAD), ("IDLE_MODEL", settings.IDLE_MODEL)):
        if name and registry.resolve(name) is None:
            print(f"invalid configuration: {var}={name!r} is not a model of the registry "
                  f"({', '.join(m.id for m in registry)})", file=sys.stderr)
            return 2
    print(f"registry {settings.BACKENDS_DIR}: {len(registry)} model(s), default {registry.default}")
    for m in registry:
        where = f"GPU {','.join(m.gpus)}" if m.gpus else "CPU"
        aliases = f" aliases: {', '.join(m.aliases)}" if m.aliases else ""
        print(f"  {m.id:<24} {m.kind:<9} {where:<10} slots {m.slots}  {m.image}{aliases}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m swapper", description=__doc__)
    parser.add_argument("--check", action="store_true",
                        help="validate the registry (BACKENDS_DIR), list its models, exit")
    args = parser.parse_args(argv)
    settings = exit_on_error(Settings.from_env, "swapper")   # bad value: one line, exit 2
    if args.check:
        return validate_registry(settings)
    rc = validate_registry(settings)
    if rc:
        return rc

    import logging

    from .kvcache import backend_ids
    from .privileges import drop_privileges
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Before gunicorn is imported: its settings take the process's uid then.
    logging.getLogger("swapper").info(
        drop_privileges(settings.SWAPPER_USER, settings.DOCKER_HOST,
                        writes=(settings.DOWNLOAD_MODELS_DIR or "",),
                        groups_too=tuple(g for g in [backend_ids(settings.BACKEND_USER)[1]]
                                         if g)))

    from common.serve import serve

    def factory():
        from .app import create_app
        return create_app(settings)

    def on_exit():
        # `docker compose down` / Ctrl-C: leave nothing running, nothing holding the
        # GPU; a llama.cpp backend's prompt caches are saved first (swapper.kvcache).
        from .kvcache import KvCache
        from .metrics import SwapperMetrics
        from .runtime import DockerRuntime
        try:
            registry = Registry.load(settings.BACKENDS_DIR, settings.env)
            runtime = DockerRuntime(settings, registry)
            kv = KvCache(settings, SwapperMetrics(), image_id=runtime.image_id)
            for backend in runtime.running():
                spec = registry.models[backend.model]
                if kv.enabled(spec):
                    outcome = kv.save(spec, backend)
                    print(f"swapper exit: saved {backend.model}'s prompt cache: "
                          f"{outcome.fields()}", file=sys.stderr)
            n = runtime.remove_all()
            print(f"swapper exit: removed {n} backend container(s)", file=sys.stderr)
        except Exception as e:
            print(f"swapper exit: could not save or remove backends: {e}", file=sys.stderr)

    # Its only client is the proxy next door: a short keep-alive lets
    # `docker compose down` finish (and remove the backend) promptly.
    serve(factory, settings.SWAPPER_HOST, settings.SWAPPER_PORT, workers=1, name="coding-stack-swapper",
          keepalive=5, on_exit=on_exit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
