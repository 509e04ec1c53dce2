"""The browser chat page: `/` is the page, `/ui/...` its files (static/: plain HTML, CSS and
JavaScript modules, with marked and DOMPurify vendored, no build step).

The page talks to the server only through the OpenAI routes any client uses. Its responses
carry a Content-Security-Policy that allows nothing from another origin and no inline script
or style, so a model's answer cannot run script even if the sanitiser missed something. The
page and its files are public under `--api-key` (the page asks for the key; every API call
still needs it).
"""
from __future__ import annotations

from pathlib import Path

from starlette.responses import Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

STATIC = Path(__file__).with_name("static")
PREFIX = "/ui"

CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_HEADERS = {"content-security-policy": CSP, "x-content-type-options": "nosniff", "referrer-policy": "no-referrer"}
# Set here rather than guessed: Python's mimetypes knows .mjs only from some systems' tables,
# and a module script served as anything but JavaScript does not run.
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".mjs": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml",
          ".md": "text/markdown; charset=utf-8", ".txt": "text/plain; charset=utf-8"}
_REVALIDATE = "no-cache"  # the page's own files: cached, but checked (ETag) on every load
_IMMUTABLE = "public, max-age=31536000, immutable"  # vendor/: the version is in the file's name


class _Files(StaticFiles):
    """StaticFiles with explicit content types, the page's security headers and caching."""

    def file_response(self, full_path, stat_result, scope, status_code: int = 200) -> Response:
        response = super().file_response(full_path, stat_result, scope, status_code)
        path = Path(full_path)
        if response.status_code == 200:
            response.headers["content-type"] = _TYPES.get(path.suffix, "application/octet-stream")
        response.headers.update(_HEADERS)
        vendored = path.parent.name == "vendor" and path.suffix in (".js", ".mjs")
        response.headers["cache-control"] = _IMMUTABLE if vendored else _REVALIDATE
        return response


def is_public(path: str) -> bool:
    """Whether `path` is the page or one of its files (served without the API key)."""
    return path == "/" or path.startswith(PREFIX + "/")


def routes(api_key: bool) -> list:
    """The page's routes. With `api_key`, the page is told to ask for the key before its first call."""
    html = (STATIC / "index.html").read_text(encoding="utf-8")
    if api_key:
        marker = '<meta name="npllama-auth" content="none">'
        if marker not in html:
            raise RuntimeError(f"static/index.html lacks {marker}")
        html = html.replace(marker, '<meta name="npllama-auth" content="bearer">')

    async def index(request):
        return Response(html, media_type="text/html; charset=utf-8",
                        headers={**_HEADERS, "cache-control": _REVALIDATE})
    return [Route("/", index, methods=["GET", "HEAD"]), Mount(PREFIX, _Files(directory=STATIC), name="webui")]
