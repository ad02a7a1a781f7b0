"""The documentation's links and the README's commands work.

Every relative link in README.md, CONTRIBUTING.md, SECURITY.md and docs/*.md names a
file that exists and, with a `#anchor`, a heading of that file (GitHub's anchors:
lowercased, punctuation dropped, spaces to hyphens, `-1`, `-2` for repeats). The
README's "Run it" commands name files that exist (the compose file, its profiles,
`.env.example`, a model of the registry), and every repository path and script the
README quotes exists.
"""
from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from swapper.registry import Registry

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted([REPO / "README.md", REPO / "CONTRIBUTING.md", REPO / "SECURITY.md",
               *(REPO / "docs").glob("*.md")])
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def prose(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code blanked."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else re.sub(r"`[^`]*`", "``", line))
    return out


def slug(heading: str) -> str:
    h = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link's text
    h = re.sub(r"[^\w\- ]", "", h.strip().lower())
    return h.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    return [(i, m.group(1)) for i, line in enumerate(prose(path.read_text()), 1)
            for m in LINK.finditer(line)]


def test_the_pages_exist():
    names = {p.relative_to(REPO).as_posix() for p in DOCS}
    for page in ("docs/agents.md", "docs/swapping.md", "docs/fleet.md", "docs/api.md",
                 "docs/models.md", "docs/troubleshooting.md", "docs/architecture.md",
                 "docs/kv-cache.md", "docs/performance.md", "docs/configuration.md"):
        assert page in names, page


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(path):
    bad = []
    found = links(path)
    for line, target in found:
        if re.match(r"[a-z][a-z0-9+.-]*:", target):       # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{path.name}:{line}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{path.name}:{line}: {target}: no heading #{anchor} in {dest.name}")
    assert not bad, "\n".join(bad)


def test_the_link_check_sees_links_and_anchors():
    """The checker itself: it finds links outside code, and GitHub's anchors."""
    readme = REPO / "README.md"
    targets = {t for _, t in links(readme)}
    assert "docs/agents.md#claude-code" in targets and "CONTRIBUTING.md" in targets
    assert slug("The model registry (`backends/`)") == "the-model-registry-backends"
    assert slug("Results: the real llama-server (SmolLM2, loads of 1.2-2.5 s)") == \
        "results-the-real-llama-server-smollm2-loads-of-12-25-s"
    assert "run-it" in anchors(readme) and "models" in anchors(readme)


# ------------------------------------------------------------------ the README's commands

def section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def code_blocks(text: str, lang: str = "bash") -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def commands(block: str) -> list[list[str]]:
    """Each command of a shell block (continuations joined, comments dropped)."""
    joined = re.sub(r"\\\n", " ", block)
    return [shlex.split(line, comments=True) for line in joined.splitlines()
            if shlex.split(line, comments=True)]


def compose_profiles() -> set[str]:
    text = (REPO / "docker-compose.yaml").read_text()
    return {p for group in re.findall(r"profiles:\s*\[([^\]]*)\]", text)
            for p in re.findall(r"[\w-]+", group)}


def check_command(argv: list[str], names: set[str]) -> list[str]:
    bad = []
    if argv[0] == "cp":
        if not (REPO / argv[1]).exists():
            bad.append(f"cp: {argv[1]} does not exist")
    elif argv[:2] == ["docker", "compose"]:
        files = [argv[i + 1] for i, a in enumerate(argv) if a == "-f"] or ["docker-compose.yaml"]
        bad += [f"{f}: no such compose file" for f in files if not (REPO / f).exists()]
        for i, a in enumerate(argv):
            if a == "--profile" and argv[i + 1] not in compose_profiles():
                bad.append(f"compose has no profile {argv[i + 1]!r}")
    elif argv[0].startswith("./") or argv[0].endswith(".sh"):
        script = REPO / argv[0]
        if not (script.is_file() and os.access(script, os.X_OK)):
            bad.append(f"{argv[0]}: not an executable file of the repository")
    elif argv[0] == "curl":
        for body in (a for a in argv if a.startswith("{")):
            model = re.search(r'"model"\s*:\s*"([^"]+)"', body)
            if model and model.group(1) not in names:
                bad.append(f"curl names {model.group(1)!r}, not a registry model")
    return bad


def registry_names() -> set[str]:
    reg = Registry.load(REPO / "backends", env={})
    return {n for m in reg for n in (m.id, *m.aliases)}


def test_run_it_commands_name_what_exists():
    text = (REPO / "README.md").read_text()
    run_it = section(text, "Run it")
    blocks = code_blocks(run_it)
    assert blocks, "Run it has no bash block"
    argvs = [a for b in blocks for a in commands(b)]
    # the commands quoted inline in its prose too (`docker compose --profile ...`)
    argvs += [shlex.split(c) for c in re.findall(r"`((?:docker compose|\./)[^`]*)`", run_it)]
    assert any(a[:2] == ["docker", "compose"] for a in argvs)
    names = registry_names()
    bad = [f"{' '.join(a)}: {b}" for a in argvs for b in check_command(a, names)]
    assert not bad, "\n".join(bad)


def test_the_first_request_names_a_registry_model():
    text = (REPO / "README.md").read_text()
    first = section(text, "First request")
    names = registry_names()
    models = re.findall(r'"model"\s*:\s*"([^"]+)"|model="([^"]+)"', first)
    assert models
    for pair in models:
        assert (pair[0] or pair[1]) in names, pair


def quoted_paths(text: str) -> list[str]:
    """The repository paths among the words of the inline code of `text`."""
    tops = {p.name for p in REPO.iterdir() if not p.name.startswith(".git")}
    out = []
    for code in re.findall(r"`([^`\n]+)`", text):
        for word in code.split():
            word = word.rstrip(",;:")
            word = word[2:] if word.startswith("./") else word
            if "<" in word or ("/" not in word
                               and not word.endswith((".sh", ".md", ".yaml", ".example"))):
                continue
            if word.split("/")[0] in tops:      # else a URL, a route, a container's path
                out.append(word)
    return out


def test_paths_and_scripts_the_readme_quotes_exist():
    """`backends/models/gpu.yaml`, `./download-model.sh --list`, `cp .env.example .env`
    ...: every repository path in the README's inline code exists (globs match)."""
    checked = quoted_paths((REPO / "README.md").read_text())
    assert not [w for w in checked if not list(REPO.glob(w))]
    assert {"download-model.sh", ".env.example", "backends/models/gpu.yaml"} <= set(checked)


def test_the_readme_settings_are_real_with_their_defaults():
    """The settings a newcomer may touch (README, Settings) are settings of
    .env.example, with the same defaults; the page of all of them is linked."""
    text = section((REPO / "README.md").read_text(), "Settings")
    example = {}
    for line in (REPO / ".env.example").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            example[key.strip()] = value
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in text.splitlines() if line.startswith("| `")]
    assert 5 <= len(rows) <= 10, "a newcomer's handful, not the whole table"
    for var_cell, default_cell, _ in rows:
        names = re.findall(r"`([A-Z0-9_]+)`", var_cell)
        literals = re.findall(r"`([^`]*)`", default_cell)
        for i, name in enumerate(names):
            assert name in example, f"{name}: not a setting of .env.example"
            if len(literals) == len(names):
                assert example[name] == literals[i], (name, example[name], literals[i])
            else:
                assert example[name] == "", (name, "described in words: empty by default")
    assert "docs/configuration.md" in text
