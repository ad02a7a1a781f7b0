"""Search results as the model reads them, and the Sources block the client reads.

One `Sources` object lives for one client request: numbering continues across rounds
and a URL shown once is not shown again.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .searxng import SearchOutcome

TITLE_CHARS = 200
URL_CHARS = 300          # a result's URL as the model and the Sources block read it, at most


@dataclass
class Source:
    n: int
    title: str
    url: str
    date: str = ""           # YYYY-MM-DD when the engine gave one
    snippet: str = ""


def _clean(text, limit: int) -> str:
    t = re.sub(r"\s+", " ", str(text or "")).strip()
    return t if len(t) <= limit else t[:limit - 1].rstrip() + "…"


def _url(value) -> str:
    """A result's URL as shown: no whitespace or control characters (a URL has
    none; a line break would let a page write lines of its own into the tool
    message), at most URL_CHARS."""
    url = re.sub(r"[\s\x00-\x1f\x7f]+", "", str(value))
    return url if len(url) <= URL_CHARS else url[:URL_CHARS - 1] + "…"


def _url_key(url: str) -> str:
    u = url.strip().split("#", 1)[0]
    u = re.sub(r"^https?://(www\.)?", "", u, flags=re.I)
    return u.rstrip("/").lower()


def _date(r: dict) -> str:
    d = r.get("publishedDate") or r.get("pubdate") or ""
    return str(d)[:10] if d else ""


class Sources:
    def __init__(self, snippet_chars: int = 400):
        self.snippet_chars = snippet_chars
        self.items: list[Source] = []
        self._by_key: dict[str, Source] = {}

    def format(self, out: SearchOutcome) -> str:
        """The tool message for one query."""
        return self.format_with(out)[0]

    def format_with(self, out: SearchOutcome) -> tuple[str, list[Source]]:
        """The tool message for one query, and the sources of its results (a result
        already shown by an earlier search keeps its number)."""
        q = _clean(out.query, 200)
        found: list[Source] = []
        if not out.ok:
            return (f'Web search for "{q}" failed: {out.message}. Do not retry the search '
                    "right away; answer from what you already know and tell the user that "
                    "web search was unavailable."), found
        lines = [f'Web search results for "{q}":']
        for a in out.answers:
            lines.append(f"Direct answer: {_clean(a, self.snippet_chars)}")
        for box in out.infoboxes:
            name = _clean(box.get("infobox") or box.get("id") or "", TITLE_CHARS)
            text = _clean(box.get("content") or "", self.snippet_chars)
            attrs = "; ".join(
                f"{_clean(a.get('label'), 60)}: {_clean(a.get('value'), 120)}"
                for a in (box.get("attributes") or [])[:8]
                if isinstance(a, dict) and a.get("label"))
            url = _url(box.get("id")) if str(box.get("id", "")).startswith("http") else ""
            lines.append("Infobox: " + " — ".join(x for x in (name, text, attrs, url) if x))
        shown = dupes = 0
        for r in out.results:
            url = _url(r.get("url"))
            key = _url_key(url)
            if key in self._by_key:
                dupes += 1
                found.append(self._by_key[key])
                continue
            src = Source(len(self.items) + 1, _clean(r.get("title") or url, TITLE_CHARS), url,
                         _date(r), _clean(r.get("content") or "", self.snippet_chars))
            self.items.append(src)
            found.append(src)
            self._by_key[key] = src
            shown += 1
            lines.append(f"[{src.n}] {src.title}")
            lines.append(f"    URL: {url}")
            if _date(r):
                lines.append(f"    Date: {_date(r)}")
            snippet = _clean(r.get("content") or "", self.snippet_chars)
            if snippet:
                lines.append(f"    {snippet}")
        if dupes:
            lines.append(f"({dupes} result(s) already listed in earlier searches omitted.)")
        if out.empty:
            lines.append("No results. Try different, shorter keywords.")
            if out.suggestions:
                lines.append("Suggestions: " + ", ".join(out.suggestions))
        elif shown:
            lines.append("Cite the sources you use as [n].")
        return "\n".join(lines), found

    def block(self, answer: str | None = None) -> str:
        """`Sources:` block for the final answer: the sources the answer cites as [n],
        or every source shown to the model when it cites none. '' when there are none."""
        if not self.items:
            return ""
        cited = {int(n) for n in re.findall(r"\[(\d{1,3})\]", answer or "")}
        used = [s for s in self.items if s.n in cited] or self.items
        return "\n\nSources:\n" + "\n".join(f"[{s.n}] {s.title} — {s.url}" for s in used)


def repeated_query_note(query: str) -> str:
    return (f'You already searched for "{_clean(query, 200)}" in this conversation; its results '
            "are above. Do not repeat the same query: use those results, search with "
            "different keywords, or answer now.")


def bad_arguments_note(arguments: str) -> str:
    return ('web_search needs arguments {"query": "<keywords>"}; got '
            f"{_clean(arguments, 200)!r}. Call it again with a query string.")
