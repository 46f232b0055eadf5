"""Cross-origin requests (CORS), as vLLM's ``--allowed-origins`` / ``--allowed-methods`` /
``--allowed-headers`` / ``--allow-credentials`` set them (its defaults: any origin, method and
header; no credentials). A web page on another origin can then call the API from a browser:
its preflight (``OPTIONS`` with ``Access-Control-Request-Method``) is answered before the key
check (a browser sends no ``Authorization`` on one), and every answer to an allowed origin,
streamed ones included, says so in its headers.

Pure: :class:`Cors` decides the headers; the server adds them (fd.api.server).
"""

from __future__ import annotations

from dataclasses import dataclass

PREFLIGHT_MAX_AGE_S = 600


@dataclass(frozen=True, slots=True)
class Cors:
    origins: tuple[str, ...] = ("*",)
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False

    def allowed(self, origin: str) -> bool:
        return "*" in self.origins or origin in self.origins

    def response_headers(self, origin: str | None) -> dict[str, str]:
        """Headers for an answer to a request that came with ``Origin: origin``."""
        if origin is None or not self.allowed(origin):
            return {}
        out = {"Access-Control-Expose-Headers": "X-Request-Id"}
        if "*" in self.origins and not self.credentials:
            out["Access-Control-Allow-Origin"] = "*"
        else:  # (a credentialed answer must name the origin, and then varies with it)
            out["Access-Control-Allow-Origin"] = origin
            out["Vary"] = "Origin"
        if self.credentials:
            out["Access-Control-Allow-Credentials"] = "true"
        return out

    def preflight_headers(self, origin: str, method: str, asked_headers: str | None) -> dict[str, str] | None:
        """The answer's headers to a preflight, or None: refused (origin, method or a header
        not allowed)."""
        if not self.allowed(origin):
            return None
        if "*" not in self.methods and method.upper() not in {m.upper() for m in self.methods}:
            return None
        asked = [h.strip() for h in (asked_headers or "").split(",") if h.strip()]
        if "*" not in self.headers:
            allowed = {h.lower() for h in self.headers}
            if any(h.lower() not in allowed for h in asked):
                return None
        out = self.response_headers(origin)
        out["Access-Control-Allow-Methods"] = (
            method.upper() if "*" in self.methods else ", ".join(self.methods)
        )
        if asked:
            out["Access-Control-Allow-Headers"] = (
                ", ".join(asked) if "*" in self.headers else ", ".join(self.headers)
            )
        out["Access-Control-Max-Age"] = str(PREFLIGHT_MAX_AGE_S)
        return out
