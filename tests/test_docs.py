"""The documentation against the tree and the CLI: every relative link in README.md and docs/*.md names a file
that exists (and, into a markdown file, a heading that exists); every ``torchtsp ...`` command in their code
blocks parses with the CLI's own parser; every flag of every command appears somewhere in them; every dotted
``torchtsp.a.b`` name they show resolves after a plain ``import torchtsp``. Fast, torch-free
where the CLI is (the parser is built, never run)."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from torchtsp.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)|\!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
SEPARATORS = {"&&", "||", "|", ";", "&"}


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _outside_code(text: str) -> str:
    """The text without its fenced code blocks and inline code spans (links there are not links)."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, inline markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text.replace("`", ""))
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            slug = _slug(m.group(1))
            out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return out


def _links():
    for doc in DOCS:
        for m in LINK.finditer(_outside_code(doc.read_text())):
            target = m.group(1) or m.group(2)
            if not re.match(r"[a-z]+:", target):  # http:, https:, mailto: are not checked here
                yield doc, target


def test_every_relative_link_resolves():
    bad = []
    for doc, target in _links():
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            bad.append(f"{_name(doc)}: {target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            bad.append(f"{_name(doc)}: {target} (no heading #{anchor} in {_name(file)})")
    assert not bad, "broken links:\n" + "\n".join(bad)


def _commands(text: str):
    """The argv of every ``torchtsp ...`` (or ``... -m torchtsp ...``) command in the text's fenced code blocks:
    a segment of a shell line (between ``&&``, ``|``, ``;``) whose program is torchtsp, after any VAR=value."""
    for block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:  # not shell (Python, JSON): no command here
                continue
            command: list[str] | None = None
            program = True  # the next word names the segment's program
            for word in [*words, ";"]:
                if word in SEPARATORS:
                    if command:
                        yield line.strip(), command
                    command, program = None, True
                elif command is not None:
                    command.append(word)
                elif word == "-m":
                    command = ["-m"]
                elif program and re.fullmatch(r"\w+=\S*", word):
                    continue  # an environment assignment before the program
                elif program and (word == "torchtsp" or word.endswith("/torchtsp")):
                    command = ["torchtsp"]
                else:
                    program = False


def _all_commands():
    for doc in DOCS:
        for line, argv in _commands(doc.read_text()):
            argv = argv[2:] if argv[:2] == ["-m", "torchtsp"] else argv[1:] if argv[0] == "torchtsp" else None
            if argv is not None:
                yield doc, line, argv


def test_commands_shown_parse():
    parser, bad, seen = build_parser(), [], 0
    for doc, line, argv in _all_commands():
        seen += 1
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                parser.parse_args(argv)
            except SystemExit as e:
                if e.code:
                    bad.append(f"{_name(doc)}: {line}\n    {err.getvalue().strip()}")
    assert seen > 30, f"only {seen} commands found in code blocks: the extraction is broken"
    assert not bad, "commands the CLI refuses:\n" + "\n".join(bad)


def _flags():
    """(command, flag) for every option string of every command, hidden ones aside."""
    parser = build_parser()
    yield from (("torchtsp", flag) for a in parser._actions for flag in a.option_strings if flag.startswith("--"))
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in sub.choices.items():
        for action in command._actions:
            if action.help == argparse.SUPPRESS:
                continue
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help":
                    yield name, flag


def test_every_flag_is_documented():
    text = "\n".join(doc.read_text() for doc in DOCS)
    missing = [f"torchtsp {name} {flag}" for name, flag in _flags()
               if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text)]
    assert not missing, "flags no document mentions:\n" + "\n".join(missing)


DOTTED = re.compile(r"\btorchtsp(?:\.[A-Za-z_]\w*)+")


def test_dotted_names_resolve_after_import_torchtsp():
    """What a reader types after ``import torchtsp`` (code and prose alike) must not raise AttributeError; run in a
    fresh interpreter, so that no module another test imported makes a submodule an attribute by accident."""
    names = sorted({m.group(0) for doc in DOCS for m in DOTTED.finditer(doc.read_text())})
    assert len(names) > 10, f"only {len(names)} dotted names found: the extraction is broken"
    script = ("import sys, torchtsp\n"
              "bad = []\n"
              "for name in sys.argv[1:]:\n"
              "    obj = torchtsp\n"
              "    try:\n"
              "        for part in name.split('.')[1:]:\n"
              "            obj = getattr(obj, part)\n"
              "    except AttributeError as e:\n"
              "        bad.append(f'{name}: {e}')\n"
              "print('\\n'.join(bad))\n")
    result = subprocess.run([sys.executable, "-c", script, *names], capture_output=True, text=True, timeout=300,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert not result.stdout.strip(), "names the docs show that fail after `import torchtsp`:\n" + result.stdout


def test_import_torchtsp_imports_no_torch():
    code = "import sys, torchtsp; assert 'torch' not in sys.modules, 'import torchtsp imported torch'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("text, expected", [
    ("```\ntorchtsp train --tsp 4  # a comment\n```\n", [["torchtsp", "train", "--tsp", "4"]]),
    ("```\ntorchtsp convert a b && torchtsp generate --hf b \\\n    --prompt 'x y'\n```\n",
     [["torchtsp", "convert", "a", "b"], ["torchtsp", "generate", "--hf", "b", "--prompt", "x y"]]),
    ("```\ntorchrun --nproc-per-node 8 -m torchtsp train --tsp 8\n```\n", [["-m", "torchtsp", "train", "--tsp", "8"]]),
    ("```python\nimport torch, torchtsp\n```\n", []),
    ("```\ngit clone url torchtsp && HF_HUB_OFFLINE=1 .venv/bin/torchtsp plan\n```\n", [["torchtsp", "plan"]]),
])
def test_command_extraction(text, expected):
    assert [argv for _, argv in _commands(text)] == expected


def test_slugs_follow_github():
    assert _slug("Distributed optimizer over dp (`--zero`)") == "distributed-optimizer-over-dp---zero"
    assert _slug("Layout of the code") == "layout-of-the-code"
