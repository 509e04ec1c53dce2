"""`npllama serve`: an OpenAI-compatible HTTP server with continuous batching.

    from npllama.server import serve
    serve("model.gguf", port=8080, parallel=8)      # blocks; Ctrl-C or SIGTERM stops it

engine.py owns the model (one thread steps the Scheduler), protocol.py checks requests and
shapes answers, app.py is the Starlette app, metrics.py the Prometheus metrics. Needs the
`serve` extra (starlette, uvicorn, prometheus-client).
"""
from .app import create_app
from .engine import Engine
from .run import serve

__all__ = ["Engine", "create_app", "serve"]
