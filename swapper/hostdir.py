"""The host folder that relative volume paths of backends/ (`./models`) resolve against.

The Docker daemon needs host paths for bind mounts, also when the swapper itself runs
in a container. Under compose that folder is the compose project's folder, which compose
resolved (from the compose file's location, not from where `docker compose` was run)
when it created the swapper's container: it is on the container's
`com.docker.compose.project.working_dir` label, and `./backends` is bind-mounted from
under it. So, in order:

  1. HOST_DIR, when set (an operator's explicit choice);
  2. the compose project folder of the swapper's own container (its label, else the
     parent of the host folder mounted on BACKENDS_DIR);
  3. the settings' default (the repository folder: `python -m swapper` outside Docker).
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("swapper.hostdir")

COMPOSE_DIR_LABEL = "com.docker.compose.project.working_dir"
# Docker bind-mounts /etc/hostname (and hosts, resolv.conf) from the container's own
# folder, /var/lib/docker/containers/<id>/: the id of the container we run in.
_OWN_ID = re.compile(r"/containers/([0-9a-f]{64})/(?:hostname|hosts|resolv\.conf)\s")


def own_container_id(mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The id of the Docker container this process runs in, or None."""
    try:
        with open(mountinfo) as f:
            m = _OWN_ID.search(f.read())
    except OSError:
        return None
    return m.group(1) if m else None


def from_container(attrs: dict, backends_dir: str) -> str | None:
    """The compose project folder of a container, from `docker inspect` attributes."""
    labels = (attrs.get("Config") or {}).get("Labels") or {}
    if labels.get(COMPOSE_DIR_LABEL):
        return labels[COMPOSE_DIR_LABEL]
    want = os.path.normpath(backends_dir)
    for m in attrs.get("Mounts") or []:
        if m.get("Type") == "bind" and os.path.normpath(m.get("Destination", "")) == want:
            return os.path.dirname(os.path.normpath(m["Source"]))
    return None


def host_dir(settings, client: Callable[[], Any], container_id: str | None = None) -> str:
    """Where `./` of backends/ is on the host (see the module's docstring). `client`
    makes the engine's client, asked only when the swapper runs in a container."""
    explicit = (settings.env.get("HOST_DIR") or "").strip()
    if explicit:
        return explicit
    cid = container_id or own_container_id()
    if cid:
        try:
            found = from_container(client().api.inspect_container(cid), settings.BACKENDS_DIR)
        except Exception as e:  # noqa: BLE001 - not fatal: fall back, say so
            log.warning("cannot inspect the swapper's own container %s (%s); relative volume "
                        "paths resolve against %s (set HOST_DIR)", cid[:12], e, settings.HOST_DIR)
            found = None
        if found:
            log.info("relative volume paths of backends/ resolve against %s "
                     "(the compose project folder)", found)
            return found
    return settings.HOST_DIR or str(Path(__file__).resolve().parent.parent)
