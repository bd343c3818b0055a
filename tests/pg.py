"""A throwaway PostgreSQL server for the tests, from the binaries in the `pgserver` wheel (dev extra).

    server = PostgresServer.start(bindir())   # initdb in a temp folder, postgres on a free loopback port
    server.url                                 # postgresql+asyncpg://postgres@127.0.0.1:PORT/postgres
    server.stop()                              # fast shutdown, folder removed

Only the wheel's binaries are used (not its `get_server`, which listens on a Unix socket only and, as
root, adds a system user). PostgreSQL refuses to run as root, and CI runs as root: then the server
runs as `nobody`, owning the temp folder; when the binaries sit under a folder `nobody` cannot enter
(a clone under /root), they are copied into that folder first. Settings fit a throwaway server:
trust authentication on 127.0.0.1 only, no fsync.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from support import free_port

log = logging.getLogger(__name__)

STARTUP_S = 60.0  # initdb + start take ~2 s idle; CI's 2 cores may be busy with other tests


def bindir() -> Path | None:
    """The `bin` folder of the PostgreSQL the `pgserver` wheel ships, or None when not installed."""
    spec = importlib.util.find_spec("pgserver")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "pginstall" / "bin"
    return path if (path / "postgres").exists() else None


class PostgresServer:
    """One postgres process on 127.0.0.1 with its data folder in a temp folder; see the module doc."""

    def __init__(self, bindir: Path, root: Path, proc: subprocess.Popen[bytes], port: int) -> None:
        self.bindir = bindir
        self.root = root
        self.proc = proc
        self.port = port
        self.url = f"postgresql+asyncpg://postgres@127.0.0.1:{port}/postgres"

    @classmethod
    def start(cls, bindir: Path) -> PostgresServer:
        root = Path(tempfile.mkdtemp(prefix="rlproxy-pg-"))
        try:
            user = _run_as()
            if user:
                os.chown(root, user["user"], user["group"])
                bindir = _reachable(bindir, root, user)
            init = subprocess.run(
                [bindir / "initdb", "-D", root / "data", "-U", "postgres", "-A", "trust", "-E", "UTF8",
                 "--no-locale", "--no-sync"],
                capture_output=True, text=True, timeout=STARTUP_S, cwd=root, **user,
            )  # fmt: skip
            if init.returncode:
                raise RuntimeError(f"initdb failed ({init.returncode}):\n{init.stderr[-2000:]}")
            for _ in range(3):  # another process may take the free port before postgres binds it
                server = cls._launch(bindir, root, user)
                if server is not None:
                    return server
            raise RuntimeError("PostgreSQL found no free port in 3 tries")
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise

    @classmethod
    def _launch(cls, bindir: Path, root: Path, user: dict[str, Any]) -> PostgresServer | None:
        """postgres on a free port, once it accepts connections; None if the port was taken."""
        port = free_port()
        logfile = root / "server.log"
        with open(logfile, "ab") as out:
            proc = subprocess.Popen(
                [bindir / "postgres", "-D", root / "data", "-h", "127.0.0.1", "-p", str(port), "-k", root,
                 "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=root, **user,
            )  # fmt: skip
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                text = logfile.read_text(errors="replace")
                if "could not bind" in text or "already in use" in text:
                    return None
                raise RuntimeError(f"PostgreSQL exited with {proc.returncode}:\n{text[-2000:]}")
            ready = subprocess.run(
                [bindir / "pg_isready", "-q", "-h", "127.0.0.1", "-p", str(port), "-U", "postgres"],
                check=False, capture_output=True,
            )  # fmt: skip
            if ready.returncode == 0:
                log.info("PostgreSQL on 127.0.0.1:%d (data in %s)", port, root)
                return cls(bindir, root, proc, port)
            time.sleep(0.1)
        proc.kill()
        proc.wait()
        text = logfile.read_text(errors="replace")
        raise RuntimeError(f"PostgreSQL not ready after {STARTUP_S:.0f} s:\n{text[-2000:]}")

    def stop(self) -> None:
        """Fast shutdown (SIGINT: roll back, disconnect clients), then remove the folder."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)


def _run_as() -> dict[str, Any]:
    """subprocess arguments that drop root to `nobody` (PostgreSQL will not run as root); {} otherwise."""
    if os.geteuid() != 0:
        return {}
    nobody = pwd.getpwnam("nobody")
    return {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []}


def _reachable(bindir: Path, root: Path, user: dict[str, Any]) -> Path:
    """`bindir` if `user` can run it, else a copy of the installation (bin, lib, share) under `root`."""
    try:
        subprocess.run([bindir / "postgres", "--version"], check=True, capture_output=True, cwd=root, **user)
        return bindir
    except (PermissionError, subprocess.CalledProcessError):
        # The wheel's layout, kept: the binaries find libpq at $ORIGIN/../../../pgserver.libs.
        site, copy = bindir.parents[2], root / "site"
        for part in ("pgserver/pginstall/bin", "pgserver/pginstall/lib", "pgserver/pginstall/share",
                     "pgserver.libs"):  # fmt: skip
            if (site / part).exists():
                shutil.copytree(site / part, copy / part, symlinks=True)
        return copy / "pgserver" / "pginstall" / "bin"
