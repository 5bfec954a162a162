"""Which Host headers and which browser requests this server answers, against DNS rebinding and cross-site
requests from a page in the user's browser (the server may run without a key on a laptop).

- Host: a name that resolves to this server only because an attacker's DNS says so (rebinding) must not reach
  it. Allowed: the names of `--allowed-hosts` (`*` for any, `*.example.com` for a domain and its subdomains), by
  default the loopback names when the server listens on a loopback address and any name otherwise; an IP
  literal is always allowed (a page can only send one as its own origin's host, which is no rebinding).
- A request that changes state (any method but GET, HEAD and OPTIONS) sent by a page of another site: a
  browser says so in `Sec-Fetch-Site` (cross-site, same-site) or, where it does not send that, in an `Origin`
  whose host is not the Host it was sent to. Such a request is refused: no route of this server is meant for
  another site's pages (it sends no CORS headers), and a "simple" request (a form post, text/plain) needs no
  preflight, so the browser would deliver it. Clients that are not browsers send neither header.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def default_allowed_hosts(bind_host: str, given: tuple[str, ...]) -> tuple[str, ...]:
    """--allowed-hosts (comma-separated or repeated); without it: the loopback names for a loopback address,
    else any name."""
    names = tuple(n.strip().lower() for item in given for n in item.split(",") if n.strip())
    if names:
        return names
    return LOOPBACK_NAMES if _is_loopback(bind_host) else ("*",)


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name of a Host header without its port ("[::1]:30000" -> "::1"), lowercase, no trailing dot."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0].rstrip(".") if header.count(":") == 1 else header.rstrip(".")


def host_allowed(header: str, allowed: tuple[str, ...]) -> bool:
    name = host_name(header)
    if not name:
        return False
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    for pattern in allowed:
        if pattern == "*" or name == pattern:
            return True
        if pattern.startswith("*.") and (name == pattern[2:] or name.endswith(pattern[1:])):
            return True
    return False


def cross_site(method: str, headers: dict[str, str]) -> bool:
    """A state-changing request that a browser says comes from another site's page."""
    if method in SAFE_METHODS:
        return False
    site = headers.get("sec-fetch-site")
    if site is not None:
        return site not in ("same-origin", "none")  # "none": typed by the user, a bookmark
    origin = headers.get("origin")
    if origin is None:
        return False
    return origin == "null" or urlsplit(origin).netloc.lower() != headers.get("host", "").lower()
