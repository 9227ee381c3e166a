"""The bare passthrough: the floor any Python proxy pays. aiohttp server, one shared aiohttp
ClientSession upstream, the body and the answer copied through (streams chunk by chunk), no parsing,
no auth, no recording.

    python -m benchmarks.overhead.passthrough --port 8100 --upstream http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse

import aiohttp
from aiohttp import web

HTTP = web.AppKey("http", aiohttp.ClientSession)
UPSTREAM = web.AppKey("upstream", str)


async def forward(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
    url = request.app[UPSTREAM] + request.path
    async with request.app[HTTP].post(url, data=body, headers=headers) as upstream:
        content_type = upstream.headers.get("Content-Type", "application/json")
        if not content_type.startswith("text/event-stream"):
            payload = await upstream.read()
            return web.Response(body=payload, status=upstream.status, content_type=content_type.split(";")[0])
        response = web.StreamResponse(status=upstream.status, headers={"Content-Type": content_type})
        await response.prepare(request)
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def build_app(upstream: str) -> web.Application:
    app = web.Application()
    app[UPSTREAM] = upstream.rstrip("/")

    async def session(app: web.Application):  # type: ignore[no-untyped-def]
        app[HTTP] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await app[HTTP].close()

    app.cleanup_ctx.append(session)
    app.router.add_get("/health", health)
    app.router.add_post("/{path:.*}", forward)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    web.run_app(
        build_app(args.upstream), host="127.0.0.1", port=args.port, access_log=None, print=None, backlog=4096
    )


if __name__ == "__main__":
    main()
