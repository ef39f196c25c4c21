"""Model pools (issue 27, 1): what a worker says it serves, the scheduler's model filter,
and the /v1/models listing the router builds from its view."""

from __future__ import annotations

import pytest

from schemas.messages import WorkerStatusReported
from services.api import models_body
from services.core.scheduler import AdmitRequest, Admitted, Rejected, Scheduler, SchedulerConfig
from services.core.view import WorkerView
from services.up import parse_pools
from workers.config import SIM_MODEL_NAME, WorkerConfig


@pytest.mark.parametrize("engine, fields, served", [
    ("sim", {}, SIM_MODEL_NAME),
    ("sim", {"served_model_name": "llama-8b"}, "llama-8b"),
    ("torch", {"model": "tiny"}, "tiny"),
    ("torch", {"model": "/models/Llama-3.2-1B/"}, "Llama-3.2-1B"),
    ("torch", {"model": "/models/Llama-3.2-1B", "served_model_name": "llama"}, "llama"),
    ("openai", {"engine_model": "Qwen/Qwen2.5-7B"}, "Qwen/Qwen2.5-7B"),
], ids=["sim-default", "sim-named", "torch-preset", "torch-dir-basename", "torch-named", "openai-engine-model"])
def test_a_worker_serves_the_named_model_or_its_engines_own(engine, fields, served):
    assert WorkerConfig(worker_id="w0", engine=engine, **fields).served_model() == served


# ------------------------------------------------------------------ the scheduler's model filter
DEFAULT = "base"  # the router's model_name in these tests


def make_worker(worker_id: str, model: str = "", role: str = "pd_fusion", adapters=(), **kw) -> WorkerStatusReported:
    return WorkerStatusReported(worker_id=worker_id, role=role, boot_id="b0", block_size_tokens=16, num_kv_blocks=10_000,
                                num_free_kv_blocks=10_000, max_batch_tokens=65536, max_seq_len_tokens=8192, model=model,
                                lora_adapters=list(adapters), **kw)


def make_scheduler(*workers: WorkerStatusReported, **cfg) -> Scheduler:
    s = Scheduler(SchedulerConfig(prefill_policy="round-robin", decode_policy="round-robin", model_name=DEFAULT, **cfg),
                  id_prefix="r-boot")
    for w in workers:
        s.on_worker_event(w, 0)
    return s


def admit(s: Scheduler, rid: str, model: str = "") -> Admitted | Rejected:
    return s.admit(AdmitRequest(request_id=rid, num_prompt_tokens=10, max_tokens=4, model=model), 0)


TWO_POOLS = (make_worker("a0", "a"), make_worker("a1", "a"), make_worker("b0", "b"), make_worker("old"))


@pytest.mark.parametrize("model, pool", [
    ("a", {"a0", "a1"}),
    ("b", {"b0"}),
    ("", {"old"}),  # no model: the default pool, where a worker that reports none serves
    (DEFAULT, {"old"}),
], ids=["pool-a", "pool-b", "no-model-is-the-default", "the-default-by-name"])
def test_a_request_goes_only_to_workers_serving_its_model(model, pool):
    s = make_scheduler(*TWO_POOLS)
    picked = {admit(s, f"r{i}", model).request.prefill_worker_id for i in range(12)}
    assert picked == pool


def test_workers_of_other_models_are_on_the_score_cards_filtered_by_model():
    s = make_scheduler(*TWO_POOLS)
    card = {c.worker_id: c.filtered_by for c in admit(s, "r", "b").decisions[0].pick.scores}
    assert card == {"b0": None, "a0": "model", "a1": "model", "old": "model"}


def test_a_disaggregated_pool_filters_both_stages():
    s = make_scheduler(make_worker("pa", "a", "prefill"), make_worker("da", "a", "decode"),
                       make_worker("pb", "b", "prefill"), make_worker("db", "b", "decode"))
    out = admit(s, "r", "b")
    assert (out.request.prefill_worker_id, out.request.decode_worker_id) == ("pb", "db")
    assert [{c.worker_id for c in d.pick.scores if c.filtered_by == "model"} for d in out.decisions] == [{"pa", "da"}] * 2


@pytest.mark.parametrize("model, code", [
    ("gpt-9", "model_not_found"),  # no worker ever reported it, and not the default
    (DEFAULT, "no_worker"),  # the default always names a pool, even with no worker in it
    ("", "no_worker"),
], ids=["unknown-model", "default-without-workers", "no-model-without-default-workers"])
def test_a_request_for_a_model_without_a_pool_or_without_workers_is_refused(model, code):
    out = admit(make_scheduler(make_worker("a0", "a"), make_worker("b0", "b")), "r", model)
    assert isinstance(out, Rejected) and out.code == code, out


@pytest.mark.parametrize("model", ["", DEFAULT, "tiny"], ids=["no-model", "the-default", "its-own-name"])
def test_a_fleet_of_one_model_takes_requests_for_the_default_as_before_pools(model):
    s = make_scheduler(make_worker("w0", "tiny"), make_worker("w1", "tiny"))  # (a torch fleet: the preset's name)
    assert isinstance(admit(s, "r", model), Admitted)
    s.on_worker_event(make_worker("w2", "other"), 1)  # two models now: the default names its own, empty pool
    assert admit(s, "r2", "").code == "no_worker"
    assert isinstance(admit(s, "r3", "tiny"), Admitted)


def test_a_known_model_whose_workers_are_all_drained_or_gone_is_no_worker_not_unknown():
    s = make_scheduler(make_worker("a0", "a"), make_worker("b0", "b"))
    s.set_drain_flags({"a0"})
    assert admit(s, "r1", "a").code == "no_worker"
    s.remove_worker("a0")  # expired or removed: the model is still one the view has seen
    assert admit(s, "r2", "a").code == "no_worker"
    assert isinstance(admit(s, "r3", "b"), Admitted)


def test_a_worker_that_changes_model_moves_pool():
    s = make_scheduler(make_worker("w0", "a"), make_worker("w1", "a"))
    assert admit(s, "r1", "a").request.prefill_worker_id == "w0"
    s.on_worker_event(make_worker("w0", "b"), 1)
    assert {admit(s, f"r{i}", "a").request.prefill_worker_id for i in range(2, 6)} == {"w1"}
    assert admit(s, "r6", "b").request.prefill_worker_id == "w0"


# ------------------------------------------------------------------ /v1/models
def test_the_view_lists_every_model_with_its_adapters_and_the_default():
    view = WorkerView(DEFAULT)
    for w in (make_worker("a0", "a", adapters=["sql", "chat"]), make_worker("a1", "a", adapters=["chat"]),
              make_worker("b0", "b"), make_worker("old")):
        view.apply(w, 0)
    assert view.models() == {"a": ["chat", "sql"], "b": [], DEFAULT: []}
    assert WorkerView(DEFAULT).models() == {DEFAULT: []}  # no worker yet: the default still listed


def test_models_body_lists_models_then_adapters_with_their_parent():
    body = models_body({"a": ["chat"], "b": []})
    assert body["object"] == "list"
    assert [(d["id"], d["parent"]) for d in body["data"]] == [("a", None), ("b", None), ("chat", "a")]
    assert all(d["object"] == "model" for d in body["data"])


# ------------------------------------------------------------------ flexlb up --pool
def test_pools_parse_in_order_and_a_model_name_may_hold_an_equals_sign():
    assert parse_pools(["a=2", "org/model=v1=3"]) == [("a", 2), ("org/model=v1", 3)]


@pytest.mark.parametrize("values", [["a"], ["=2"], ["a=0"], ["a=x"], ["a=1", "a=2"]],
                         ids=["no-count", "no-name", "zero-workers", "not-a-number", "model-twice"])
def test_a_bad_pool_is_refused_naming_it(values):
    with pytest.raises(ValueError, match="--pool"):
        parse_pools(values)


def test_a_request_for_an_adapter_is_routed_in_its_parents_pool_to_a_worker_serving_it():
    s = make_scheduler(make_worker("a0", "a", adapters=["sql"]), make_worker("a1", "a"), make_worker("b0", "b"))
    out = admit(s, "r", "sql")
    assert isinstance(out, Admitted) and out.request.prefill_worker_id == "a0" and out.request.lora_adapter == "sql"
    lora = out.decisions[0]
    assert lora.stage == "lora" and {c.worker_id: c.filtered_by for c in lora.pick.scores} == {"a0": None, "a1": "lora"}
