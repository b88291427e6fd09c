"""Static hosting of the web page with SPA fallback, from which no path escapes.

The page is the web console, plain files in ``colibri/api/web`` (the default of ``--web-dist``,
``settings.WEB_DIST``); ``--web-dist`` may name another directory, and one that does not exist
leaves ``/`` with a short note instead (the tests' servers use that, whatever the checkout holds).

A request path is split into segments and each one checked: no ``..``, no empty or dot segments,
no backslashes or NULs; the joined path is resolved (symlinks followed) and must stay inside the
resolved root. Anything else falls back to ``index.html`` (the page's own router shows its 404)
or, for something that looks like an asset (has a file extension), a plain 404.

The console's own file types are fixed here, not left to the platform's table: a browser runs a
``<script type="module">`` only when it is served as JavaScript, and ``mimetypes`` reads
``/etc/mime.types`` (or the Windows registry), which on some machines says ``text/plain`` for ``.js``.
"""

from __future__ import annotations

import mimetypes
from pathlib import Path, PurePosixPath

from quart import Response

from colibri.api.openai_errors import not_found

NO_PAGE = (
    "<!doctype html><meta charset=utf-8><title>colibri</title>"
    "<h1>colibri</h1><p>The API is at <code>/v1</code> (OpenAI-compatible). "
    "The web console is not built: <code>--web-dist</code> names no directory.</p>"
)

CONTENT_TYPES = {
    ".html": "text/html", ".js": "text/javascript", ".mjs": "text/javascript", ".css": "text/css",
    ".json": "application/json", ".svg": "image/svg+xml", ".png": "image/png", ".ico": "image/x-icon",
}


def content_type(name: str) -> str:
    """The type a file is served as: the page's own types as above, the platform's table for the rest."""
    suffix = PurePosixPath(name).suffix.lower()
    return CONTENT_TYPES.get(suffix) or mimetypes.guess_type(name)[0] or "application/octet-stream"


class StaticSite:
    """The page's files under ``root``; with no root (none given, or not a directory), a note."""

    def __init__(self, root: Path | None) -> None:
        self.root = root.resolve() if root is not None and root.is_dir() else None

    def resolve(self, path: str) -> Path | None:
        """The file to serve for a URL path (already percent-decoded by the server), or None."""
        if self.root is None:
            return None
        segments = [s for s in path.split("/") if s]
        for s in segments:
            if s in (".", "..") or "\\" in s or "\0" in s or s.startswith("~") or ":" in s:
                return None
        candidate = self.root.joinpath(*segments) if segments else self.root / "index.html"
        try:
            real = candidate.resolve(strict=True)
        except (OSError, RuntimeError):
            return None
        if not real.is_relative_to(self.root) or not real.is_file():
            return None
        return real

    async def serve(self, path: str) -> Response:
        """The response for a GET of the page at ``path``; never raises for a client's path."""
        found = self.resolve(path)
        if found is None and "." not in path.rsplit("/", 1)[-1]:
            found = self.resolve("index.html")  # SPA fallback: the page routes client-side
        if found is None:
            if self.root is None and path in ("", "index.html"):
                return Response(NO_PAGE, mimetype="text/html")
            return Response(not_found().json_bytes(), status=404, mimetype="application/json")
        mime = content_type(found.name)
        # no-cache: revalidated on every load, so an upgraded package's page is never mixed with a
        # stale script (the files are small)
        headers = {"x-content-type-options": "nosniff", "cache-control": "no-cache"}
        return Response(found.read_bytes(), mimetype=mime, headers=headers)
