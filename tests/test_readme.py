"""The README's first screen is a promise to a new user; CI must run exactly its test command."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
