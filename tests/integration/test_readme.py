"""The README's first screen is a promise to a new user; CI must run exactly its test command."""

import asyncio
import contextlib
import io
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bash_blocks(text: str) -> list[str]:
    blocks, cur, inside = [], [], False
    for line in text.splitlines():
        if line.startswith("```bash"):
            inside, cur = True, []
        elif line.startswith("```") and inside:
            inside = False
            blocks.append("\n".join(cur).strip())
        elif inside:
            cur.append(line)
    return blocks


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    first_screen = "\n".join(readme.splitlines()[:30])
    serve, test = _bash_blocks(first_screen)[:2]
    assert "fd serve" in serve and "pip install" in serve
    assert "pytest" in test
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test in ci, "the README's test command must appear verbatim in .ci/run"


def _blocks(text: str, lang: str) -> list[str]:
    blocks, cur, inside = [], [], False
    for line in text.splitlines():
        if line.startswith(f"```{lang}"):
            inside, cur = True, []
        elif line.startswith("```") and inside:
            inside = False
            blocks.append("\n".join(cur))
        elif inside:
            cur.append(line)
    return blocks


def test_every_page_the_readme_links_to_exists():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)\)", readme)
    assert len(links) >= 10, links
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, missing
    for page in (ROOT / "docs").glob("*.md"):
        for link in re.findall(r"\]\(([^)#:]+)\)", page.read_text()):
            assert (page.parent / link).exists(), f"{page.name} links to a missing {link}"


def test_the_readme_fits_a_screen_with_its_contents():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 60, "the long reference belongs in docs/"
    assert "## Contents" in lines


async def test_the_readmes_openai_snippet_streams_an_answer(served):
    """The README's ``openai`` snippet, as a user pastes it, against what ``fd serve`` runs
    (the tiny model's name and the test server's port in place of the defaults)."""
    api, _ = served
    (snippet,) = _blocks((ROOT / "README.md").read_text(), "python")
    code = snippet.replace("http://localhost:8000", api.url).replace(
        "SmolLM2-135M-Instruct", api.cfg.model_name
    )
    assert code != snippet
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        await asyncio.to_thread(exec, code, {})
    assert len(out.getvalue()) > 0
