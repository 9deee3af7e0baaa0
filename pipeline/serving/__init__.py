"""``cli serve``: captions over HTTP through the captioning engine of ``cli caption`` (docs/serving.md).

``settings`` (the ``serve:`` config as a dataclass), ``batcher`` (dynamic batching across requests on one model
thread), ``uploads`` (request bodies read under a cap and parsed in memory), ``metrics`` (Prometheus text),
``app`` (the ASGI application and its routes), ``protocol`` (uvicorn's HTTP/1.1 protocol with a header timeout),
``server`` (uvicorn with SIGTERM draining).
"""
