"""Model pools (issue 27, 1): what a worker says it serves, the scheduler's model filter,
and the /v1/models listing the router builds from its view."""

from __future__ import annotations

import pytest

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
