"""Typed settings: env < flags, loud validation naming the setting, unknown vars warned."""

from __future__ import annotations

import logging

import pytest

from services.cli import build_parser, router_settings, worker_config
from services.settings import RouterSettings, SettingsError, load


def test_environment_then_flags_override_defaults():
    s = load(RouterSettings, {"FLEXLB_PORT": "9001", "FLEXLB_BATCH_WAIT_MS": "2.5"}, {"port": 9002})
    assert s.port == 9002 and s.batch_wait_ms == 2.5 and s.router_id == "router-0"


@pytest.mark.parametrize(
    "env,fragment",
    [
        ({"FLEXLB_PORT": "eighty"}, "FLEXLB_PORT"),
        ({"FLEXLB_BATCH_SIZE_MAX": "0"}, "batch_size_max"),
        ({"FLEXLB_ROUTER_ID": "a.b"}, "router_id"),
        ({"FLEXLB_LOG_LEVEL": "chatty"}, "log_level"),
        ({"FLEXLB_OWN_PORT": "9001"}, "own_port"),  # without reuse_port
        ({"FLEXLB_REUSE_PORT": "true", "FLEXLB_PORT": "9001", "FLEXLB_OWN_PORT": "9001"}, "own_port"),
        ({"FLEXLB_NATS_URL": "nats://a:4222,http://b:4222"}, "nats_url.*http://b:4222"),
        ({"FLEXLB_NATS_URL": "nats://a:4222,,nats://b:4222"}, "nats_url"),
        ({"FLEXLB_NATS_REPLICAS": "0"}, "nats_replicas"),
        ({"FLEXLB_HTTP_KEEP_ALIVE_S": "0"}, "http_keep_alive_s"),
        ({"FLEXLB_NATS_REPLICAS": "6"}, "nats_replicas"),
        ({"FLEXLB_REDIS_SENTINELS": "127.0.0.1:26379,127.0.0.1"}, "redis_sentinels.*127.0.0.1'"),
        ({"FLEXLB_REDIS_SENTINELS": "h:99999"}, "redis_sentinels"),
        ({"FLEXLB_REDIS_SENTINELS": "h:26379", "FLEXLB_REDIS_MASTER_NAME": "a b"}, "redis_master_name"),
    ],
)
def test_bad_values_fail_naming_the_setting(env, fragment):
    with pytest.raises(SettingsError, match=fragment):
        load(RouterSettings, env)


def test_unknown_flexlb_variable_is_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="flexlb.settings"):
        load(RouterSettings, {"FLEXLB_PROT": "1"})
    assert "FLEXLB_PROT" in caplog.text


def test_worker_variables_are_not_unknown_to_the_router(caplog):
    args = build_parser().parse_args(["router"])
    with caplog.at_level(logging.WARNING, logger="flexlb.settings"):
        router_settings(args, {"FLEXLB_TIME_SCALE": "0.5", "FLEXLB_NATS_URL": "nats://x:1"})
    assert caplog.text == ""


def test_worker_config_from_flags_and_env():
    args = build_parser().parse_args(["worker", "--id", "w7", "--role", "ROLE_TYPE_DECODE"])
    cfg = worker_config(args, {"FLEXLB_TIME_SCALE": "0.25"})
    assert (cfg.worker_id, cfg.role, cfg.time_scale) == ("w7", "decode", 0.25)
    with pytest.raises(ValueError, match="time_scale"):
        worker_config(build_parser().parse_args(["worker", "--id", "w7", "--time-scale", "-1"]), {})
    with pytest.raises(ValueError, match="worker_id"):
        worker_config(build_parser().parse_args(["worker", "--id", "w.7"]), {})


def test_a_cluster_url_is_every_server_and_the_replicas_reach_both_router_and_worker():
    env = {"FLEXLB_NATS_URL": "nats://127.0.0.1:4222, nats://127.0.0.1:4223,tls://n3:4224", "FLEXLB_NATS_REPLICAS": "3"}
    s = load(RouterSettings, env)
    assert s.nats_replicas == 3
    from schemas.subjects import nats_servers

    assert nats_servers(s.nats_url) == ["nats://127.0.0.1:4222", "nats://127.0.0.1:4223", "tls://n3:4224"]
    args = build_parser().parse_args(["worker", "--id", "w0"])
    cfg = worker_config(args, env)
    assert cfg.nats_replicas == 3 and cfg.nats_url == env["FLEXLB_NATS_URL"]
    with pytest.raises(ValueError, match="nats_replicas"):
        worker_config(args, {**env, "FLEXLB_NATS_REPLICAS": "9"})


def test_sentinel_addresses_parse():
    from services.settings import sentinel_addresses

    assert sentinel_addresses("") == []
    assert sentinel_addresses("127.0.0.1:26379, sentinel-1:26380") == [("127.0.0.1", 26379), ("sentinel-1", 26380)]
    s = load(RouterSettings, {"FLEXLB_REDIS_SENTINELS": "a:1,b:2", "FLEXLB_REDIS_MASTER_NAME": "mymaster"})
    assert (s.redis_sentinels, s.redis_master_name) == ("a:1,b:2", "mymaster")
