"""GET /playground: a page that streams a chat completion with `stream_denoise` and draws each forward (masks,
drafts coloured by confidence, edits, committed blocks; S and Q side by side). Three static files shipped in the
package (server/static/), served as they are: no build step, no CDN, nothing fetched from elsewhere. The page
needs no key to load (it holds no data); the key a person types into it goes with its API calls."""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import Response

STATIC = files("redraft.server") / "static"
FILES = {"playground.js": "text/javascript; charset=utf-8", "playground.css": "text/css; charset=utf-8"}
PATHS = frozenset({"/playground", "/playground/", *(f"/playground/{name}" for name in FILES)})  # no key needed

router = APIRouter()
# Its own files only: no inline script, no framing by another site (clickjacking a page that holds a typed key),
# no type sniffing. Inline style attributes stay allowed (the legend's colour samples).
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "style-src-attr 'unsafe-inline'; img-src 'self' data:; connect-src 'self'; "
                               "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


# GET and HEAD (link checkers, `curl -I`), with and without the slash: the page links its files by absolute path
@router.api_route("/playground", methods=["GET", "HEAD"], include_in_schema=False)
@router.api_route("/playground/", methods=["GET", "HEAD"], include_in_schema=False)
async def playground_page() -> Response:
    return _static("playground.html", "text/html; charset=utf-8")


@router.api_route("/playground/{name}", methods=["GET", "HEAD"], include_in_schema=False)
async def playground_file(name: str) -> Response:
    if name not in FILES:
        return Response(status_code=404)
    return _static(name, FILES[name])


def _static(name: str, media_type: str) -> Response:
    return Response((STATIC / name).read_bytes(), media_type=media_type,
                    headers={"Cache-Control": "no-cache", **SECURITY_HEADERS})
