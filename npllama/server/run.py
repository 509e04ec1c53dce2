"""Run the server with uvicorn: load the model, size the engine, print the URL once listening."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import uvicorn

from .app import DEFAULT_MAX_BODY, DEFAULT_MAX_QUEUE, create_app
from .engine import Engine


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, calling `on_ready(url)` once its socket listens."""

    def __init__(self, config: uvicorn.Config, on_ready):
        super().__init__(config)
        self.on_ready = on_ready

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self.on_ready(f"http://{f'[{host}]' if ':' in host else host}:{port}")


def build(model, *, host: str = "127.0.0.1", port: int = 8080, api_key: str | None = None, ctx: int | None = None,
          parallel: int = 4, threads: int | None = None, cors_origins=(), max_body: int = DEFAULT_MAX_BODY,
          max_queue: int = DEFAULT_MAX_QUEUE, model_id: str | None = None, shutdown_timeout: float = 10.0, log_level: str = "warning",
          webui: bool = True, matryoshka=False, on_ready=None) -> _Uvicorn:
    """A uvicorn server for a loaded `model` (not yet running: call `.run()`, or `.serve()` in a loop),
    with the browser chat page at `/` unless `webui` is false (or the model only embeds).
    `matryoshka`: True, or the sizes it was trained at, if the model is Matryoshka-trained
    (`dimensions` of /v1/embeddings, see embeddings.py).

    For speed on a machine with few cores, no live thread but the engine's should have run
    the model's compiled code: load the model on a thread that then ends, as `serve` does (see
    there), not on the thread that will run the server."""
    engine = Engine(model, ctx=ctx, parallel=parallel, threads=threads)
    app = create_app(engine, model_id=model_id, api_key=api_key, cors_origins=cors_origins, max_body=max_body,
                     max_queue=max_queue, webui=webui, matryoshka=matryoshka)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=shutdown_timeout, access_log=False)
    server = _Uvicorn(config, on_ready or (lambda url: None))
    server.app = app
    return server


def serve(model=None, *, threads: int | None = None, activations: str = "f32", kv_dtype=None, device: str = "cpu",
          **options) -> None:
    """Load `model` (a path, or the default model) on `device` and serve it until Ctrl-C or
    SIGTERM: then the server takes no new requests, lets running ones finish for up to
    `shutdown_timeout` seconds, and aborts the rest. The options are those of `build`. On a
    CUDA device the requests are batched there (its KV pool in device memory)."""
    from ..model import load
    # Loaded on a thread that then ends, so that the engine thread is the only one holding a
    # team of Numba's OpenMP workers: while another thread (this one) holds a team, libgomp
    # manages more threads than a small machine has cores and stops spinning between parallel
    # regions, and each of the engine's (about 120 per batched step) then waits for its
    # workers to wake: measured on 2 cores, 40 us a region, a lone int8 request 2.5x slower.
    with ThreadPoolExecutor(1, thread_name_prefix="npllama-load") as ex:
        m = ex.submit(load, model, threads=threads, activations=activations, kv_dtype=kv_dtype,
                      device=device).result()
    server = build(m, threads=threads, **options)
    engine = server.app.state.engine

    def ready(url):
        chat = f"; chat in a browser at {url}/" if options.get("webui", True) and engine.generates else ""
        print(f"npllama serve: listening on {url} (model {server.app.state.model_id}, {engine.parallel} sequences "
              f"of {engine.ctx} tokens){chat}", flush=True)
    server.on_ready = ready
    server.run()  # a port it cannot bind: uvicorn logs why and exits with status 1
