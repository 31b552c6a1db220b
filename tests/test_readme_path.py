"""A new user's first hour, read from the README: after ``make demo``, the commands of "One example per job" run as
written, in order, in a fresh shell. Checked without running them (each is run by hand for a release; the closing
notes say when): torchtsp is put on PATH, every folder a command reads was written by ``make demo`` or an earlier
command (or is in the repository), no two runs write the same folder, generation samples trained weights, and the
plan example fits something. Torch-free and fast: the CLI's parser is built, never run, except ``plan`` (offline,
no torch)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

from test_docs import _commands
from torchtsp.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"## {title}")
    end = README.find("\n## ", start + 1)
    return README[start:end if end > 0 else None]


def _demo_out() -> str:
    """The run folder ``make demo`` writes, read from the Makefile's recipe (not from the README)."""
    recipe = re.search(r"^demo:.*\n\t(.*)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    words = shlex.split(recipe)
    return words[words.index("--out") + 1]


def _norm(path: str) -> str:
    return path.rstrip("/")


def _steps():
    """(line, command name, parsed args) of each torchtsp command of "One example per job", in order."""
    parser = build_parser()
    for line, argv in _commands(_section("One example per job")):
        if argv[0] != "torchtsp":
            continue
        args = parser.parse_args(argv[1:])
        yield line, argv[1], args


def _reads_writes(name: str, args) -> tuple[list[str], list[str]]:
    """The folders or prefixes a command reads and the ones it writes (for the commands the README shows)."""
    reads = [getattr(args, a, None) for a in ("resume", "init_from_hf", "data", "checkpoint", "hf")]
    tokenizer = getattr(args, "tokenizer", None)
    reads.append(None if tokenizer in (None, "byte") else tokenizer)
    writes = []
    if name == "convert":
        reads.append(args.src)
        writes.append(args.dst)
    elif name in ("train", "prepare-data", "bench"):
        writes.append(getattr(args, "out", None))
    if name == "prepare-data":
        reads.extend(args.inputs)
    return [_norm(r) for r in reads if r], [_norm(w) for w in writes if w]


def test_readme_says_how_to_put_torchtsp_on_path():
    # `make demo` installs into .venv without activating it: a fresh shell finds no `torchtsp` unless the README
    # says how, before its first torchtsp command.
    text = _section("One example per job")
    first = text.index("torchtsp train")
    assert re.search(r"source \.venv/bin/activate", text[:first]), "the README must say to activate .venv first"


def test_each_command_reads_what_was_written_before_it():
    written = {_demo_out()}
    missing, collisions, seen = [], [], 0
    for line, name, args in _steps():
        seen += 1
        reads, writes = _reads_writes(name, args)
        for path in reads:
            # A checkpoint inside a run folder, a dataset prefix's files: anything under a folder written earlier.
            known = any(path == w or path.startswith(w + "/") for w in written)
            if not known and not (ROOT / path).exists():
                missing.append(f"{line}\n    reads {path}, which neither make demo nor an earlier command wrote")
        for path in writes:
            if path in written and not getattr(args, "overwrite", False):
                collisions.append(f"{line}\n    writes {path} again")
            written.add(path)
    assert seen >= 10, f"only {seen} commands found: the README's section or the extraction changed"
    assert not missing, "\n".join(missing)
    assert not collisions, "\n".join(collisions)


def test_generation_samples_trained_weights():
    # A --preset shape has random weights: what it samples says nothing of the model a new user just trained.
    generated = [(line, args) for line, name, args in _steps() if name == "generate"]
    assert generated
    for line, args in generated:
        assert args.checkpoint or args.hf, f"{line}\n    samples from random weights (a --preset)"


def test_the_plan_example_fits_and_shows_the_paper():
    (line, argv), = [(line, argv) for line, argv in _commands(_section("One example per job"))
                     if argv[:2] == ["torchtsp", "plan"]]
    out = subprocess.run([sys.executable, "-m", "torchtsp", *argv[1:], "--json"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, check=True).stdout
    plan = json.loads(out)
    fitting = [row["layout"] for row in plan["rows"] if row.get("fits")]
    assert "TSP8" in fitting, f"{line}\n    fits {fitting or 'nothing'}"
    assert plan["paper"], "the example should print the paper's comparison"


def test_what_the_commands_write_is_ignored_by_git():
    # A new user who runs the README's commands and then `git status` should see their own changes only.
    written = {_demo_out()}
    for _, name, args in _steps():
        written.update(_reads_writes(name, args)[1])
    probes = [f"{path}/x" for path in sorted(written)]  # a file inside each folder (or beside a dataset prefix)
    out = subprocess.run(["git", "check-ignore", "--no-index", *probes], cwd=ROOT, capture_output=True, text=True)
    ignored = set(out.stdout.split())
    assert set(probes) <= ignored, f"not git-ignored: {sorted(set(probes) - ignored)}"
