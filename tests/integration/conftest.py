"""Fixtures of the integration tests: real `nats-server` and `redis-server` processes, never
fakes, and `flexlb` child processes.

Server source, in order: `FLEXLB_TEST_NATS_URL` / `FLEXLB_TEST_REDIS_URL` when set; else the
binaries on PATH or from the `embedded` extra (`services.infra.find_binary`), started on
free loopback ports for the test session; else, when a Docker daemon answers,
testcontainers; else the test session fails with the install hint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.infra import InfraError, ManagedServer, find_binary, free_port, start_nats, start_redis
from services.up import with_secrets
from tests.integration.stack import wait_for

REPO = Path(__file__).resolve().parent.parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"


def _docker_reachable() -> bool:
    try:
        import docker  # noqa: PLC0415 - only with testcontainers installed

        docker.from_env().ping()
        return True
    except Exception:  # no client library, no daemon, no permission: not reachable
        return False


def _server(kind: str, tmp_path_factory):
    env_url = os.environ.get(f"FLEXLB_TEST_{kind.upper()}_URL")
    if env_url:
        return env_url, None
    try:
        find_binary(f"{kind}-server")
    except InfraError:
        if not _docker_reachable():
            raise
        from testcontainers.core.container import DockerContainer  # noqa: PLC0415

        image, port, cmd = ("nats:2", 4222, "-js") if kind == "nats" else ("redis:7", 6379, None)
        container = DockerContainer(image).with_exposed_ports(port)
        if cmd:
            container = container.with_command(cmd)
        container.start()
        host, mapped = container.get_container_host_ip(), container.get_exposed_port(port)
        scheme = "nats" if kind == "nats" else "redis"
        return f"{scheme}://{host}:{mapped}", container
    server = start_nats(str(tmp_path_factory.mktemp("nats"))) if kind == "nats" else start_redis()
    return server.url, server


def _serve(kind: str, tmp_path_factory):
    url, handle = _server(kind, tmp_path_factory)
    yield handle if isinstance(handle, ManagedServer) else url
    if handle is not None:  # our process or our container; an env-given URL is not ours to stop
        handle.stop()


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory):
    yield from _serve("nats", tmp_path_factory)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    yield from _serve("redis", tmp_path_factory)


def url_of(server) -> str:
    return server.url if isinstance(server, ManagedServer) else server


@pytest.fixture(scope="session")
def nats_url(nats_server) -> str:
    return url_of(nats_server)


@pytest.fixture(scope="session")
def redis_url(redis_server) -> str:
    return url_of(redis_server)


class Proc:
    """A `flexlb` child process with its output kept in a file (shown when a test fails)."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.argv = argv
        self.log_path = log_path
        self.log = open(log_path, "ab")
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *argv], env=env, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT
        )

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, sig=signal.SIGTERM, timeout_s: float = 20) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        self.log.close()
        return self.popen.returncode


@pytest.fixture
def spawn(tmp_path):
    """Start `flexlb ...` subprocesses; all are stopped at the end of the test."""
    procs: list[Proc] = []

    def _spawn(*argv: str, env: dict[str, str] | None = None, name: str | None = None) -> Proc:
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("FLEXLB_")}
        full_env["FLEXLB_UP_STATE"] = str(tmp_path / "last-up.json")  # not the user's ~/.local/state
        # A worker stopped at a test's end has nobody to finish its requests for: no drain
        # (30 s by default) unless the test asks (its --drain-timeout-s flag wins over this).
        full_env["FLEXLB_DRAIN_TIMEOUT_S"] = "0"
        full_env.update(env or {})
        proc = Proc(list(argv), full_env, tmp_path / f"{name or argv[0]}-{len(procs)}.log")
        procs.append(proc)
        return proc

    yield _spawn
    for p in procs:
        p.stop()


@pytest.fixture
def flexlb_up(spawn, tmp_path):
    """Run `flexlb up ARGS` and return (proc, state) once it has written its state file."""

    def _up(*argv: str, env: dict[str, str] | None = None, open_admin: bool = True) -> tuple[Proc, dict]:
        """`open_admin`: pass --open-admin (no admin token), so a test reads /admin/* plainly,
        unless it gives a token itself; tests/integration/test_security.py runs the default."""
        state_file = tmp_path / f"state-{time.monotonic_ns()}.json"
        if open_admin and "FLEXLB_ADMIN_TOKEN" not in (env or {}):
            argv = ("--open-admin", *argv)
        proc = spawn("up", "--port", str(free_port()), "--state-file", str(state_file), *argv, env=env, name="up")

        def ready():
            if proc.popen.poll() is not None:
                raise AssertionError(f"flexlb up exited with {proc.popen.returncode}:\n{proc.tail()}")
            return state_file.exists()

        wait_for(ready, 90, "flexlb up to write its state file")
        # (its NATS and Redis URLs with the credentials up generated: what its children use)
        return proc, with_secrets(json.loads(state_file.read_text()))

    return _up
