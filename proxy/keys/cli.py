"""`python -m proxy.keys` (under compose: `docker compose exec proxy python -m
proxy.keys ...`): make, list, change and revoke keys in the store the proxy's
settings name (KEYS_DATABASE_URL, else KEYS_DB). `create` prints the token once:
it is not stored (only its sha256) and cannot be shown again.

    python -m proxy.keys create alice --models qwen-moe,'qwen-*' --rpm 60
    python -m proxy.keys create ops --role admin
    python -m proxy.keys list [--revoked] [--json]
    python -m proxy.keys update alice --max-concurrent 2 --rpm none --weight 2
    python -m proxy.keys revoke alice
    python -m proxy.keys usage [--key alice] [--model qwen-moe] [--days 7] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys

from common.config import exit_on_error

from . import open_store, policy
from . import usage as usage_mod
from .store import StoreDown, UnknownKey


def _limit(value: str) -> int | None:
    if value.lower() in ("none", "off", "0"):
        return None
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a whole number or 'none', not {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"at least 1 (or 'none'), not {n}")
    return n


def _models(value: str) -> list[str]:
    return [m.strip() for m in value.split(",") if m.strip()]


def _name(value: str) -> str:
    try:
        return policy.check_name(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m proxy.keys", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    def fields(sp, creating: bool):
        # update: an option not given is absent from the namespace (SUPPRESS), so
        # only what was given changes; a limit given as 'none' clears it.
        def default(value):
            return value if creating else argparse.SUPPRESS
        sp.add_argument("--role", choices=policy.ROLES, default=default("use"))
        sp.add_argument("--models", type=_models, default=default(["*"]),
                        help="comma-separated ids, aliases or globs ('*': every model)")
        sp.add_argument("--max-concurrent", type=_limit, default=default(None),
                        help="requests in flight at once, over every worker ('none': no limit)")
        sp.add_argument("--rpm", type=_limit, default=default(None), help="requests per minute")
        sp.add_argument("--tokens-per-day", type=_limit, default=default(None),
                        help="prompt + completion tokens per UTC day")
        sp.add_argument("--weight", type=float, default=default(1.0),
                        help="share of the GPU against other keys (fair shares)")

    c = sub.add_parser("create", help="a new key; prints its token once")
    c.add_argument("name", type=_name)
    fields(c, True)
    ls = sub.add_parser("list", help="the keys (never their tokens)")
    ls.add_argument("--revoked", action="store_true", help="revoked keys too")
    ls.add_argument("--json", action="store_true")
    u = sub.add_parser("update", help="change a key's fields")
    u.add_argument("name")
    fields(u, False)
    r = sub.add_parser("revoke", help="refused from now on (within a second)")
    r.add_argument("name")
    us = sub.add_parser("usage", help="usage per key, model and UTC day, with totals")
    us.add_argument("--key", help="this key's name only")
    us.add_argument("--model", help="this model only (its id)")
    us.add_argument("--days", type=_limit, default=7,
                    help="the last N UTC days, today included (default 7; 'none': all)")
    us.add_argument("--json", action="store_true")
    return p


def _row(k) -> str:
    limits = ", ".join(f"{n}={v}" for n, v in (("max_concurrent", k.max_concurrent),
                                               ("rpm", k.rpm),
                                               ("tokens_per_day", k.tokens_per_day))
                       if v is not None) or "no limits"
    state = " REVOKED" if k.revoked is not None else ""
    return f"{k.name}\t{k.role}\t{','.join(k.models)}\tweight={k.weight:g}\t{limits}{state}"


def _usage(store, args, out) -> None:
    since = None if args.days is None else \
        usage_mod.today(store.clock()) - args.days + 1
    rows = store.usage_rows(name=args.key, model=args.model, since=since)
    totals = usage_mod.totals(rows)
    if args.json:
        print(json.dumps({"rows": usage_mod.shown(rows), "totals": totals}, indent=2),
              file=out)
        return
    head = ("day", "key", "model", "requests", "prompt", "cached", "completion",
            "queue_wait_s", "load_s")
    lines = [head] + [(usage_mod.day(r["day"]), r["key"], r["model"] or "-",
                       *(_figure(r[c]) for c in policy.SPENT_FIELDS)) for r in rows]
    lines.append(("total", "", "", *(_figure(totals[c]) for c in policy.SPENT_FIELDS)))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    for line in lines:
        print("  ".join(str(v).ljust(w) for v, w in zip(line, widths)).rstrip(), file=out)


def _figure(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def main(argv: list[str] | None = None, settings=None, out=sys.stdout) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if settings is None:
        from ..settings import Settings
        settings = exit_on_error(Settings.from_env, "proxy.keys")
    store = open_store(settings)
    if store is None:
        print("keys are off: set KEYS_DB (SQLite) or KEYS_DATABASE_URL (PostgreSQL)",
              file=sys.stderr)
        return 2
    try:
        if args.command == "create":
            key, token = store.create(args.name, role=args.role, models=args.models,
                                      max_concurrent=args.max_concurrent, rpm=args.rpm,
                                      tokens_per_day=args.tokens_per_day, weight=args.weight)
            print(_row(key), file=out)
            print(f"token (shown once, keep it): {token}", file=out)
        elif args.command == "list":
            keys = store.keys(revoked=args.revoked)
            if args.json:
                print(json.dumps([k.public() for k in keys], indent=2), file=out)
            else:
                for k in keys:
                    print(_row(k), file=out)
        elif args.command == "update":
            changes = {k: v for k, v in vars(args).items() if k not in ("command", "name")}
            print(_row(store.update(args.name, **changes)), file=out)
        elif args.command == "revoke":
            print(_row(store.revoke(args.name)), file=out)
        elif args.command == "usage":
            _usage(store, args, out)
    except (UnknownKey, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except StoreDown as e:
        print(f"error: the key database is unreachable: {e}", file=sys.stderr)
        return 3
    finally:
        store.close()
    return 0
