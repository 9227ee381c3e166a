"""The dashboard's page and its assets, shipped inside the package (proxy/dashboard/static/, package
data of the wheel) and served as they are. They hold no data, so they need no key: the page asks for an
admin key and sends it with each call to `/dashboard/api/`. A strict Content-Security-Policy allows
only this origin's script, styles and calls: no inline script, nothing fetched from elsewhere."""

from __future__ import annotations

from importlib.resources import files

from fastapi.responses import Response

from proxy.errors import OpenAIError

ASSETS = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "charts.js": "text/javascript; charset=utf-8",
    "session_view.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
"""The files the page loads (dashboard.js imports charts.js and session_view.js), and their media types:
nothing else under static/ is served."""

_SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _static(name: str) -> bytes:
    return (files("proxy.dashboard") / "static" / name).read_bytes()


async def page() -> Response:
    """GET /dashboard: the page."""
    return Response(_static("index.html"), media_type="text/html; charset=utf-8", headers=_SECURITY_HEADERS)


async def asset(name: str) -> Response:
    """GET /dashboard/static/{name}: the page's scripts or style sheet; 404 for any other name."""
    media_type = ASSETS.get(name)
    if media_type is None:
        raise OpenAIError(404, f"No dashboard asset {name!r}.", "invalid_request_error", code="not_found")
    return Response(_static(name), media_type=media_type, headers=_SECURITY_HEADERS)
