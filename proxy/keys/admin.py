"""The admin routes for keys (role admin: the door refuses a `use` key):

    GET  /admin/keys                    the active keys (?revoked=1: all)
    POST /admin/keys                    {"name", "role", "models", "max_concurrent",
                                         "rpm", "tokens_per_day", "weight"}: a new key;
                                        its token is in the answer, once
    GET  /admin/keys/<name>             one key, with its usage now
    POST /admin/keys/<name>             the fields to change (null clears a limit)
    POST /admin/keys/<name>/revoke      revoked at once (refused within a second)
    GET  /admin/usage?key=&model=&since=&until=
                                        usage per key, model and UTC day (since /
                                        until: YYYY-MM-DD, inclusive): rows and totals

State changes are POSTs (a link or an <img> changes nothing). A field out of
bounds is a 400 (invalid_key), a name an active key has a 409 (key_name_taken),
an unknown name a 404 (key_not_found). Without a store
(no KEYS_DB, no KEYS_DATABASE_URL) they answer 404 saying so."""
from __future__ import annotations

from flask import Blueprint, current_app, request

from common.errors import ApiError

from . import usage as usage_mod
from .store import FIELDS, NameTaken, StoreDown, UnknownKey

bp = Blueprint("keys", __name__)


def _store():
    store = current_app.extensions["proxy"].get("keys")
    if store is None:
        raise ApiError("keys are off: set KEYS_DB (SQLite) or KEYS_DATABASE_URL "
                       "(PostgreSQL)", 404, code="keys_off")
    return store


def _body() -> dict:
    body = request.get_json(force=True, silent=True)
    if not isinstance(body, dict):
        raise ApiError("send a JSON object", 400, code="invalid_json")
    return body


def _call(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except UnknownKey as e:
        raise ApiError(str(e), 404, code="key_not_found") from None
    except NameTaken as e:
        raise ApiError(str(e), 409, code="key_name_taken") from None
    except ValueError as e:
        raise ApiError(str(e), 400, code="invalid_key") from None
    except StoreDown:
        raise ApiError("the key database is unreachable", 503, code="key_store_unavailable",
                       headers={"Retry-After": "1"}) from None


@bp.get("/admin/keys")
def list_keys():
    revoked = request.args.get("revoked", "") in ("1", "true", "yes")
    return {"keys": [k.public() for k in _call(_store().keys, revoked)]}


@bp.post("/admin/keys")
def create_key():
    body = _body()
    name = body.pop("name", None)
    unknown = set(body) - set(FIELDS)
    if unknown:
        raise ApiError(f"unknown field(s): {', '.join(sorted(unknown))} (the fields: name, "
                       f"{', '.join(FIELDS)})", 400, code="invalid_key")
    key, token = _call(_store().create, name, **body)
    return {"key": key.public(), "token": token}, 201


@bp.get("/admin/keys/<name>")
def show_key(name):
    store = _store()
    key = _call(store.get, name)
    if key is None:
        raise ApiError(f"no key named '{name}'", 404, code="key_not_found")
    usage = _call(store.usage, key)
    return {"key": key.public(), "usage": {"in_flight": usage.in_flight,
                                           "requests_this_minute": usage.this_minute,
                                           "tokens_today": usage.tokens_today}}


@bp.post("/admin/keys/<name>")
def update_key(name):
    return {"key": _call(_store().update, name, **_body()).public()}


@bp.post("/admin/keys/<name>/revoke")
def revoke_key(name):
    return {"key": _call(_store().revoke, name).public()}


@bp.get("/admin/usage")
def usage():
    args = request.args
    days = {}
    for bound in ("since", "until"):
        value = args.get(bound)
        if value:
            try:
                days[bound] = usage_mod.day_number(value)
            except ValueError:
                raise ApiError(f"{bound} is a UTC date, YYYY-MM-DD, not {value!r}", 400,
                               code="invalid_date") from None
    store = _store()
    rows = _call(store.usage_rows, name=args.get("key") or None,
                 model=args.get("model") or None, **days)
    return {"rows": usage_mod.shown(rows), "totals": usage_mod.totals(rows),
            "pending_rows": store.pending()}
