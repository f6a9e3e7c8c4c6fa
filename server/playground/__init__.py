"""The playground: one page at `/` that chats with the served model over `/v1/chat/completions`
and shows where each token came from (`return_token_origins`) and what speculation did to speed.

Static files shipped in the package (no build step, no CDN); `playground: false` turns it off.
The page and its files are open like /metrics: with an API key set, the page asks for the key and
sends it with each API call.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parent / "static"
PREFIX = "/playground"  # the page's own files; `/` is the page


def add_playground(app: FastAPI) -> None:
    router = APIRouter()

    @router.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    app.include_router(router)
    app.mount(PREFIX, StaticFiles(directory=STATIC), name="playground")


def is_open_path(path: str) -> bool:
    """The page and its files need no API key (the page asks for one for the API calls)."""
    return path == "/" or path.startswith(PREFIX + "/")
