"""backends/ -> validated model specs.

Layout of a registry folder (BACKENDS_DIR):

    kinds/<kind>.yaml     what every model of a kind shares (llamacpp, vllm)
    models/*.yaml         `models:` mapping model id -> spec, and optionally
                          `model_patterns:` (names agents ask for -> a registry model)

A model spec is its kind's template overlaid with the model's own keys.
`${VAR}` and `${VAR:-default}` are interpolated from the environment in every
string. Anything wrong (unknown key, duplicate id or alias, missing field, bad
type) raises RegistryError naming the file and key; the swapper refuses to start.
"""
from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

KINDS = ("llamacpp", "vllm")

# key -> (type, required). Types are checked after interpolation.
MODEL_KEYS: dict[str, tuple[type | tuple[type, ...], bool]] = {
    "kind": (str, True),
    "description": (str, False),
    "aliases": (list, False),
    "image": (str, True),
    "args": (list, False),
    "args_prefix": (list, False),
    "args_suffix": (list, False),
    "env": (dict, False),
    "volumes": (list, False),
    "gpus": (list, False),
    "port": (int, True),
    "health_path": (str, True),
    "start_timeout": ((int, float), True),
    "stop_timeout": ((int, float), False),
    "slots": (int, True),
    "idle_ttl": ((int, float), False),
    "context_length": (int, False),
    "shm_size": (str, False),
    "ipc_mode": (str, False),
    "system_prompt": (str, False),
    "max_tokens_floor": (int, False),
    "native_n": (bool, False),
    "vision": (bool, False),
    "healthcheck": (list, False),
    "user": (str, False),
    "late_system": (str, False),
    "preserve_reasoning": (bool, False),
    "kv_cache": (bool, False),
}

LATE_SYSTEM = ("convert", "merge", "keep")

# Names agents ask for on their own (Claude Code's claude-* tiers: opus/sonnet, haiku for
# background work; Codex's gpt-5* defaults) when no `model_patterns` is configured.
RESIDENT, DEFAULT = "@resident", "@default"
_STRICT = object()      # resolve() without `resident`: ids and aliases only
DEFAULT_PATTERNS: tuple[tuple[str, str], ...] = (
    ("claude-*", RESIDENT), ("gpt-5*", RESIDENT), ("codex-*", RESIDENT))

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class RegistryError(ValueError):
    """The registry is invalid; the message names the file and the key."""


@dataclass(frozen=True)
class ModelSpec:
    id: str
    kind: str
    image: str
    port: int
    health_path: str
    start_timeout: float
    slots: int
    source: str
    aliases: tuple[str, ...] = ()
    description: str = ""
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    volumes: tuple[str, ...] = ()
    gpus: tuple[str, ...] = ()
    stop_timeout: float = 10.0
    idle_ttl: float = 0.0
    context_length: int | None = None
    shm_size: str | None = None
    ipc_mode: str | None = None
    system_prompt: str | None = None
    max_tokens_floor: int | None = None
    native_n: bool | None = None
    healthcheck: tuple[str, ...] = ()
    user: str | None = None          # uid[:gid] the container runs as (None: the image's)
    vision: bool = False            # takes image parts (llama.cpp: has an --mmproj)
    late_system: str = "convert"    # system messages not first: convert | merge | keep (proxy/agents.py)
    preserve_reasoning: bool = False  # template keeps earlier turns' reasoning (preserve_thinking)
    # Slots saved before the backend stops, restored when it is next loaded
    # (llama.cpp only; the registry defaults it on for llamacpp models: docs/kv-cache.md).
    kv_cache: bool = False

    def public(self) -> dict:
        """The entry /v1/models shows for this model."""
        return {
            "id": self.id,
            "object": "model",
            "owned_by": "coding-stack",
            "aliases": list(self.aliases),
            "kind": self.kind,
            "description": self.description,
            "context_length": self.context_length,
            "slots": self.slots,
            "gpus": list(self.gpus),
            "system_prompt": self.system_prompt,
            "max_tokens_floor": self.max_tokens_floor,
            "vision": self.vision,
            "late_system": self.late_system,
            "preserve_reasoning": self.preserve_reasoning,
        }


@dataclass(frozen=True)
class ModelPattern:
    """Model names matching `match` (a shell-style glob, case-sensitive) that name no
    registry model go to `use`: a model id or alias, `@resident` (the resident or
    loading model, else the default: never a swap) or `@default`."""
    match: str
    use: str
    source: str = "built-in default"

    def __post_init__(self):
        object.__setattr__(self, "_re", re.compile(fnmatch.translate(self.match)))

    def matches(self, name: str) -> bool:
        return self._re.match(name) is not None


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Expand ${VAR} / ${VAR:-default} in every string of a YAML value."""
    if isinstance(value, str):
        def sub(m: re.Match) -> str:
            name, default = m.group(1), m.group(2)
            got = env.get(name)
            if got is None or (got == "" and default is not None):
                return default if default is not None else ""
            return got
        return _VAR.sub(sub, value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def _coerce(where: str, key: str, value: Any, want) -> Any:
    """Check a value's type; accept strings for numbers and booleans (from ${VAR})."""
    types = want if isinstance(want, tuple) else (want,)
    if isinstance(value, types) and (bool in types or not isinstance(value, bool)):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if bool in types and text in ("true", "false", "1", "0", "yes", "no"):
            return text in ("true", "1", "yes")
        for number in (int, float):
            if number in types:
                try:
                    return number(text)
                except ValueError:
                    pass
    raise RegistryError(f"{where}: key '{key}' must be {_tname(types)}, got {value!r}")


def _tname(types) -> str:
    names = {int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "a mapping", bool: "true or false"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def _load_yaml(path: Path) -> Any:
    try:
        with path.open() as f:
            return yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise RegistryError(f"{path}: not valid YAML: {e}") from None


def load_kinds(folder: Path) -> dict[str, tuple[str, dict]]:
    kinds: dict[str, tuple[str, dict]] = {}
    for path in sorted(folder.glob("*.y*ml")):
        data = _load_yaml(path) or {}
        if not isinstance(data, dict):
            raise RegistryError(f"{path}: a kind template must be a mapping")
        name = data.pop("kind", path.stem)
        if name not in KINDS:
            raise RegistryError(f"{path}: key 'kind': unknown backend kind {name!r} "
                                f"(known: {', '.join(KINDS)})")
        for key in data:
            if key not in MODEL_KEYS:
                raise RegistryError(f"{path}: unknown key '{key}'")
        kinds[name] = (str(path), data)
    return kinds


def _to_spec(model_id: str, raw: dict, where: str, kinds: dict, env: Mapping[str, str]) -> ModelSpec:
    if not isinstance(raw, dict):
        raise RegistryError(f"{where}: model '{model_id}' must be a mapping")
    for key in raw:
        if key not in MODEL_KEYS:
            raise RegistryError(f"{where}: model '{model_id}': unknown key '{key}' "
                                f"(known: {', '.join(sorted(MODEL_KEYS))})")
    kind = raw.get("kind")
    if kind is None:
        raise RegistryError(f"{where}: model '{model_id}': missing required key 'kind'")
    if kind not in kinds:
        raise RegistryError(f"{where}: model '{model_id}': key 'kind': unknown backend kind "
                            f"{kind!r} (known: {', '.join(sorted(kinds))})")
    merged = {**kinds[kind][1], **raw}
    merged = interpolate(merged, env)
    values: dict[str, Any] = {}
    for key, (want, required) in MODEL_KEYS.items():
        if key not in merged or merged[key] is None:
            if required:
                raise RegistryError(f"{where}: model '{model_id}': missing required key '{key}'")
            continue
        values[key] = _coerce(f"{where}: model '{model_id}'", key, merged[key], want)

    where_m = f"{where}: model '{model_id}'"
    for key in ("aliases", "args", "args_prefix", "args_suffix", "volumes", "gpus", "healthcheck"):
        for item in values.get(key, []):
            if not isinstance(item, (str, int, float)) or isinstance(item, bool):
                raise RegistryError(f"{where_m}: key '{key}' must hold strings, got {item!r}")
    env_map = values.get("env", {})
    for k, v in env_map.items():
        if not isinstance(v, (str, int, float)):
            raise RegistryError(f"{where_m}: key 'env.{k}' must be a string, got {v!r}")
    if values["slots"] < 1:
        raise RegistryError(f"{where_m}: key 'slots' must be at least 1")
    if values["start_timeout"] <= 0:
        raise RegistryError(f"{where_m}: key 'start_timeout' must be positive")
    if not values["health_path"].startswith("/"):
        raise RegistryError(f"{where_m}: key 'health_path' must start with '/'")
    if not values["image"]:
        raise RegistryError(f"{where_m}: key 'image' is empty")
    if values.get("late_system", "convert") not in LATE_SYSTEM:
        raise RegistryError(f"{where_m}: key 'late_system' must be one of "
                            f"{', '.join(LATE_SYSTEM)}, got {values['late_system']!r}")
    if values.get("kv_cache") and kind != "llamacpp":
        raise RegistryError(f"{where_m}: key 'kv_cache' is for llamacpp models only (vLLM has "
                            f"no slot save/restore: docs/kv-cache.md)")

    port = values["port"]
    def fill(key: str) -> list[str]:
        return [str(a).format(port=port, id=model_id) for a in values.get(key, [])]
    args = tuple(fill("args_prefix") + [str(a) for a in values.get("args", [])] + fill("args_suffix"))
    return ModelSpec(
        id=model_id,
        kind=kind,
        image=values["image"],
        port=port,
        health_path=values["health_path"],
        start_timeout=float(values["start_timeout"]),
        slots=values["slots"],
        source=where,
        aliases=tuple(str(a) for a in values.get("aliases", [])),
        description=values.get("description", ""),
        args=args,
        env={str(k): str(v) for k, v in env_map.items()},
        volumes=tuple(str(v) for v in values.get("volumes", [])),
        gpus=tuple(str(g) for g in values.get("gpus", [])),
        stop_timeout=float(values.get("stop_timeout", 10.0)),
        idle_ttl=float(values.get("idle_ttl", 0.0)),
        context_length=values.get("context_length"),
        shm_size=values.get("shm_size"),
        ipc_mode=values.get("ipc_mode"),
        system_prompt=values.get("system_prompt"),
        max_tokens_floor=values.get("max_tokens_floor"),
        native_n=values.get("native_n"),
        vision=values.get("vision", False),
        healthcheck=tuple(str(a).format(port=port, id=model_id)
                          for a in values.get("healthcheck", [])),
        user=values.get("user") or None,
        late_system=values.get("late_system", "convert"),
        preserve_reasoning=values.get("preserve_reasoning", False),
        kv_cache=values.get("kv_cache", kind == "llamacpp"),
    )


def _patterns(raw: Any, where: str, env: Mapping[str, str]) -> list[ModelPattern]:
    if not isinstance(raw, list):
        raise RegistryError(f"{where}: key 'model_patterns' must be a list of "
                            f"{{match: <glob>, use: <model | @resident | @default>}}")
    out = []
    for i, entry in enumerate(interpolate(raw, env)):
        at = f"{where}: model_patterns[{i}]"
        if not isinstance(entry, dict):
            raise RegistryError(f"{at} must be a mapping with keys 'match' and 'use'")
        extra = set(entry) - {"match", "use"}
        if extra:
            raise RegistryError(f"{at}: unknown key '{sorted(extra)[0]}' (known: match, use)")
        for key in ("match", "use"):
            if not isinstance(entry.get(key), str) or not entry[key]:
                raise RegistryError(f"{at}: key '{key}' must be a non-empty string")
        out.append(ModelPattern(entry["match"], entry["use"], at))
    return out


class Registry:
    """The models this stack may start, by id and by alias."""

    def __init__(self, models: list[ModelSpec], default: str | None = None,
                 patterns: list[ModelPattern] | None = None):
        self.models: dict[str, ModelSpec] = {m.id: m for m in models}
        self._names: dict[str, str] = {}
        for m in models:
            for name in (m.id, *m.aliases):
                self._names[name] = m.id
        if default is not None and default not in self._names:
            raise RegistryError(f"DEFAULT_MODEL {default!r} is not a registered model or alias "
                                f"(known: {', '.join(self.models)})")
        self.default = self._names[default] if default else (models[0].id if models else None)
        if patterns is None:
            patterns = [ModelPattern(m, u) for m, u in DEFAULT_PATTERNS]
        for p in patterns:
            if p.use not in (RESIDENT, DEFAULT) and p.use not in self._names:
                raise RegistryError(f"{p.source}: key 'use': {p.use!r} is not a registered model "
                                    f"or alias, {RESIDENT} or {DEFAULT} "
                                    f"(known: {', '.join(self.models)})")
        self.patterns: tuple[ModelPattern, ...] = tuple(patterns)

    def lookup(self, name: str | None) -> ModelSpec | None:
        """The spec for an id or alias only (None or '' = the default model)."""
        if not name:
            return self.models.get(self.default) if self.default else None
        model_id = self._names.get(name)
        return self.models[model_id] if model_id else None

    def resolve(self, name: str | None, resident: str | None | object = _STRICT,
                allowed: Callable[["ModelSpec"], bool] | None = None) -> ModelSpec | None:
        """The spec for an id or alias (None or '' = the default model), else None.

        Passing `resident` (the resident or loading model's name; None when nothing is
        loaded) also answers names matching `model_patterns` (agents' own tier names),
        `@resident` being that model else the default: what a request's `model` needs.
        Without it only ids and aliases resolve, as for names an operator writes
        (/load, /upstream, PRELOAD), where a typo stays a 404.

        `allowed` (a key's scope, common/scope.py) keeps a mapped name within it:
        when the pattern's model is outside, the resident model if allowed (no
        swap), else the default if allowed, else the first allowed in registry
        order; the pattern's model when none is (the caller refuses it)."""
        spec = self.lookup(name)
        if spec is not None or not name or resident is _STRICT:
            return spec
        p = self.mapping(name)
        if p is None:
            return None
        current = self.lookup(resident) if isinstance(resident, str) and resident in self._names \
            else None
        if p.use == RESIDENT:
            spec = current or self.lookup(None)
        else:
            spec = self.lookup(None if p.use == DEFAULT else p.use)
        if allowed is None or spec is None or allowed(spec):
            return spec
        return next((s for s in (current, self.lookup(None), *self.models.values())
                     if s is not None and allowed(s)), spec)

    def mapping(self, name: str | None) -> ModelPattern | None:
        """The pattern that maps `name`, or None when it is an id or alias (or no
        pattern matches): what a metric of mapped names counts by (`match`)."""
        if not name or name in self._names:
            return None
        for p in self.patterns:
            if p.matches(name):
                return p
        return None

    def __iter__(self):
        return iter(self.models.values())

    def __len__(self) -> int:
        return len(self.models)

    @classmethod
    def load(cls, folder: str | os.PathLike, env: Mapping[str, str] | None = None,
             default: str | None = None) -> "Registry":
        env = os.environ if env is None else env
        root = Path(folder)
        if not root.is_dir():
            raise RegistryError(f"{root}: registry folder not found")
        kinds = load_kinds(root / "kinds")
        models: list[ModelSpec] = []
        patterns: list[ModelPattern] | None = None
        seen: dict[str, str] = {}
        files = sorted((root / "models").glob("*.y*ml"))
        if not files:
            raise RegistryError(f"{root / 'models'}: no model files (*.yaml)")
        for path in files:
            data = _load_yaml(path) or {}
            top = {"models", "model_patterns"}
            if not isinstance(data, dict) or set(data) - top:
                extra = ", ".join(sorted(set(data) - top)) if isinstance(data, dict) else ""
                raise RegistryError(f"{path}: expected the top-level keys 'models' and "
                                    f"optionally 'model_patterns'"
                                    + (f" (unknown key '{extra}')" if extra else ""))
            if "model_patterns" in data:
                # files in name order, first match wins; any file's list replaces the defaults
                patterns = (patterns or []) + _patterns(data["model_patterns"] or [], str(path), env)
            entries = data.get("models") or {}
            if not isinstance(entries, dict):
                raise RegistryError(f"{path}: key 'models' must map model ids to specs")
            for model_id, raw in entries.items():
                model_id = str(model_id)
                if not _ID.match(model_id):
                    raise RegistryError(f"{path}: model id {model_id!r} must be letters, digits, '.', '_' or '-'")
                spec = _to_spec(model_id, raw, str(path), kinds, env)
                for name in (spec.id, *spec.aliases):
                    if name in seen:
                        raise RegistryError(f"{path}: model '{model_id}': name '{name}' is already "
                                            f"used by {seen[name]}")
                    seen[name] = f"{path} (model '{model_id}')"
                models.append(spec)
        return cls(models, default=default or None, patterns=patterns)
