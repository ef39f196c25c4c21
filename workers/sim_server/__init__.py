"""The simulated engine over HTTP (`flexlb sim-server`), so that peer routers (sglang-router,
vllm-router) drive the very engine FlexLB's workers run: http.py (the ASGI app and its
endpoints), front.py (the engine side: one engine on the shared step loop, the open
streams), formats.py (response bodies and stream chunks per dialect), requests.py (request
parsing and refusals), pd.py (SGLang's PD bootstrap, emulated).

Imports point one way: http -> front, formats, requests, pd; formats -> front.
"""
