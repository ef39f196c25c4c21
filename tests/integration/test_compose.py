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

import asyncio
import contextlib
import fnmatch
import io
import json
import os
import random
import re
import shlex
import shutil
import string
import subprocess
import time
import tomllib
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from schemas.subjects import redact_url
from services.cli import build_parser, router_settings, worker_config
from services.settings import ENV_PREFIX, RouterSettings, known_env_vars
from tests.integration.stack import (
    _stream_into,
    expected_text,
    fault_outcome,
    make_bodies,
    run_concurrent_streams,
    seconds_until_leader,
    wait_async,
    wait_for,
)
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
            out[key] = interpolate(value) if sep else None
        return out
    for key, value in raw.items():
        if isinstance(value, bool):
            value = "true" if value else "false"
        out[str(key)] = None if value is None else interpolate(str(value))
    return out


def interpolate(value: str) -> str:
    """`${VAR...}` as compose substitutes it from the environment the tests give (SECRETS)."""
    return re.sub(r"\$\{([A-Za-z0-9_]+)[^}]*\}", lambda mt: SECRETS.get(mt[1], "ci-check"), value)


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


def server_argv(command: list[str]) -> tuple[list[str], str]:
    """(the server's argv, the script before it) of a NATS or Redis service: `sh -c "printf
    CONFIG > FILE && exec SERVER ARGS"` (the config holds the password, read from the
    container's environment), or a plain exec form (no script)."""
    if command[:2] != ["sh", "-c"]:
        return list(command), ""
    script, _, server = command[2].rpartition("exec ")
    return shlex.split(server), script


def test_nats_and_redis_use_official_images_configured_like_flexlb_up():
    services = services_of(load_compose())
    nats, redis = services["nats"], services["redis"]
    assert str(nats.get("image", "")).split(":")[0] == "nats", nats.get("image")
    assert str(redis.get("image", "")).split(":")[0] == "redis", redis.get("image")
    assert "build" not in nats and "build" not in redis
    cmd, script = server_argv(nats["command"])
    assert "-js" in cmd, f"NATS without JetStream: {cmd}"
    store = cmd[cmd.index("-sd") + 1]
    mounts = [str(v).split(":")[1] if isinstance(v, str) else v.get("target") for v in nats.get("volumes") or []]
    assert store in mounts, f"JetStream store {store} is not a volume: {mounts}"
    assert "-m" in cmd and cmd[cmd.index("-m") + 1] == "8222", f"the /healthz probe needs monitoring on 8222: {cmd}"
    assert cmd[cmd.index("-c") + 1] in script and "authorization" in script and "$$NATS_PASSWORD" in script
    rcmd, rscript = server_argv(redis["command"])
    assert rcmd[rcmd.index("--save") + 1] == "", f"redis persistence should be off: {rcmd}"
    assert rcmd[rcmd.index("--appendonly") + 1] == "no", f"redis AOF should be off: {rcmd}"
    assert rcmd[1] in rscript and "requirepass" in rscript and "$$REDIS_PASSWORD" in rscript
    assert redis["healthcheck"]["test"][0] == "CMD-SHELL" and "redis-cli ping" in redis["healthcheck"]["test"][1]
    # The passwords come from the environment compose is run in, required, never written here.
    for svc, var in ((nats, "NATS_PASSWORD"), (redis, "REDIS_PASSWORD")):
        assert env_of(svc)[var] == SECRETS[f"FLEXLB_{var}"] and f"FLEXLB_{var}:?" in str(svc["environment"][var])


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
        assert settings.nats_url == f"nats://flexlb:{SECRETS['FLEXLB_NATS_PASSWORD']}@nats:{NATS_PORT}", \
            f"{name}: nats_url {redact_url(settings.nats_url)}"
        deps = svc.get("depends_on") or {}
        assert "nats" in deps, f"{name} does not wait for nats"
        if isinstance(settings, RouterSettings):
            assert settings.redis_url.startswith(f"redis://:{SECRETS['FLEXLB_REDIS_PASSWORD']}@redis:{REDIS_PORT}/"), \
                f"{name}: redis_url {redact_url(settings.redis_url)}"
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
                          text=True, timeout=60, env={**os.environ, **SECRETS})
    assert proc.returncode == 0, proc.stderr


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
        cmd, script = server_argv(services[n]["command"])
        assert "-js" in cmd and "cluster { name: flexlb," in script and cmd[cmd.index("-n") + 1] == n
        routes = set(re.findall(r"nats-route://flexlb:%s@([a-z0-9-]+):6222", script))
        assert routes == set(nodes) - {n}, (n, routes)  # routed to the other two, with the password
        assert script.count("authorization { user: flexlb") == 2, script  # clients and routes
        store = cmd[cmd.index("-sd") + 1]
        assert any(str(v).endswith(f":{store}") for v in services[n]["volumes"]), services[n]["volumes"]
    replica, _ = server_argv(services["ha-redis-replica"]["command"])
    assert replica[replica.index("--replicaof") + 1:replica.index("--replicaof") + 3] == ["ha-redis-primary", "6379"]
    sentinels = sorted(n for n, s in services.items() if in_ha(s) and "--sentinel" in " ".join(s.get("command") or []))
    assert len(sentinels) == 3, sentinels
    for n in sentinels:
        script = " ".join(services[n]["command"])
        assert "sentinel monitor flexlb ha-redis-primary 6379 2" in script and "sentinel auth-pass flexlb" in script
    settings = _ha_settings(compose)
    routers = {n: s for n, s in settings.items() if isinstance(s, RouterSettings)}
    workers = {n: s for n, s in settings.items() if isinstance(s, WorkerConfig)}
    assert len(routers) == 2 and len(workers) >= 2, (sorted(routers), sorted(workers))
    assert len({s.router_id for s in routers.values()}) == 2 and len({s.cluster for s in routers.values()}) == 1
    cluster_url = ",".join(f"nats://flexlb:{SECRETS['FLEXLB_NATS_PASSWORD']}@{n}:{NATS_PORT}" for n in nodes)
    for name, s in settings.items():
        assert s.nats_url == cluster_url and s.nats_replicas == 3, (name, redact_url(s.nats_url), s.nats_replicas)
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


# ---------------------------------------------------------------------------------------- brought up for real
# The stack in containers, both profiles, on an engine (tests/integration/dockerstack.py: the
# machine's daemon, else a dockerd of our own; the official base images, else stand-ins built
# from Debian packages). The compose file and Dockerfile are used as users run them. The
# default stack comes up first and is exercised, then the `ha` profile beside it, then
# `down -v`. The tests below run in file order and share the stack (a module fixture).
# FLEXLB_REQUIRE_DOCKER=1 (.ci/run sets it) turns "no engine here" from a skip into a failure.
LIVE_TIMEOUT_S = 1800  # the first test pays for images, the build and the bring-up
PROJECT = "flexlbtest"
ADMIN_TOKEN = "ci-check"
# The secrets the compose file requires from the environment (${VAR:?...}), as the tests give them.
SECRETS = {"FLEXLB_ADMIN_TOKEN": ADMIN_TOKEN, "FLEXLB_NATS_PASSWORD": "ci-nats-3f9a", "FLEXLB_REDIS_PASSWORD": "ci-redis-7c1e"}
ROUTER_URL = "http://127.0.0.1:8000"
HA_URLS = {"ha-router-0": "http://127.0.0.1:8010", "ha-router-1": "http://127.0.0.1:8011"}
PROMETHEUS_URL = "http://127.0.0.1:9090"
PUBLISHED = (8000, 8010, 8011, 9090)


class Stack:
    """The compose project under test: runs compose commands, keeps the timings."""

    def __init__(self, engine, cli: list[str], unavailable: dict[str, str]):
        self.engine, self.cli, self.unavailable = engine, cli, unavailable
        engine.env.update(SECRETS)  # the compose file requires them (the admin token: the routers listen on 0.0.0.0)
        self.timings: dict[str, float] = {}
        self.is_down = False
        self.tests_from: float | None = None
        services = services_of(load_compose())
        images = {name: str(svc.get("image", "")) for name, svc in services.items()}
        self.left_out = sorted(n for n, img in images.items() if img in unavailable)
        self.default = [n for n, s in services.items() if not s.get("profiles")]
        self.ha = [n for n, s in services.items() if in_ha(s) and n not in self.left_out]

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> str:
        argv = [*self.cli, "-p", PROJECT, "-f", str(COMPOSE_FILE), "--profile", "ha", *args]
        proc = self.engine.run(*argv, timeout=timeout, check=False)
        out = (proc.stdout + proc.stderr).decode(errors="replace")
        if check and proc.returncode != 0:
            raise AssertionError(f"`compose {' '.join(args)}` exited {proc.returncode}:\n{out[-4000:]}")
        return out

    def timed(self, what: str, *args: str, timeout: float = 600) -> str:
        t0 = time.monotonic()
        out = self.compose(*args, timeout=timeout)
        self.timings[what] = self.timings.get(what, 0.0) + time.monotonic() - t0
        return out

    def container(self, service: str) -> str:
        [cid] = self.compose("ps", "-q", service).split()
        return cid

    def inspect(self, service: str, template: str) -> str:
        return self.engine.docker("inspect", "-f", template, self.container(service)).strip()

    def logs(self, *services: str) -> str:
        return self.compose("logs", "--no-color", "--tail", "60", *services, check=False)[-6000:]

    def down(self) -> str:
        self.is_down = True
        if self.tests_from is not None:  # the tests' own time: from the default stack ready to `down`, less the ha up
            self.timings["tests"] = time.monotonic() - self.tests_from - self.timings.get("up (ha)", 0.0)
        return self.timed("down -v", "down", "-v", "--remove-orphans", "--timeout", "40")


def _port_taken(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _get(url: str, **kw) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=5, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, **kw)
    except httpx.HTTPError:
        return None


def _ready(url: str) -> bool:
    r = _get(url + "/readyz")
    return r is not None and r.status_code == 200


def _workers(url: str) -> dict[str, dict]:
    r = _get(url + "/admin/workers")
    return {w["id"]: w for w in r.json()["workers"]} if r is not None and r.status_code == 200 else {}


def _worker(url: str, worker_id: str) -> dict:
    return _workers(url).get(worker_id, {})


def _wait_workers_ready(url: str, ids: set[str], timeout_s: float = 120) -> None:
    wait_for(lambda: all(w.get("liveness") == "ready" and w.get("state") == "ready" and not w.get("draining")
                         for w in [_workers(url).get(i, {}) for i in ids]), timeout_s, f"workers {sorted(ids)} ready at {url}")


@pytest.fixture(scope="module")
def stack():
    from tests.integration import dockerstack

    t0 = time.monotonic()
    try:
        engine = dockerstack.start_engine()
    except dockerstack.DockerUnavailable as exc:
        if os.environ.get("FLEXLB_REQUIRE_DOCKER") == "1":
            pytest.fail(f"FLEXLB_REQUIRE_DOCKER=1 but {exc}")
        pytest.skip(str(exc))
    env_cli = _compose_cli()
    assert env_cli is not None, "neither `docker compose` nor `docker-compose` is installed (.ci/run installs docker-compose)"
    started_engine = time.monotonic() - t0
    stack = None
    try:
        taken = [p for p in PUBLISHED if _port_taken(p)]
        assert not taken, f"the compose file publishes {taken} on this machine, and something already listens there"
        t1 = time.monotonic()
        provided = dockerstack.provide_images(engine)
        stack = Stack(engine, env_cli, provided.unavailable)
        stack.timings["engine start"] = started_engine
        stack.timings["base images"] = time.monotonic() - t1
        print(f"\nengine: {'ours (dockerd --storage-driver=vfs)' if engine.owned else 'the machine’s'}; images "
              f"built {sorted(provided.built)}, present {provided.present}, unavailable {provided.unavailable}")
        assert "python:3.11-slim" not in provided.unavailable
        stack.timed("image build", "build", timeout=1200)
        stack.timed("up (default)", "up", "-d", *stack.default)
        t2 = time.monotonic()
        wait_for(lambda: _ready(ROUTER_URL), 120, "the router's /readyz through the published port")
        _wait_workers_ready(ROUTER_URL, {"w0", "w1"})
        stack.timings["up (default)"] += time.monotonic() - t2
        stack.tests_from = time.monotonic()
        yield stack
    except BaseException:
        if stack is not None:
            print(stack.logs())
        raise
    finally:
        if stack is not None and not stack.is_down:
            stack.down()
        if stack is not None:
            print("compose timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in stack.timings.items()))
        engine.stop()


@pytest.fixture(scope="module")
def ha_stack(stack):
    t0 = time.monotonic()
    stack.compose("up", "-d", *stack.ha)
    wait_for(lambda: all(_ready(u) for u in HA_URLS.values()), 180, "both ha routers ready")
    _wait_workers_ready(HA_URLS["ha-router-0"], {"ha-w0", "ha-w1"})
    wait_for(lambda: sorted(_role(u) for u in HA_URLS.values()) == ["leader", "standby"], 60, "one ha leader, one standby")
    stack.timings["up (ha)"] = time.monotonic() - t0
    return stack


def _role(url: str) -> str:
    r = _get(url + "/healthz")
    return r.json().get("role", "?") if r is not None and r.status_code == 200 else "?"


async def _one(client: httpx.AsyncClient, urls: list[str], body: dict) -> dict:
    """One streamed completion, as a client behind a load balancer sends it: a connection refused
    (the router is gone) goes to the next URL; what came back is the result."""
    sent = time.monotonic()
    for url in urls:
        out = {"request_id": None, "texts": [], "finish_reason": None, "done": False, "errors": [], "status": None,
               "sent": sent, "ended": None, "url": url}
        try:
            await _stream_into(out, client, url, body)
        except httpx.TransportError as exc:
            out["errors"].append(f"{exc!r}")
            if out["status"] is None:  # refused, or closed before any answer: the next router
                continue
        out["ended"] = time.monotonic()
        return out
    return {**out, "ended": time.monotonic(), "url": None}


async def _record(url: str, rid: str) -> dict:
    async with httpx.AsyncClient(timeout=10) as c:
        return (await c.get(url + f"/admin/requests/{rid}", headers={"authorization": f"Bearer {ADMIN_TOKEN}"})).json()


def _worker_of(record: dict) -> str:
    return (record.get("admission") or {}).get("prefill_worker_id", "")


def _exact(body: dict, res: dict) -> bool:
    return (res["status"] == 200 and res["done"] and not res["errors"]
            and "".join(res["texts"]) == expected_text(res["request_id"], body["max_tokens"]))


@pytest.mark.timeout(LIVE_TIMEOUT_S)
async def test_the_default_stack_streams_completions_through_the_published_port(stack):
    bodies = make_bodies(24, seed=28)
    t0 = time.monotonic()
    results = await run_concurrent_streams(ROUTER_URL, bodies)
    took = time.monotonic() - t0
    bad = [(b, r) for b, r in zip(bodies, results) if not _exact(b, r)]
    assert not bad, bad[:3]
    served = Counter([_worker_of(await _record(ROUTER_URL, r["request_id"])) for r in results])
    print(f"24 streamed completions in {took:.2f} s, by worker {dict(served)}")
    assert set(served) == {"w0", "w1"}, served
    # The admin API wants the token beyond loopback (the router listens on 0.0.0.0 in its container).
    assert httpx.get(ROUTER_URL + "/admin/workers", timeout=10).status_code == 401


@pytest.mark.timeout(LIVE_TIMEOUT_S)
async def test_drain_and_undrain_through_the_admin_api(stack):
    auth = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.post(ROUTER_URL + "/admin/workers/w0/drain", headers=auth, json={})
        assert r.status_code == 200, r.text
        assert _workers(ROUTER_URL)["w0"]["draining"] is True
        bodies = make_bodies(12, seed=29)
        results = await run_concurrent_streams(ROUTER_URL, bodies)
        assert all(_exact(b, res) for b, res in zip(bodies, results)), results
        drained_to = {_worker_of(await _record(ROUTER_URL, res["request_id"])) for res in results}
        assert drained_to == {"w1"}, drained_to
        r = await c.post(ROUTER_URL + "/admin/workers/w0/undrain", headers=auth, json={})
        assert r.status_code == 200, r.text
        _wait_workers_ready(ROUTER_URL, {"w0"}, 30)
        seen = set()
        for k in range(5):  # concurrent rounds until the undrained worker takes one
            bodies = make_bodies(8, seed=30 + k)
            results = await run_concurrent_streams(ROUTER_URL, bodies)
            assert all(_exact(b, res) for b, res in zip(bodies, results)), results
            seen |= {_worker_of(await _record(ROUTER_URL, res["request_id"])) for res in results}
            if "w0" in seen:
                break
        assert "w0" in seen, seen


@pytest.mark.timeout(LIVE_TIMEOUT_S)
async def test_docker_stop_of_a_worker_under_load_drains_it(stack):
    """`docker stop` (SIGTERM, then SIGKILL after stop_grace_period) of a worker holding
    requests: it takes nothing new, finishes what it holds, exits 0 by itself; the router says
    drained, then stopped."""
    bodies = [{**b, "max_tokens": 160} for b in make_bodies(10, seed=31)]
    async with httpx.AsyncClient(timeout=120) as client:
        held = [asyncio.create_task(_one(client, [ROUTER_URL], b)) for b in bodies]
        await wait_async(lambda: asyncio.to_thread(lambda: _worker(ROUTER_URL, "w0").get("num_running_requests", 0) > 0), 30,
                         "w0 to hold requests")
        t0 = time.monotonic()
        stopping = asyncio.create_task(asyncio.to_thread(stack.compose, "stop", "worker-0", timeout=120))
        await wait_async(lambda: asyncio.to_thread(lambda: _worker(ROUTER_URL, "w0").get("state") in ("draining", "drained")),
                         10, "w0 reported draining")
        later_bodies = make_bodies(6, seed=32)
        later = [await _one(client, [ROUTER_URL], b) for b in later_bodies]
        results = await asyncio.gather(*held)
        finished_s = time.monotonic() - t0
        await stopping
        stop_s = time.monotonic() - t0
    later_workers = [_worker_of(await _record(ROUTER_URL, r["request_id"])) for r in later]
    assert all(_exact(b, r) for b, r in zip(later_bodies, later)) and "w0" not in later_workers, later_workers
    mine = [(b, r) for b, r in zip(bodies, results) if _worker_of(await _record(ROUTER_URL, r["request_id"])) == "w0"]
    assert mine, "w0 held none of the requests"
    assert all(_exact(b, r) for b, r in mine), [r for _, r in mine if not _exact(_, r)][:2]
    exit_code = stack.inspect("worker-0", "{{.State.ExitCode}}")
    assert exit_code == "0", (exit_code, stack.logs("worker-0"))  # it exited by itself: not SIGKILLed (137)
    wait_for(lambda: _worker(ROUTER_URL, "w0").get("state") in ("drained", "stopped"), 30, "the router says w0 drained")
    print(f"docker stop worker-0 with {len(mine)} requests on it: all finished {finished_s:.1f} s after the stop began, "
          f"the container exited 0 after {stop_s:.1f} s (grace 35 s); router: {_workers(ROUTER_URL)['w0']['state']}")
    stack.compose("start", "worker-0")
    _wait_workers_ready(ROUTER_URL, {"w0"}, 120)


@pytest.mark.timeout(LIVE_TIMEOUT_S)
async def test_a_killed_worker_containers_requests_are_rerouted(stack):
    """`docker kill` (SIGKILL) of a worker under load: batches it had not started go to the
    other worker, those it had started fail retryable (the client retries), none hangs."""
    rng = random.Random(33)
    bodies = [{"prompt": "".join(rng.choice(string.ascii_letters) for _ in range(rng.randint(3000, 6000))),
               "max_tokens": rng.randint(20, 60)} for _ in range(60)]
    async with httpx.AsyncClient(timeout=180) as client:
        tasks = [asyncio.create_task(_one(client, [ROUTER_URL], b)) for b in bodies]
        await wait_async(lambda: asyncio.to_thread(lambda: _worker(ROUTER_URL, "w1").get("num_held", 0) > 2), 30,
                         "w1 to hold several requests")
        await asyncio.to_thread(stack.compose, "kill", "worker-1")
        killed_at = time.monotonic()
        await wait_async(lambda: asyncio.to_thread(lambda: _worker(ROUTER_URL, "w1").get("liveness") == "dead"), 20,
                         "the router's verdict: w1 dead")  # (a dead worker leaves the view a while later)
        detected_s = time.monotonic() - killed_at
        results = await asyncio.wait_for(asyncio.gather(*tasks), 170)
        retried = [await _one(client, [ROUTER_URL], b) for b, r in zip(bodies, results) if not _exact(b, r)]
    failed = [r for b, r in zip(bodies, results) if not _exact(b, r)]
    for r in failed:  # a stream that ended with a retryable code: nothing hung, nothing without a code
        assert r["done"] and [e.get("code") for e in r["errors"]] == ["worker_failed"] and r["errors"][0]["retryable"], r
    assert all(r["status"] == 200 and r["done"] and not r["errors"] for r in retried), retried
    records = [await _record(ROUTER_URL, r["request_id"]) for r in results]
    rerouted = [rec for rec in records if any(t["event"] == "rerouted" for t in rec["timeline"])]
    print(f"docker kill worker-1 under load: dead {detected_s:.1f} s after; {len(rerouted)} re-routed and finished, "
          f"{len(failed)} failed retryable "
          f"and served on retry, {len(bodies) - len(failed)} ok")
    assert rerouted, "no request was re-routed"
    assert all(_exact(b, r) for b, r, rec in zip(bodies, results, records) if rec in rerouted)
    stack.compose("start", "worker-1")  # (`docker kill` counts as stopped by hand: no restart policy brings it back)
    _wait_workers_ready(ROUTER_URL, {"w1"}, 120)


@pytest.mark.timeout(LIVE_TIMEOUT_S)
async def test_prometheus_scrapes_every_target_of_both_profiles(ha_stack):
    config = yaml.safe_load((REPO / "services/monitoring/prometheus.yml").read_text())
    expected = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}

    def all_up():
        r = _get(PROMETHEUS_URL + "/api/v1/targets")
        if r is None or r.status_code != 200:
            return None
        active = r.json()["data"]["activeTargets"]
        health = {t["labels"]["instance"]: t["health"] for t in active}
        return health if set(health) == expected and set(health.values()) == {"up"} else None

    health = await asyncio.to_thread(wait_for, all_up, 60, "every Prometheus target up")
    print(f"prometheus: {health}")
    # and what it scraped is ours: the router's request counter, from the default stack's router
    r = httpx.get(PROMETHEUS_URL + "/api/v1/query", params={"query": "flexlb_requests_total"}, timeout=10)
    assert {s["metric"]["instance"] for s in r.json()["data"]["result"]} >= {"router:8000"}, r.text[:500]


@pytest.mark.timeout(LIVE_TIMEOUT_S)
async def test_one_nats_container_killed_under_load(ha_stack):
    """The NATS node the leader router is connected to, killed (SIGKILL) under load through both
    routers: >= 95 % of the requests in flight finish ok, every one ends with a code."""
    urls = list(HA_URLS.values())
    leader = next(u for u in urls if _role(u) == "leader")
    node = _get(leader + "/admin/router").json()["nats_server"].split("//")[1].split(":")[0]
    assert node in {"ha-nats-0", "ha-nats-1", "ha-nats-2"}, node
    bodies = [{**b, "max_tokens": 60} for b in make_bodies(80, seed=34)]
    async with httpx.AsyncClient(timeout=120) as client:
        tasks = []
        for i, body in enumerate(bodies):
            tasks.append(asyncio.create_task(_one(client, [urls[i % 2]], body)))
            await asyncio.sleep(0.05)
            if i == 40:
                fault_at = time.monotonic()
                await asyncio.to_thread(ha_stack.compose, "kill", node)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 170)
    summary = fault_outcome(bodies, results, fault_at)
    print(f"kill {node} (the leader's node) under load: {summary}")
    assert summary["in_flight"] >= 20, summary
    in_flight = [(b, r) for b, r in zip(bodies, results) if r["sent"] <= fault_at < r["ended"]]
    assert sum(_exact(b, r) for b, r in in_flight) >= 0.95 * len(in_flight), summary
    ha_stack.compose("start", node)
    wait_for(lambda: ha_stack.inspect(node, "{{.State.Health.Status}}") == "healthy", 60, f"{node} healthy again")


@pytest.mark.timeout(LIVE_TIMEOUT_S)
async def test_docker_stop_of_the_leader_router_under_load(ha_stack):
    """`docker stop` of the leader router while clients stream through both routers: the
    standby leads within 1 s and dispatches; every request in flight finishes (the stopping
    router's own streams too); new connections to it are refused and go to the other."""
    urls = dict(HA_URLS)
    leader = next(n for n, u in urls.items() if _role(u) == "leader")
    standby = next(n for n in urls if n != leader)
    order = {leader: [urls[leader], urls[standby]], standby: [urls[standby], urls[leader]]}
    bodies = [{**b, "max_tokens": 40} for b in make_bodies(60, seed=35)]
    async with httpx.AsyncClient(timeout=120) as client:
        tasks = []
        for i, body in enumerate(bodies):
            tasks.append(asyncio.create_task(_one(client, order[leader if i % 2 else standby], body)))
            await asyncio.sleep(0.05)
            if i == 30:  # `docker stop` itself (compose's CLI takes a while to start): SIGTERM, then wait
                cid = ha_stack.container(leader)
                stop_at = time.monotonic()
                stopping = asyncio.create_task(asyncio.to_thread(ha_stack.engine.docker, "stop", cid, timeout=120))
                takeover_s = await seconds_until_leader(urls[standby], 10)
                r = await _one(client, [urls[standby]], {"prompt": "after the stop", "max_tokens": 4})
                dispatched_s = r.get("first_at", float("inf")) - stop_at
        results = await asyncio.wait_for(asyncio.gather(*tasks), 170)
        await stopping
        stopped_s = time.monotonic() - stop_at
    summary = fault_outcome(bodies, results, stop_at)
    print(f"docker stop {leader} (leader) under load: {standby} led {takeover_s:.2f} s after, the first token of a "
          f"request sent through it then came {dispatched_s:.2f} s after the stop; the container stopped in "
          f"{stopped_s:.1f} s; {summary}")
    assert r["status"] == 200 and r["done"] and not r["errors"], r
    assert takeover_s < 1.0
    assert summary["ok"] == len(bodies), [(res.get("url"), res["errors"]) for b, res in zip(bodies, results)
                                          if not _exact(b, res)][:5]
    assert ha_stack.inspect(leader, "{{.State.ExitCode}}") == "0"
    ha_stack.compose("start", leader)
    wait_for(lambda: _ready(urls[leader]), 120, f"{leader} ready again")


@pytest.mark.timeout(LIVE_TIMEOUT_S)
def test_compose_down_leaves_no_container_network_or_volume(ha_stack):
    ha_stack.down()
    label = f"label=com.docker.compose.project={PROJECT}"
    left = {kind: ha_stack.engine.docker(*cmd, "--filter", label, "-q").split()
            for kind, cmd in {"containers": ("ps", "-a"), "networks": ("network", "ls"),
                              "volumes": ("volume", "ls")}.items()}
    assert left == {"containers": [], "networks": [], "volumes": []}, left
    print(f"left out of the ha profile here: {ha_stack.left_out} ({ha_stack.unavailable})")
