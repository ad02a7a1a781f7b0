"""Least privilege for the swapper process: started as root in its container,
it keeps only what it needs -- its own user, plus the group that owns the
Docker socket and those of the folders it writes (downloads on first use) --
before it serves anything."""
from __future__ import annotations

import grp
import logging
import os
import pwd

log = logging.getLogger("swapper")


def docker_socket(docker_host: str | None) -> str | None:
    """The Unix socket path of DOCKER_HOST (Docker's default when unset)."""
    host = docker_host or "unix:///var/run/docker.sock"
    return host[len("unix://"):] if host.startswith("unix://") else None


def drop_privileges(user: str, docker_host: str | None, writes: tuple[str, ...] = (),
                    groups_too: tuple[int, ...] = ()) -> str:
    """Become `user` with the Docker socket's group added. A folder of `writes`
    (MODELS_DIR mounted for downloads) that Docker has just made for its bind
    mount (root's, empty) becomes the user's; of any other, its group is added,
    so a group-writable folder of the host's user serves as it is. A no-op
    unless running as root with a user named. `groups_too`: more groups kept (the
    backends' own, which the KV-cache folders are shared with: swapper.kvcache).
    Returns what was done, for the log."""
    if not user or os.geteuid() != 0:
        return f"running as uid {os.geteuid()}"
    pw = pwd.getpwnam(user)
    groups = {pw.pw_gid, *groups_too}
    sock = docker_socket(docker_host)
    if sock and os.path.exists(sock):
        groups.add(os.stat(sock).st_gid)
    for folder in writes:
        if not folder or not os.path.isdir(folder):
            continue
        st = os.stat(folder)
        if st.st_uid == 0 and not os.listdir(folder):
            os.chown(folder, pw.pw_uid, pw.pw_gid)
        elif st.st_uid != pw.pw_uid:
            groups.add(st.st_gid)
    os.setgroups(sorted(groups))
    os.setgid(pw.pw_gid)
    os.setuid(pw.pw_uid)
    os.environ["HOME"] = pw.pw_dir
    names = ", ".join(_group_name(g) for g in sorted(groups))
    return f"running as {user} (uid {pw.pw_uid}, groups {names})"


def _group_name(gid: int) -> str:
    try:
        return f"{grp.getgrgid(gid).gr_name}({gid})"
    except KeyError:
        return str(gid)
