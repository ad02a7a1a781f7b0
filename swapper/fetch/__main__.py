"""download-model.sh: what the models of backends/ need on disk, what is
present, and fetching the rest.

Driven by scripts/models.toml (the single source of truth for file names).
Standard library only (Python >= 3.11 for tomllib; the registry's aliases when
pyyaml is there); the Hugging Face CLI (`hf`, from huggingface_hub) is
installed into a private venv only when a download from the Hub needs it.

    python -m swapper.fetch --list              what each model needs, what is present
    python -m swapper.fetch MODEL... [--dry-run] fetch what is missing (or say what would be)
    python -m swapper.fetch all                  every model of the manifest
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from common.config import exit_on_error, read_dotenv

from ..settings import DownloadSettings
from .files import fetch_model
from .manifest import REPO, DownloadSpec, FetchError, hf_home, load_manifest, models_dir, \
    settings_of
from .status import source_text, status

# ------------------------------------------------------------------------ environment

def environment(models: dict[str, DownloadSpec]) -> dict[str, str]:
    """The downloader's settings and the models' file variables from os.environ,
    else from the repo's .env (as docker compose reads it); those for development
    and tests (HF_CLI, ...) from os.environ only. Empty values count as unset
    (like ${VAR:-default})."""
    fields = dataclasses.fields(DownloadSettings)
    outside = {f.name for f in fields if f.metadata.get("group") == "outside"}
    keys = {f.name for f in fields} - outside
    for m in models.values():
        keys.update(f.var for f in m.files if f.var)
        if m.var:
            keys.add(m.var)
    dotenv = read_dotenv(REPO / ".env")
    env = {}
    for k in sorted(keys | outside):
        v = os.environ.get(k) or ("" if k in outside else dotenv.get(k)) or ""
        if v:
            env[k] = v
    return env


# --------------------------------------------------------------------------- commands

def resolve_names(names: list[str], models: dict[str, DownloadSpec]) -> list[str]:
    """Model ids, or their aliases from backends/ when the registry can be read."""
    aliases: dict[str, str] = {}
    try:
        from ..registry import Registry  # needs pyyaml; optional
        for spec in Registry.load(REPO / "backends", env=dict(os.environ)):
            for a in spec.aliases:
                aliases[a] = spec.id
    except Exception:
        pass
    if names == ["all"]:
        return list(models)
    out, unknown = [], []
    for n in names:
        mid = n if n in models else aliases.get(n)
        if mid in models:
            if mid not in out:
                out.append(mid)
        else:
            unknown.append(n)
    if unknown:
        raise SystemExit(f"download-model.sh: unknown model {', '.join(unknown)} "
                         f"(known: {', '.join(models)}; see --list)")
    return out


def cmd_list(models: dict[str, DownloadSpec], env: dict) -> int:
    print(f"MODELS_DIR {models_dir(env)}")
    print(f"HF cache   {hf_home(env)}/hub"
          f"   (HF_TOKEN {'set' if settings_of(env).HF_TOKEN else 'not set'})")
    for m in models.values():
        try:
            sts = status(m, env)
        except FetchError as e:
            print(f"\n{m.id}: {e}")
            continue
        ready = "ready" if all(s.ok for s in sts) else "needs download"
        print(f"\n{m.id}  [{ready}]  {m.description}")
        print(f"  from {source_text(m, env)}")
        for s in sts:
            print(f"  {s.describe()}")
    return 0


def cmd_fetch(ids: list[str], models: dict[str, DownloadSpec], env: dict, dry_run: bool) -> int:
    failed = []
    for mid in ids:
        m = models[mid]
        try:
            sts = status(m, env)
            todo = [s for s in sts if not s.ok]
            if not todo:
                for s in sts:
                    print(f"{mid}: already {s.describe()}")
                continue
            for s in todo:
                verb = "would fetch" if dry_run else "fetching"
                print(f"{mid}: {s.describe()} — {verb} from {source_text(m, env)}", flush=True)
            if dry_run:
                continue
            fetch_model(m, env, todo, waiting=lambda: print(
                f"{mid}: waiting for another download into MODELS_DIR (the stack's, or "
                f"another download-model.sh) to end", flush=True))
            print(f"{mid}: ready")
        except FetchError as e:
            print(f"{mid}: ERROR: {e}", file=sys.stderr)
            failed.append(mid)
    if failed:
        print(f"download-model.sh: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="download-model.sh",
        description="Fetch what the models of backends/ need into MODELS_DIR (GGUF files) "
                    "or the Hugging Face cache HF_HOME (vLLM checkpoints). A no-op for what "
                    "is present. Reads MODELS_DIR, HF_HOME, HF_TOKEN and the model file "
                    "variables from the environment or .env.")
    p.add_argument("models", nargs="*", help="model ids or aliases, or 'all'")
    p.add_argument("--list", action="store_true", help="what each model needs and what is present")
    p.add_argument("--dry-run", action="store_true", help="say what would be fetched, fetch nothing")
    args = p.parse_args(argv)
    models = load_manifest()
    env = environment(models)
    exit_on_error(lambda: settings_of(env), "download-model.sh")  # bad value: one line, exit 2
    if args.list or not args.models:
        rc = cmd_list(models, env)
        if not args.models and not args.list:
            print("\nName models to fetch (or 'all'): ./download-model.sh smollm2")
        return rc
    return cmd_fetch(resolve_names(args.models, models), models, env, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
