"""The container files (Dockerfile, .dockerignore, docker-compose.yml) checked without an engine.

Every FlexLB service in the compose file must be something the real `flexlb` CLI accepts:
its `command` (the argv after the image's `flexlb` ENTRYPOINT) goes through
`services.cli.build_parser()`, its `FLEXLB_*` variables must be settings the loader knows, and
the settings built from both must validate. Each checking helper returns a list of problems,
and the negative tests feed it deliberately wrong input to show it can fail.

When a Docker daemon answers (`docker info`), `docker compose config -q` validates the file
against the Compose specification too; otherwise that one test is skipped.
"""

from __future__ import annotations

import contextlib
import fnmatch
import io
import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.cli import build_parser, router_settings, worker_config
from services.settings import ENV_PREFIX, RouterSettings, known_env_vars
from workers.config import WorkerConfig

REPO = Path(__file__).resolve().parent.parent.parent
COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
PYPROJECT = REPO / "pyproject.toml"

FLEXLB_SUBCOMMANDS = {"router", "worker"}  # what a compose service may run (not `up`: it starts its own servers)
NATS_PORT = 4222  # the nats-server default client port
REDIS_PORT = 6379  # the redis-server default port


# ---------------------------------------------------------------------------------------- loading
def load_compose() -> dict[str, Any]:
    with open(COMPOSE_FILE) as fh:
        return yaml.safe_load(fh)


def services_of(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose.get("services") or {}


def is_built_here(svc: dict[str, Any]) -> bool:
    """Built from this repository's Dockerfile (so its ENTRYPOINT is `flexlb`)."""
    build = svc.get("build")
    if build is None:
        return False
    if isinstance(build, str):
        context, dockerfile = build, "Dockerfile"
    else:
        context, dockerfile = build.get("context", "."), build.get("dockerfile", "Dockerfile")
    return (REPO / context).resolve() == REPO and dockerfile == "Dockerfile"


def in_ha(svc: dict[str, Any]) -> bool:
    return "ha" in (svc.get("profiles") or [])


def flexlb_services(compose: dict[str, Any], ha: bool = False) -> dict[str, dict[str, Any]]:
    """FlexLB services of the default stack, or (ha=True) of the `ha` profile's cluster."""
    return {name: svc for name, svc in services_of(compose).items() if is_built_here(svc) and in_ha(svc) == ha}


def env_of(svc: dict[str, Any]) -> dict[str, str | None]:
    """A service's `environment` (mapping or KEY=VALUE list) as strings, the way compose passes them.

    None marks a variable whose value would come from the host (`KEY` alone, or `KEY:` empty).
    """
    raw = svc.get("environment") or {}
    out: dict[str, str | None] = {}
    if isinstance(raw, list):
        for item in raw:
            key, sep, value = str(item).partition("=")
            out[key] = value if sep else None
        return out
    for key, value in raw.items():
        if isinstance(value, bool):
            value = "true" if value else "false"
        out[str(key)] = None if value is None else str(value)
    return out


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, line continuations joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = (pending + stripped).strip()
        pending = ""
        if full:
            word, _, args = full.partition(" ")
            out.append((word.upper(), args.strip()))
    return out


def dockerfile_values(name: str) -> list[str]:
    return [args for word, args in dockerfile_instructions(DOCKERFILE.read_text()) if word == name]


def exec_form(args: str) -> list[str] | None:
    """The JSON (exec) form of ENTRYPOINT/CMD, or None for the shell form."""
    try:
        value = json.loads(args)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None


# ---------------------------------------------------------------------------------------- checking helpers
def parse_command(command: Any) -> tuple[Any, list[str]]:
    """Parse `command` (argv after `flexlb`) with the real CLI parser: (namespace or None, problems)."""
    if not isinstance(command, list) or not all(isinstance(a, str) for a in command):
        return None, [f"command must be a list of strings (exec form), got {command!r}"]
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = build_parser().parse_args(command)
    except SystemExit as exc:
        message = stderr.getvalue().strip().splitlines()
        return None, [f"`flexlb {' '.join(command)}` is rejected by the CLI parser (exit {exc.code}): "
                      f"{message[-1] if message else 'no message'}"]
    if args.command not in FLEXLB_SUBCOMMANDS:
        return None, [f"`flexlb {args.command}` is not a service command; expected one of {sorted(FLEXLB_SUBCOMMANDS)}"]
    return args, []


def check_env(env: dict[str, str | None]) -> list[str]:
    known = known_env_vars(RouterSettings, WorkerConfig)
    problems = []
    for key, value in env.items():
        if not key.startswith(ENV_PREFIX):
            continue
        if key not in known:
            problems.append(f"{key} is not a FlexLB setting (known: {', '.join(sorted(known))})")
        if value is None:
            problems.append(f"{key} has no value (it would be taken from the host environment)")
    return problems


def check_flexlb_service(name: str, command: Any, env: dict[str, str | None]) -> tuple[Any, list[str]]:
    """Everything the real CLI would check at start: (RouterSettings | WorkerConfig | None, problems)."""
    problems = [f"{name}: {p}" for p in check_env(env)]
    args, parse_problems = parse_command(command)
    problems += [f"{name}: {p}" for p in parse_problems]
    if args is None:
        return None, problems
    environ = {k: v for k, v in env.items() if v is not None}
    try:
        if args.command == "router":
            settings = router_settings(args, environ=environ)
        else:
            settings = worker_config(args, environ=environ)
    except ValueError as exc:  # SettingsError is a ValueError; WorkerConfig.validate raises ValueError
        return None, problems + [f"{name}: `flexlb {' '.join(command)}` with {environ} is invalid: {exc}"]
    return settings, problems


def check_depends_on(compose: dict[str, Any]) -> list[str]:
    """Every dependency exists, and `service_healthy` is only asked of services with a health check."""
    services = services_of(compose)
    problems = []
    for name, svc in services.items():
        deps = svc.get("depends_on") or {}
        if isinstance(deps, list):
            deps = {d: {"condition": "service_started"} for d in deps}
        for dep, spec in deps.items():
            if dep not in services:
                problems.append(f"{name} depends on unknown service {dep!r}")
                continue
            condition = (spec or {}).get("condition", "service_started")
            if condition not in {"service_started", "service_healthy", "service_completed_successfully"}:
                problems.append(f"{name} -> {dep}: unknown condition {condition!r}")
            if condition == "service_healthy" and not services[dep].get("healthcheck"):
                problems.append(f"{name} waits for {dep} to be healthy, but {dep} has no healthcheck")
    return problems


def check_router_port(svc: dict[str, Any], settings: RouterSettings, exposed: list[str]) -> list[str]:
    """The router listens where compose publishes, the health check probes and the image exposes."""
    problems = []
    if settings.host not in {"0.0.0.0", "::"}:
        problems.append(f"router listens on {settings.host}: unreachable through a published port (set FLEXLB_HOST=0.0.0.0)")
    targets = []
    for spec in svc.get("ports") or []:
        if isinstance(spec, dict):
            targets.append(int(spec["target"]))
        else:
            targets.append(int(str(spec).split("/")[0].rsplit(":", 1)[-1]))
    if settings.port not in targets:
        problems.append(f"router listens on port {settings.port}, compose publishes container ports {targets}")
    exposed_ports = {int(p.split("/")[0]) for line in exposed for p in line.split()}
    if settings.port not in exposed_ports:
        problems.append(f"router listens on port {settings.port}, the Dockerfile exposes {sorted(exposed_ports)}")
    test = (svc.get("healthcheck") or {}).get("test")
    probe = " ".join(test) if isinstance(test, list) else str(test or "")
    m = re.search(r"http://[^/:\s'\"]+:(\d+)/readyz", probe)
    if not m:
        problems.append(f"router healthcheck does not probe /readyz: {probe!r}")
    elif int(m.group(1)) != settings.port:
        problems.append(f"router healthcheck probes port {m.group(1)}, router listens on {settings.port}")
    return problems


# ---------------------------------------------------------------------------------------- the stack
def test_compose_parses_and_has_the_stack():
    compose = load_compose()
    services = services_of(compose)
    for name in ("nats", "redis", "router"):
        assert name in services, f"docker-compose.yml has no {name!r} service: {sorted(services)}"
    workers = [n for n, s in flexlb_services(compose).items() if (s.get("command") or [None])[0] == "worker"]
    assert len(workers) >= 2, f"expected at least two worker services, got {workers}"
    routers = [n for n, s in flexlb_services(compose).items() if (s.get("command") or [None])[0] == "router"]
    assert routers == ["router"], f"expected exactly the `router` service to run `flexlb router`, got {routers}"


def test_nats_and_redis_use_official_images_configured_like_flexlb_up():
    services = services_of(load_compose())
    nats, redis = services["nats"], services["redis"]
    assert str(nats.get("image", "")).split(":")[0] == "nats", nats.get("image")
    assert str(redis.get("image", "")).split(":")[0] == "redis", redis.get("image")
    assert "build" not in nats and "build" not in redis
    cmd = nats["command"]
    assert "-js" in cmd, f"NATS without JetStream: {cmd}"
    store = cmd[cmd.index("-sd") + 1]
    mounts = [str(v).split(":")[1] if isinstance(v, str) else v.get("target") for v in nats.get("volumes") or []]
    assert store in mounts, f"JetStream store {store} is not a volume: {mounts}"
    assert "-m" in cmd and cmd[cmd.index("-m") + 1] == "8222", f"the /healthz probe needs monitoring on 8222: {cmd}"
    rcmd = redis["command"]
    assert rcmd[rcmd.index("--save") + 1] == "", f"redis persistence should be off: {rcmd}"
    assert rcmd[rcmd.index("--appendonly") + 1] == "no", f"redis AOF should be off: {rcmd}"
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


@pytest.mark.parametrize("name", sorted({**flexlb_services(load_compose()), **flexlb_services(load_compose(), ha=True)}))
def test_flexlb_service_is_accepted_by_the_real_cli(name):
    compose = load_compose()
    svc = {**flexlb_services(compose), **flexlb_services(compose, ha=True)}[name]
    settings, problems = check_flexlb_service(name, svc.get("command"), env_of(svc))
    assert not problems, "\n".join(problems)
    assert settings is not None


def test_every_flexlb_variable_in_compose_is_known():
    problems = []
    for name, svc in services_of(load_compose()).items():
        problems += [f"{name}: {p}" for p in check_env(env_of(svc))]
    assert not problems, "\n".join(problems)


def test_flexlb_services_reach_nats_and_redis_by_service_name():
    compose = load_compose()
    for name, svc in flexlb_services(compose).items():
        settings, problems = check_flexlb_service(name, svc["command"], env_of(svc))
        assert not problems, "\n".join(problems)
        assert settings.nats_url == f"nats://nats:{NATS_PORT}", f"{name}: nats_url {settings.nats_url}"
        deps = svc.get("depends_on") or {}
        assert "nats" in deps, f"{name} does not wait for nats"
        if isinstance(settings, RouterSettings):
            assert settings.redis_url.startswith(f"redis://redis:{REDIS_PORT}/"), f"{name}: redis_url {settings.redis_url}"
            assert "redis" in deps, f"{name} does not wait for redis"


def test_worker_ids_are_unique():
    ids = []
    for name, svc in flexlb_services(load_compose()).items():
        settings, problems = check_flexlb_service(name, svc["command"], env_of(svc))
        assert not problems, "\n".join(problems)
        if isinstance(settings, WorkerConfig):
            ids.append(settings.worker_id)
    assert len(ids) == len(set(ids)), f"duplicate worker ids (they would share a work queue): {ids}"


def test_depends_on_is_consistent():
    problems = check_depends_on(load_compose())
    assert not problems, "\n".join(problems)


def test_router_port_matches_publish_expose_and_healthcheck():
    svc = services_of(load_compose())["router"]
    settings, problems = check_flexlb_service("router", svc["command"], env_of(svc))
    assert not problems, "\n".join(problems)
    problems = check_router_port(svc, settings, dockerfile_values("EXPOSE"))
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------- the image
def test_dockerfile_entrypoint_and_default_command():
    froms = dockerfile_values("FROM")
    assert froms and froms[-1].split()[0] == "python:3.11-slim", f"final stage base: {froms}"
    entrypoints = dockerfile_values("ENTRYPOINT")
    assert entrypoints and exec_form(entrypoints[-1]) == ["flexlb"], f"ENTRYPOINT must be [\"flexlb\"]: {entrypoints}"
    cmds = dockerfile_values("CMD")
    assert cmds, "the Dockerfile has no default CMD"
    default = exec_form(cmds[-1])
    assert default is not None, f"CMD must be in exec form: {cmds[-1]}"
    settings, problems = check_flexlb_service("Dockerfile CMD", default, {})
    assert not problems, "\n".join(problems)


def test_dockerfile_runs_as_non_root_and_installs_without_embedded_extra():
    users = dockerfile_values("USER")
    assert users and users[-1].split(":")[0] not in {"root", "0"}, f"the image runs as root: USER {users}"
    runs = " ".join(dockerfile_values("RUN"))
    # from ".", plus the extras of the FLEXLB_EXTRAS build argument (empty by default; torch for the torch engine)
    assert re.search(r'pip install [^&;]*--no-cache-dir[^&;]* (\.|"\.\$\{FLEXLB_EXTRAS:\+\[\$FLEXLB_EXTRAS\]\}")(\s|$)', runs), \
        "the project is not pip-installed from ."
    assert dockerfile_values("ARG") == ['FLEXLB_EXTRAS=""'], "the image's extras must default to none"
    assert "embedded" not in runs, "the image must not install the embedded extra (compose runs NATS/Redis images)"


def test_dockerfile_copies_what_setuptools_needs_and_dockerignore_keeps_it():
    project = tomllib.loads(PYPROJECT.read_text())
    needed = {"pyproject.toml"}
    if isinstance(project["project"].get("readme"), str):
        needed.add(project["project"]["readme"])
    for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]:
        needed.add(pattern.rstrip("*").rstrip("."))
    copied: set[str] = set()
    for args in dockerfile_values("COPY"):
        parts = [p for p in (exec_form(args) or args.split()) if not p.startswith("--")]
        copied.update(p.rstrip("/").removeprefix("./") for p in parts[:-1])
    missing = {n for n in needed if n not in copied and "." not in copied}
    assert not missing, f"the Dockerfile does not COPY {sorted(missing)} (needed to build the package)"
    for name in needed:
        assert (REPO / name).exists(), f"{name} is copied but does not exist"
    ignored = []
    patterns = [ln.strip() for ln in DOCKERIGNORE.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    for name in needed:
        for pattern in patterns:
            if pattern.startswith("!"):
                continue
            pat = pattern.lstrip("/").removeprefix("**/")
            if fnmatch.fnmatch(name, pat) or fnmatch.fnmatch(name.split("/")[0], pat):
                ignored.append(f"{name} (by {pattern!r})")
    assert not ignored, f".dockerignore drops what the Dockerfile needs: {ignored}"


# ---------------------------------------------------------------------------------------- the checks can fail
@pytest.mark.parametrize(
    ("command", "env", "expected"),
    [
        (["worker", "--id", "w0", "--bogus-flag", "1"], {}, "rejected by the CLI parser"),
        (["router", "--port", "eighty"], {}, "rejected by the CLI parser"),
        (["serve"], {}, "rejected by the CLI parser"),
        ("router --port 8000", {}, "list of strings"),
        (["up"], {}, "not a service command"),
        (["router"], {"FLEXLB_NOT_A_SETTING": "1"}, "not a FlexLB setting"),
        (["router"], {"FLEXLB_PORT": "eighty"}, "FLEXLB_PORT"),
        (["router"], {"FLEXLB_LOG_LEVEL": "loud"}, "log_level"),
        (["router"], {"FLEXLB_NATS_URL": None}, "no value"),
        (["worker", "--id", "w0", "--role", "banana"], {}, "invalid"),
        (["worker", "--role", "pd_fusion"], {}, "worker_id"),  # no worker id at all
        (["worker", "--id", "w0", "--time-scale", "-1"], {}, "time_scale"),
    ],
)
def test_service_check_rejects_bad_input(command, env, expected):
    settings, problems = check_flexlb_service("bad", command, env)
    assert problems, f"{command} with {env} was accepted"
    assert any(expected in p for p in problems), problems


def test_depends_on_check_rejects_bad_input():
    compose = {"services": {
        "a": {"depends_on": {"b": {"condition": "service_healthy"}, "ghost": {"condition": "service_started"}}},
        "b": {"image": "x"},
    }}
    problems = check_depends_on(compose)
    assert any("no healthcheck" in p for p in problems), problems
    assert any("ghost" in p for p in problems), problems


def test_router_port_check_rejects_mismatches():
    svc = {"ports": ["8080:8001"], "healthcheck": {"test": ["CMD", "python", "-c", "urlopen('http://127.0.0.1:9000/readyz')"]}}
    settings = RouterSettings(port=8000)  # host 127.0.0.1 by default
    problems = check_router_port(svc, settings, ["8001"])
    assert len(problems) == 4, problems


# ---------------------------------------------------------------------------------------- with an engine
def _docker_compose_available() -> str | None:
    """None when `docker compose` can run here; else why not."""
    if shutil.which("docker") is None:
        return "no docker client on PATH"
    try:
        if subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode != 0:
            return "no Docker daemon reachable (`docker info` fails)"
        if subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=20).returncode != 0:
            return "the docker compose plugin is not installed"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"docker does not answer: {exc}"
    return None


def _compose_cli() -> list[str] | None:
    """`docker compose` (the plugin) or `docker-compose` (the standalone one, which .ci/run
    installs: `config` needs no engine), whichever answers."""
    for argv in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(argv[0]) is None:
            continue
        try:
            if subprocess.run([*argv, "version"], capture_output=True, timeout=20).returncode == 0:
                return argv
        except (OSError, subprocess.TimeoutExpired):
            continue
    return None


@pytest.mark.parametrize("profiles", [[], ["--profile", "ha"]], ids=["default", "ha"])
def test_docker_compose_config_validates(profiles):
    cli = _compose_cli()
    if cli is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed (.ci/run installs docker-compose)")
    proc = subprocess.run([*cli, "-f", str(COMPOSE_FILE), *profiles, "config", "-q"], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "FLEXLB_ADMIN_TOKEN": "ci-check"})
    assert proc.returncode == 0, proc.stderr


def test_the_ha_profile_comes_up_where_docker_runs():
    reason = _docker_compose_available()
    if reason:
        pytest.skip(reason)
    import httpx

    env = {**os.environ, "FLEXLB_ADMIN_TOKEN": "ci-check"}
    base = ["docker", "compose", "-f", str(COMPOSE_FILE), "--profile", "ha"]
    up = subprocess.run([*base, "up", "-d", "--build", "--wait"], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=900)
    try:
        assert up.returncode == 0, up.stderr[-4000:]
        r = httpx.post("http://127.0.0.1:8010/v1/completions", json={"prompt": "ha", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
        assert httpx.get("http://127.0.0.1:9090/-/ready", timeout=10).status_code == 200
    finally:
        subprocess.run([*base, "down", "-v"], cwd=REPO, env=env, capture_output=True, timeout=300)


# ---------------------------------------------------------------------------------------- profile ha
def _ha_settings(compose):
    out = {}
    for name, svc in flexlb_services(compose, ha=True).items():
        settings, problems = check_flexlb_service(name, svc["command"], env_of(svc))
        assert not problems, "\n".join(problems)
        out[name] = settings
    return out


def test_the_ha_profile_is_three_nats_nodes_redis_with_sentinel_two_routers_and_workers():
    compose = load_compose()
    services = services_of(compose)
    nodes = sorted(n for n, s in services.items() if in_ha(s) and str(s.get("image", "")).startswith("nats:"))
    assert len(nodes) == 3, nodes
    for n in nodes:
        cmd = services[n]["command"]
        assert "-js" in cmd and cmd[cmd.index("--cluster_name") + 1] == "flexlb" and cmd[cmd.index("-n") + 1] == n
        routes = {r.split("//")[1].split(":")[0] for r in cmd[cmd.index("--routes") + 1].split(",")}
        assert routes == set(nodes) - {n}, (n, routes)  # routed to the other two
        store = cmd[cmd.index("-sd") + 1]
        assert any(str(v).endswith(f":{store}") for v in services[n]["volumes"]), services[n]["volumes"]
    replica = services["ha-redis-replica"]["command"]
    assert replica[replica.index("--replicaof") + 1:replica.index("--replicaof") + 3] == ["ha-redis-primary", "6379"]
    sentinels = sorted(n for n, s in services.items() if in_ha(s) and "--sentinel" in " ".join(s.get("command") or []))
    assert len(sentinels) == 3, sentinels
    for n in sentinels:
        assert "sentinel monitor flexlb ha-redis-primary 6379 2" in " ".join(services[n]["command"])
    settings = _ha_settings(compose)
    routers = {n: s for n, s in settings.items() if isinstance(s, RouterSettings)}
    workers = {n: s for n, s in settings.items() if isinstance(s, WorkerConfig)}
    assert len(routers) == 2 and len(workers) >= 2, (sorted(routers), sorted(workers))
    assert len({s.router_id for s in routers.values()}) == 2 and len({s.cluster for s in routers.values()}) == 1
    cluster_url = ",".join(f"nats://{n}:{NATS_PORT}" for n in nodes)
    for name, s in settings.items():
        assert s.nats_url == cluster_url and s.nats_replicas == 3, (name, s.nats_url, s.nats_replicas)
        deps = set(services[name].get("depends_on") or {})
        assert set(nodes) <= deps, f"{name} does not wait for every NATS node"
    for name, s in routers.items():
        assert s.redis_sentinels == ",".join(f"{n}:26379" for n in sentinels) and s.redis_master_name == "flexlb", name
    ids = [s.worker_id for s in workers.values()]
    assert len(ids) == len(set(ids))
    default_ids = {s.worker_id for n, s in ((n, check_flexlb_service(n, v["command"], env_of(v))[0])
                                            for n, v in flexlb_services(compose).items()) if isinstance(s, WorkerConfig)}
    assert not set(ids) & default_ids, "an ha worker shares an id with a default-stack worker"


def test_prometheus_scrapes_every_router_and_worker_that_serves_metrics():
    compose = load_compose()
    config = yaml.safe_load((REPO / "services/monitoring/prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    expected = set()
    for ha in (False, True):
        for name, svc in flexlb_services(compose, ha=ha).items():
            settings, problems = check_flexlb_service(name, svc["command"], env_of(svc))
            assert not problems
            if isinstance(settings, RouterSettings):
                expected.add(f"{name}:{settings.port}")
            elif settings.metrics_port:
                assert settings.metrics_host == "0.0.0.0", f"{name} serves /metrics on loopback only"
                expected.add(f"{name}:{settings.metrics_port}")
    assert targets == expected, (sorted(targets - expected), sorted(expected - targets))
    prom = services_of(compose)["prometheus"]
    assert in_ha(prom) and any("services/monitoring/prometheus.yml" in str(v) for v in prom["volumes"])


def test_grafana_provisions_the_dashboard_from_its_datasource():
    compose = load_compose()
    grafana = services_of(compose)["grafana"]
    mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in grafana["volumes"]}
    provider = yaml.safe_load((REPO / "services/monitoring/grafana/provisioning/dashboards/flexlb.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    assert (REPO / mounts[path]).resolve() == (REPO / "services/monitoring/grafana/dashboards").resolve()
    source = yaml.safe_load((REPO / "services/monitoring/grafana/provisioning/datasources/prometheus.yml").read_text())
    [ds] = source["datasources"]
    assert ds["url"] == "http://prometheus:9090"
    dashboard = json.loads((REPO / "services/monitoring/grafana/dashboards/flexlb.json").read_text())
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == ds["uid"], panel["title"]
        assert panel["targets"], panel["title"]
