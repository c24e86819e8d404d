"""Start real PostgreSQL and Redis servers from Debian's packages in temporary folders on free ports.

Used by the test session (fixtures in ``tests/conftest.py``) and from the command line to run a
whole pytest invocation against a fresh PostgreSQL::

    python -m tests.support.services --postgres -- pytest -m api
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from apps.simulator.processes import (
    ServiceUnavailable,
    free_port,
    running_http_server,
    stop_process_group,
    wait_for_port,
)

__all__ = ["ServiceUnavailable", "free_port", "running_http_server", "stop_process_group", "wait_for_port",
           "running_postgres", "running_redis", "PrivateRedis"]


def _postgres_bin_dir() -> Path:
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name))
    for candidate in reversed(candidates):
        if (Path(candidate) / "initdb").exists():
            return Path(candidate)
    raise ServiceUnavailable("PostgreSQL server binaries not found; run `make system-deps` (Debian package postgresql)")


def _as_postgres_user(cmd: list[str]) -> list[str]:
    # initdb and postgres refuse to run as root; Debian's package creates the 'postgres' account.
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *cmd]
    return cmd


@contextlib.contextmanager
def running_postgres() -> Iterator[str]:
    """Yield a ``postgres://`` URL of a throw-away server, stopped and deleted afterwards."""
    bin_dir = _postgres_bin_dir()
    workdir = Path(tempfile.mkdtemp(prefix="tokenpools-pg-"))
    data_dir = workdir / "data"
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        os.chown(workdir, pw.pw_uid, pw.pw_gid)
    port = free_port()
    log = open(workdir / "initdb.log", "w")  # noqa: SIM115  (closed in finally)
    proc: subprocess.Popen | None = None
    try:
        subprocess.run(
            _as_postgres_user([str(bin_dir / "initdb"), "-D", str(data_dir), "-U", "postgres", "--auth=trust",
                               "--encoding=UTF8", "--no-sync"]),
            check=True, stdout=log, stderr=subprocess.STDOUT,
        )
        proc = subprocess.Popen(
            _as_postgres_user([str(bin_dir / "postgres"), "-D", str(data_dir), "-p", str(port),
                               "-k", str(workdir), "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off",
                               "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]),
            stdout=log, stderr=subprocess.STDOUT,
        )
        wait_for_port(port, proc=proc)
        # The port opens a moment before the server accepts logins; retry createdb until it does.
        deadline = time.monotonic() + 30
        while True:
            result = subprocess.run(
                [str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "tokenpools"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            if result.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise ServiceUnavailable(f"createdb failed: {result.stdout.strip()}")
            time.sleep(0.1)
        yield f"postgres://postgres@127.0.0.1:{port}/tokenpools"
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        shutil.rmtree(workdir, ignore_errors=True)


class PrivateRedis:
    """A redis-server a test may stop and start again on the same port (`persistent`: with its data kept,
    an append-only file synced on every write), or freeze and thaw (SIGSTOP/SIGCONT)."""

    def __init__(self, *, persistent: bool = False) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.workdir = tempfile.mkdtemp(prefix="tokenpools-gw-redis-")
        self.persistent = persistent
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise ServiceUnavailable("redis-server not found; run `make system-deps` (Debian package redis-server)")
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.persistent else ["--appendonly", "no"]
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", *persistence,
             "--dir", self.workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port, proc=self.proc)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None

    def pause(self) -> None:
        """Freeze the server (a hung Redis: connections stay open, nothing answers)."""
        import signal

        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        import signal

        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def remove(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.resume()
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


@contextlib.contextmanager
def running_redis(*options: str) -> Iterator[str]:
    """Yield a ``redis://`` URL of a throw-away server without persistence (`options`: more of its command
    line, e.g. ``--requirepass``; the URL carries no password)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise ServiceUnavailable("redis-server not found; run `make system-deps` (Debian package redis-server)")
    workdir = Path(tempfile.mkdtemp(prefix="tokenpools-redis-"))
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir), "--protected-mode", "yes", *options],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port, proc=proc)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Run a command with DATABASE_URL and/or REDIS_URL pointing at fresh servers."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--" not in args:
        print("usage: python -m tests.support.services [--postgres] [--redis] -- COMMAND ...", file=sys.stderr)
        return 2
    split = args.index("--")
    flags, command = set(args[:split]), args[split + 1:]
    unknown = flags - {"--postgres", "--redis"}
    if unknown or not command:
        print(f"unknown flags {sorted(unknown)} or no command", file=sys.stderr)
        return 2
    env = dict(os.environ)
    with contextlib.ExitStack() as stack:
        if "--postgres" in flags:
            env["DATABASE_URL"] = stack.enter_context(running_postgres())
        if "--redis" in flags:
            env["REDIS_URL"] = stack.enter_context(running_redis())
        return subprocess.call(command, env=env)


if __name__ == "__main__":
    raise SystemExit(main())
