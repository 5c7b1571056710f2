"""The README's library quickstart runs, and prints what the README says it prints."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def _block(text: str, lang: str, after: str) -> str:
    start = text.index(after)
    found = re.search(rf"```{lang}\n(.*?)```", text[start:], re.S)
    assert found is not None, f"no ```{lang} block after {after!r} in README.md"
    return found.group(1)


def test_quickstart_runs_and_prints_what_the_readme_says() -> None:
    text = README.read_text()
    code = _block(text, "python", "## Library quickstart")
    expected = _block(text, "text", "It prints:")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md quickstart", "exec"), {"__name__": "readme"})
    assert out.getvalue() == expected


def test_readme_starts_with_the_two_commands_ci_runs() -> None:
    text = README.read_text()
    commands = _block(text, "bash", "# hybridkv").strip().splitlines()
    assert len(commands) == 2
    assert commands[0].endswith("pip install -e . && hybridkv simulate")
    ci = (README.parent / ".ci" / "run").read_text()
    assert commands[1].split(" && ", 1)[1] in ci.replace("\n", " ")
