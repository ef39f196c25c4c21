"""The worker agent in front of an OpenAI-compatible engine server (`flexlb worker --engine
openai`): agent.py (the EngineBackend: batches released to the server, its streams relayed as
token chunks), relays.py (one stream's server-sent events into token chunks), status.py (the
server's load from its Prometheus /metrics), upstream.py (the lean HTTP/1.1 client of its
streams), kv_events.py and kv_zmq.py (vLLM's KV-cache events over ZMQ, into FlexLB's).

Imports point one way: agent -> relays -> upstream; agent -> status, kv_zmq -> kv_events.
"""
