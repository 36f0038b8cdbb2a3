"""The web pages: the playground at `/` and the dashboard at `/dashboard`, with their scripts and styles
under `/ui/`. They are static files built from `web/` (see web/build.mjs) and shipped in the wheel.

The pages hold no data, so they are served without the API key; everything they fetch (models, answers,
/metrics) goes through the same routes and key check as any client's request, the key taken from a login
field into the tab's session storage. Every page response carries a strict Content-Security-Policy: only
folio's own scripts, styles and connections, no inline script, no frames, no plugins, so model output that
slipped past the Markdown renderer's escaping still could not run.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from folio.server.errors import APIError

STATIC = Path(__file__).parent / "static"
PAGES = {"/": "index.html", "/dashboard": "dashboard.html"}
ASSET_PREFIX = "/ui/"
ASSET_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}

CONTENT_SECURITY_POLICY = "; ".join((
    "default-src 'none'",
    "script-src 'self'",
    "style-src 'self'",
    "img-src 'self' data:",
    "connect-src 'self'",
    "font-src 'self'",
    "base-uri 'none'",
    "form-action 'self'",
    "frame-ancestors 'none'",
))  # fmt: skip
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",  # revalidate: a new folio's pages replace the old at once
}


def is_ui_path(path: str) -> bool:
    """Whether `path` is one of the pages or their assets (served without the API key)."""
    return path in PAGES or path.startswith(ASSET_PREFIX)


def _file(name: str, media_type: str) -> FileResponse:
    return FileResponse(STATIC / name, media_type=media_type, headers=SECURITY_HEADERS)


def _page_handler(page: str) -> Callable[[], Awaitable[FileResponse]]:
    async def serve_page() -> FileResponse:
        return _file(page, "text/html; charset=utf-8")

    return serve_page


def ui_router() -> APIRouter:
    router = APIRouter(include_in_schema=False)
    assets = {path.name: path for path in STATIC.iterdir() if path.suffix in ASSET_TYPES}

    for route, page in PAGES.items():
        router.add_api_route(route, _page_handler(page), methods=["GET"])

    @router.get(ASSET_PREFIX + "{name}")
    async def asset(name: str) -> FileResponse:
        path = assets.get(name)  # only the built files: a name never becomes a path of its own
        if path is None:
            raise APIError(404, f"no such file: {name}")
        return _file(path.name, ASSET_TYPES[path.suffix])

    return router
