"""A SearXNG-shaped server: GET /search?q=..&format=json answers JSON exactly as SearXNG does.

Scriptable: mode "ok" | "403" (format=json not enabled) | "429" (limiter) | "empty"
(200, no results, unresponsive_engines) | "html" (not JSON). Per-query overrides in
`results`. Like SearXNG's limiter, the default python-requests User-Agent gets 429.
`barrier` (a threading.Barrier) makes queries wait for each other: parallel or fail.
"""
from __future__ import annotations

import re
import threading

from flask import Flask, Response, jsonify, request

from .servers import ScriptedServer

UNRESPONSIVE = [["google", "timeout"], ["duckduckgo", "CAPTCHA"], ["brave", "HTTP error"]]


def make_results(q: str, n: int = 5, host: str = "example.com") -> list[dict]:
    slug = re.sub(r"[^a-z0-9]+", "-", q.lower()).strip("-") or "q"
    return [{
        "url": f"https://{host}/{slug}/{i}",
        "title": f"{q} result {i}",
        "content": f"Snippet {i} about {q}. " + "x" * 20,
        "publishedDate": "2024-05-0%dT10:00:00" % (i % 9 + 1) if i % 2 else None,
        "thumbnail": "",
        "engine": "duckduckgo",
        "template": "default.html",
        "parsed_url": ["https", host, f"/{slug}/{i}", "", "", ""],
        "img_src": "",
        "priority": "",
        "engines": ["duckduckgo", "brave"],
        "positions": [i + 1],
        "score": 2.0 / (i + 1),
        "category": "general",
    } for i in range(n)]


class FakeSearxng(ScriptedServer):
    def __init__(self):
        self.mode = "ok"
        self.results: dict[str, list[dict]] = {}     # query -> results (override)
        self.answers: list = []
        self.infoboxes: list = []
        self.requests: list[dict] = []
        self.barrier: threading.Barrier | None = None
        self._lock = threading.Lock()
        self.app = self._make_app()
        self._server = None

    @property
    def queries(self) -> list[str]:
        return [r["q"] for r in self.requests]

    def _make_app(self) -> Flask:
        app = Flask("fake-searxng")

        @app.get("/search")
        def search():
            q = request.args.get("q", "")
            with self._lock:
                self.requests.append({"q": q, "format": request.args.get("format"),
                                      "headers": dict(request.headers)})
            if self.barrier is not None:
                try:
                    self.barrier.wait()
                except threading.BrokenBarrierError:
                    return Response("barrier broken: queries did not run in parallel", 500)
            ua = request.headers.get("User-Agent", "")
            if self.mode == "429" or ua.startswith("python-requests"):
                return Response("Too Many Requests", 429, mimetype="text/plain")
            if request.args.get("format") != "json":
                return Response("<html>results</html>", mimetype="text/html")
            if self.mode == "403":
                return Response("<!doctype html><title>403 Forbidden</title><h1>Forbidden</h1>",
                                403, mimetype="text/html")
            if self.mode == "html":
                return Response("<html>not json</html>", 200, mimetype="text/html")
            empty = self.mode == "empty"
            results = [] if empty else self.results.get(q, make_results(q))
            return jsonify({
                "query": q,
                "number_of_results": 0 if empty else len(results) * 1000,
                "results": results,
                "answers": [] if empty else self.answers,
                "corrections": [],
                "infoboxes": [] if empty else self.infoboxes,
                "suggestions": [f"{q} tutorial"],
                "unresponsive_engines": UNRESPONSIVE if empty else [],
            })

        return app

