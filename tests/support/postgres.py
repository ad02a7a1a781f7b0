"""A throwaway PostgreSQL cluster: Debian's `postgresql` package (tests/testbed/
setup.sh installs it), initdb in a temporary folder, a server on a free loopback
port, trust authentication, stopped and removed at the end. Run as the
`postgres` user when the tests run as root (the server refuses root). `stop()` /
`start()` take it down and up again on the same port and data (an outage)."""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile

from .servers import free_port


def bin_dir() -> str | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0)
    return os.path.dirname(found[-1]) if found else None


class Postgres:
    def __init__(self):
        self.bin = bin_dir()
        if self.bin is None:
            raise RuntimeError("PostgreSQL is not installed (apt-get install postgresql; "
                               "tests/testbed/setup.sh does)")
        self.port = free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self.user = "postgres" if os.geteuid() == 0 else None
        self.dir = tempfile.mkdtemp(prefix="coding-stack-pg-")
        self.data = os.path.join(self.dir, "data")
        self.log = os.path.join(self.dir, "log")
        if self.user:
            pw = pwd.getpwnam(self.user)
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)

    def _run(self, *args: str) -> None:
        r = subprocess.run([os.path.join(self.bin, args[0]), *args[1:]], user=self.user,
                           cwd=self.dir, capture_output=True, text=True)
        if r.returncode != 0:
            log = open(self.log).read()[-3000:] if os.path.exists(self.log) else ""
            raise RuntimeError(f"{args[0]} failed: {r.stdout}{r.stderr}\n{log}")

    def start(self) -> "Postgres":
        if not os.path.exists(self.data):
            self._run("initdb", "-D", self.data, "-A", "trust", "-U", "postgres", "--no-sync",
                      "-E", "UTF8")
        self._run("pg_ctl", "-D", self.data, "-l", self.log, "-w", "-t", "30", "-o",
                  f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.dir} "
                  # no fsync (the machine does not crash); commits still reach the WAL,
                  # so an immediate stop (a crash of the server) loses none
                  "-c fsync=off -c full_page_writes=off", "start")
        return self

    def stop(self) -> None:
        self._run("pg_ctl", "-D", self.data, "-w", "-m", "immediate", "stop")

    def close(self) -> None:
        try:
            self.stop()
        except RuntimeError:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc):
        self.close()
