"""The documentation as written: every shell and Python block of the README and of ``docs/`` is run
by a test or says why not, every ``memtui`` and ``make`` line is one that the command line and the
Makefile accept, the reference tables are the code's, and every relative link resolves."""

# A block's mark is the HTML comment on the line right above its fence (hidden on GitHub and on
# the site, read here):
#   <!-- example: NAME -->     a Python block a test runs (EXAMPLES names which);
#   <!-- run: demo -->         every `memtui` line runs against a live demo training (a text
#                              block: `$ memtui status` and the first words of what it prints);
#   <!-- run: output -->       a text block, `$ COMMAND` and its output, compared line for line;
#   <!-- run: no-gpu -->       run by bash: without a GPU it stops before what follows `&&`;
#   <!-- not run: REASON -->   left out, with the reason.
# An unmarked shell block runs line by line: a `memtui` line is parsed by the command line itself
# (those that need no run and open no window also run), a `make` line must name a target, any
# other line runs in bash from the repository's root and must succeed. Unmarked YAML and INI
# blocks are parsed (a `verdict:` section by memtui's own loader); text blocks are outputs.

from __future__ import annotations

import configparser
import dataclasses
import functools
import json
import os
import re
import shlex
import subprocess
import sys
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
import yaml

from tests.support.cli import memtui_here
from tests.support.clock import patience
from tests.support.processes import ROOT

PAGES = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")))
"""The README and every page of the documentation site."""

EXAMPLES = {
    "plain-loop": "tests/integration/test_readme.py::test_plain_loop_example",
    "no-dataloader": "tests/integration/test_readme.py::test_no_dataloader_example_times_batches_and_follows_a_batch_change",
    "add-to-loop": "tests/integration/test_readme.py::test_the_short_loop_and_the_guard_take_a_change_and_roll_one_back",
    "guard": "tests/integration/test_readme.py::test_the_short_loop_and_the_guard_take_a_change_and_roll_one_back",
    "tracker": "tests/integration/test_tracker.py::test_events_reach_tensorboard_and_a_raising_callback_is_an_error",
}
"""Each Python example of the documentation and the test that runs it."""

RUNS = {
    "demo": "tests/integration/test_readme.py::test_command_lines_run_against_a_demo",
    "output": "tests/integration/test_docs.py::test_output_blocks_are_what_the_command_prints",
    "no-gpu": "tests/integration/test_docs.py::test_gpu_pick_line_stops_where_no_gpu_is_picked",
}
"""Each ``run:`` mark and the test that runs its blocks."""

SHELLS = {"sh", "bash", "shell", "console"}
VIEWERS = {"attach", "replay", "demo"}
"""Commands that open the viewer or start a training: parsed, never run by the line runner."""
STANDALONE = {"ls", "keygen", "estimate"}
"""Commands that need no run and open no window: an unmarked line of them runs as written."""


# --------------------------------------------------------------------------- reading the pages


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page, with the mark above it."""

    page: str
    line: int
    lang: str
    mark: str
    body: str

    @property
    def where(self) -> str:
        """``page:line`` of the opening fence."""
        return f"{self.page}:{self.line}"

    @property
    def kind(self) -> str:
        """``example``, ``run``, ``not run`` or ``""`` (unmarked)."""
        return self.mark.split(":", 1)[0].strip() if ":" in self.mark else ""

    @property
    def value(self) -> str:
        """What follows the mark's kind: the example's name, the run's kind, the reason."""
        return self.mark.split(":", 1)[1].strip() if ":" in self.mark else ""


FENCE = re.compile(r"^([ \t]*)```([\w+-]*)[^\n]*\n(.*?)^\1```[ \t]*$", re.M | re.S)
MARK = re.compile(r"^\s*<!--\s*(.*?)\s*-->\s*$")


def page_text(page: str) -> str:
    """A page's Markdown."""
    return (ROOT / page).read_text()


@functools.cache
def blocks() -> tuple[Block, ...]:
    """Every fenced block of every page, in page order."""
    found = []
    for page in PAGES:
        text = page_text(page)
        for match in FENCE.finditer(text):
            before = text[: match.start()].rstrip("\n").splitlines()
            mark = MARK.match(before[-1]) if before else None
            indent = match.group(1)
            body = "".join(line.removeprefix(indent) for line in match.group(3).splitlines(True))
            line = text.count("\n", 0, match.start()) + 1
            found.append(Block(page, line, match.group(2), mark.group(1) if mark else "", body))
    return tuple(found)


def example(name: str) -> str:
    """The Python block marked ``<!-- example: NAME -->`` (every copy of it the same)."""
    copies = [b for b in blocks() if b.kind == "example" and b.value == name]
    assert copies, f"no page has the {name} example"
    assert all(b.lang == "python" for b in copies), [b.where for b in copies]
    assert len({b.body for b in copies}) == 1, f"the copies differ: {[b.where for b in copies]}"
    return copies[0].body


def run_blocks(kind: str) -> list[Block]:
    """The blocks marked ``<!-- run: KIND -->``, in page order."""
    return [b for b in blocks() if b.kind == "run" and b.value == kind]


def shell_lines(block: Block) -> list[tuple[str, str]]:
    """(command, comment) for each command of a shell block, or each ``$ `` line of a text one."""
    found = []
    for line in block.body.splitlines():
        if block.lang not in SHELLS:
            if not line.startswith("$ "):
                continue
            line = line[2:]
        command, _, comment = line.partition("  #")
        if command.strip() and not command.lstrip().startswith("#"):
            found.append((command.strip(), comment.strip()))
    return found


def prose(page: str) -> str:
    """A page without its code blocks and HTML comments (what inline spans and links live in)."""
    text = FENCE.sub("", page_text(page))
    return re.sub(r"<!--.*?-->", "", text, flags=re.S)


def inline_code(page: str) -> list[str]:
    """The inline code spans of a page's prose."""
    return re.findall(r"(?<!`)`([^`\n]+)`(?!`)", prose(page))


def memtui_lines() -> list[tuple[Block, str]]:
    """Every ``memtui`` command of every shell block (not the ``not run`` ones) and text block."""
    return [
        (block, command)
        for block in blocks()
        if block.kind != "not run" and (block.lang in SHELLS or block.lang == "text")
        for command, _ in shell_lines(block)
        if command.startswith("memtui ")
    ]


def words_of(command: str) -> list[str]:
    """A command line's words up to a redirection, a pipe or a second command."""
    words = []
    for word in shlex.split(command, comments=True):
        if re.match(r"\d*[<>|&;]", word):  # 2>err.log, > file, | tee, && ...
            break
        words.append(word)
    return words


# --------------------------------------------------------------------------- the command line


def command_of(name: str) -> click.Command:
    """The ``memtui NAME`` click command (the test fails if there is none)."""
    from memtui.cli import main

    command = main.commands.get(name)
    assert command is not None, f"memtui has no command {name!r}"
    return command


def option_names(name: str) -> set[str]:
    """The options ``memtui NAME`` accepts (``demo``: its own and its training's)."""
    command = command_of(name)
    names = {o for p in command.params for o in (*p.opts, *p.secondary_opts)} | {"--help", "-h"}
    if name == "demo":
        from memtui.demo.options import build_parser

        # argparse lists a parser's actions only through _actions (no public accessor)
        names |= {o for a in build_parser()._actions for o in a.option_strings}
    return names


def parse(command: str) -> None:
    """Parse a ``memtui`` line as the command line would, running nothing."""
    from memtui.cli import main

    words = words_of(command)[1:]
    assert words, command
    if words[0].startswith("-"):
        main.make_context("memtui", words)
        return
    sub = command_of(words[0])
    with click.Context(main, info_name="memtui") as parent:
        sub.make_context(words[0], words[1:], parent=parent)
    if words[0] == "demo":
        from memtui.demo.options import parse_args

        parse_args(training_words(words[1:]))


def training_words(words: list[str]) -> list[str]:
    """The words of a ``memtui demo`` line that go to the training (its own options left out)."""
    own = {
        o: isinstance(p, click.Option) and p.is_flag
        for p in command_of("demo").params
        for o in (*p.opts, *p.secondary_opts)
    }
    passed, skip = [], 0
    for word in words:
        if skip:
            skip -= 1
        elif word.split("=", 1)[0] in own:
            skip = 0 if own[word.split("=", 1)[0]] or "=" in word else 1
        else:
            passed.append(word)
    return passed


def test_every_block_is_run_or_says_why_not() -> None:
    """Each block has a language; a Python block is an example a test runs or says why not; a
    mark names a known kind of run, example or reason."""
    wrong = []
    for block in blocks():
        if not block.lang:
            wrong.append(f"{block.where}: no language on the fence")
        elif block.kind == "example" and block.value not in EXAMPLES:
            wrong.append(f"{block.where}: example {block.value!r} is run by no test (EXAMPLES)")
        elif block.kind == "run" and block.value not in RUNS:
            wrong.append(f"{block.where}: no test runs {block.mark!r} (RUNS)")
        elif block.kind == "not run" and len(block.value) < 10:
            wrong.append(f"{block.where}: 'not run' needs its reason")
        elif block.kind not in {"example", "run", "not run", ""}:
            wrong.append(f"{block.where}: unknown mark {block.mark!r}")
        elif block.lang == "python" and block.kind not in {"example", "not run"}:
            wrong.append(f"{block.where}: a Python block must be an example or say why not")
    assert not wrong, "\n".join(wrong)
    marked = {b.value for b in blocks() if b.kind == "example"}
    assert marked == set(EXAMPLES), f"examples no page has: {set(EXAMPLES) - marked}"
    for test in {*EXAMPLES.values(), *RUNS.values()}:
        path, name = test.split("::")
        assert f"\ndef {name}(" in (ROOT / path).read_text(), f"{test} does not exist"


def test_every_memtui_line_is_one_the_command_line_accepts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each ``memtui`` line of a shell block, and each ``$ memtui`` line of a text block, parses
    (its command, options, arguments and choices; a replayed file exists)."""
    monkeypatch.chdir(ROOT)
    lines = memtui_lines()
    assert len(lines) > 20, lines
    wrong = []
    for block, command in lines:
        try:
            parse(command)
        except (click.ClickException, SystemExit, AssertionError) as exc:
            shown = exc.format_message() if isinstance(exc, click.ClickException) else exc
            wrong.append(f"{block.where}: {command}: {shown}")
    assert not wrong, "\n".join(wrong)


def test_unmarked_lines_that_need_no_run_run_as_written(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The ``ls``, ``keygen`` and ``estimate`` lines and ``export --dashboard`` of unmarked shell
    blocks run (by click, in this process) and exit 0; the dashboard is JSON."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("MEMTUI_KEYS", str(tmp_path / "curve"))
    ran = []
    for block, command in memtui_lines():
        words = words_of(command)
        if block.kind or block.lang not in SHELLS:
            continue
        if words[1] in STANDALONE or words[1:] == ["export", "--dashboard"]:
            result = memtui_here(*words[1:])
            assert result.exit_code == 0, f"{block.where}: {command}: {result.output}"
            if words[1] == "export":
                assert json.loads(result.stdout)["panels"], command
            ran.append(words[1])
    assert {"keygen", "export"} <= set(ran), ran


def test_other_shell_lines_run_from_the_repository(tmp_path: Path) -> None:
    """An unmarked shell line that is neither ``memtui`` nor ``make`` runs in bash from the
    repository's root (the venv's commands first on PATH) and succeeds."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    for block in blocks():
        if block.kind or block.lang not in SHELLS:
            continue
        for command, _ in shell_lines(block):
            if command.startswith(("memtui ", "make ")) or command == "make":
                continue
            result = subprocess.run(
                ["bash", "-c", command],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=patience(120),
            )
            assert result.returncode == 0, f"{block.where}: {command}\n{result.stderr}"


def makefile_targets() -> set[str]:
    """The targets the Makefile defines."""
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*):(?!=)", text, re.M))


def test_every_make_line_names_a_target() -> None:
    """``make X`` in a block or inline names a target of the Makefile."""
    targets = makefile_targets()
    named = [
        (block.where, words_of(command)[1])
        for block in blocks()
        if block.lang in SHELLS
        for command, _ in shell_lines(block)
        if command.startswith("make ")
    ]
    named += [
        (page, span.split()[1])
        for page in PAGES
        for span in inline_code(page)
        if span.startswith("make ") and len(span.split()) > 1
    ]
    assert {"demo", "docs"} <= {target for _, target in named}, named
    wrong = [f"{where}: make {target}" for where, target in named if target not in targets]
    assert not wrong, "\n".join(wrong)


def test_every_inline_memtui_command_names_real_options() -> None:
    """A ``memtui X ...`` span in the prose (a synopsis or a command) names a command memtui has
    and only options that command takes."""
    wrong = []
    spans = [(p, s) for p in PAGES for s in inline_code(p) if re.match(r"memtui [a-z]", s)]
    assert len(spans) > 50, spans
    for page, span in spans:
        name = span.split()[1]
        from memtui.cli import main

        if name not in main.commands:
            wrong.append(f"{page}: `{span}`: no command {name!r}")
            continue
        known = option_names(name)
        wrong += [
            f"{page}: `{span}`: {option} is not an option of memtui {name}"
            for option in re.findall(r"(?<![\w-])--?[a-z][a-z-]*", span)
            if option not in known
        ]
    assert not wrong, "\n".join(wrong)


def demo_commands() -> list[tuple[str, str]]:
    """(where, command) for every ``memtui demo ...`` of the pages, inline or in a block."""
    found = [(b.where, c) for b, c in memtui_lines() if c.startswith("memtui demo")]
    for page in PAGES:
        found += [(page, s) for s in inline_code(page) if s.startswith("memtui demo")]
    return found


def test_every_memtui_demo_command_is_accepted() -> None:
    """Each ``memtui demo`` command of the pages is accepted as written (``--dry-run``: nothing
    starts), and passes its training options through unchanged; a synopsis's options exist."""
    from click.testing import CliRunner

    from memtui.cli import main

    commands = demo_commands()
    assert any("--memory-limit" in c for _, c in commands), commands
    for where, command in commands:
        words = words_of(command)[2:]
        if "[" in command or "..." in command or any(w.isupper() for w in words):
            continue  # a synopsis: test_every_inline_memtui_command_names_real_options
        result = CliRunner().invoke(main, ["demo", *words, "--dry-run"])
        assert result.exit_code == 0, f"{where}: {command}: {result.output}"
        if "--help" not in words:  # the training command, with the options passed through
            ran = shlex.split(result.output)
            assert ran[ran.index("memtui.demo") + 1 :] == training_words(words), (where, ran)


def test_every_replayed_recording_opens_whole() -> None:
    """Each ``memtui replay FILE`` of the pages names a recording of this repository that the
    replay source opens whole (the viewer's replay tests play the same files)."""
    from memtui.transport.sources import ReplaySource

    lines = [c for _, c in memtui_lines() if c.startswith("memtui replay")]
    lines += [s for p in PAGES for s in inline_code(p) if s.startswith("memtui replay tests/")]
    assert lines
    for line in lines:
        source = ReplaySource(str(ROOT / words_of(line)[2]))
        assert source.recording.frames and not source.recording.cut_note, line


def test_output_blocks_are_what_the_command_prints(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``run: output`` block's ``$ COMMAND`` prints its lines exactly (``memtui gpus``'s
    message where no NVIDIA driver is loaded)."""
    from memtui.planning.gpus import NoDriver, load_nvml

    monkeypatch.chdir(ROOT)
    compared = 0
    for block in run_blocks("output"):
        first, *expected = block.body.rstrip("\n").splitlines()
        assert first.startswith("$ memtui "), block.where
        words = words_of(first[2:])
        if words[1] == "gpus":
            try:
                load_nvml()
                continue  # a driver answers: the table is this host's
            except NoDriver:
                pass
        result = memtui_here(*words[1:])
        assert result.output.rstrip("\n").splitlines() == expected, (
            f"{block.where}:\n{result.output}"
        )
        compared += 1
    assert compared, "no output block was compared"


def test_gpu_pick_line_stops_where_no_gpu_is_picked(tmp_path: Path) -> None:
    """The ``gpus --pick`` form, run by bash as written: without a GPU to pick it stops with the
    reason and never starts the training with an empty device list."""
    from memtui.planning.gpus import NoDriver, load_nvml

    try:
        load_nvml()
        pytest.skip("this host has an NVIDIA driver: the pick would succeed")
    except NoDriver:
        pass
    (block,) = run_blocks("no-gpu")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    result = subprocess.run(
        ["bash", "-c", block.body],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=patience(60),
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.startswith("memtui: no NVIDIA driver") and "train.py" not in result.stderr


# --------------------------------------------------------------------------- config and tables


def test_config_blocks_are_what_memtui_reads(tmp_path: Path) -> None:
    """A YAML block with a ``verdict:`` section is read by memtui's own loader without one
    complaint (a complete one holds the defaults); other YAML and INI blocks parse."""
    from memtui.advice.verdict import THRESHOLDS
    from memtui.storage.userconfig import load_thresholds

    checked = 0
    for block in blocks():
        if block.kind == "not run":
            continue
        if block.lang == "yaml":
            data = yaml.safe_load(block.body)
            if "verdict" in data:
                path = tmp_path / f"config{checked}.yaml"
                path.write_text(block.body)
                loaded = load_thresholds(path)
                assert loaded.problems == (), (block.where, loaded.problems)
                if len(data["verdict"]) == len(dataclasses.fields(THRESHOLDS)):
                    assert loaded.thresholds == THRESHOLDS, block.where
            checked += 1
        elif block.lang == "ini":
            configparser.ConfigParser(interpolation=None).read_string(block.body)
            checked += 1
    assert checked >= 3, checked


def table_rows(page: str, first_header: str) -> list[list[str]]:
    """The rows of the table whose first column is headed ``first_header``, cells stripped."""
    lines = page_text(page).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return rows


def test_environment_table_names_every_variable_the_code_reads() -> None:
    """The reference's variable table is every ``MEMTUI_*`` name of the package's code."""
    in_code = {
        name
        for path in (ROOT / "memtui").rglob("*.py")
        for name in re.findall(r"\bMEMTUI_[A-Z0-9_]+\b", path.read_text())
    }
    table = {row[0].strip("`") for row in table_rows("docs/reference/environment.md", "variable")}
    assert table == in_code, (sorted(in_code - table), sorted(table - in_code))


def test_config_key_table_is_the_thresholds_with_their_defaults() -> None:
    """The reference's config file table lists every threshold, with its default."""
    from memtui.advice.verdict import THRESHOLDS

    rows = table_rows("docs/reference/environment.md", "key")
    shown = {row[0].strip("`").removeprefix("verdict."): row[2].split()[0] for row in rows}
    defaults = {f.name: getattr(THRESHOLDS, f.name) for f in dataclasses.fields(THRESHOLDS)}
    assert set(shown) == set(defaults), (set(shown), set(defaults))
    assert {k: float(v) for k, v in shown.items()} == {k: float(v) for k, v in defaults.items()}


# --------------------------------------------------------------------------- links


def slug(heading: str) -> str:
    """A heading's anchor as the site makes it (Python-Markdown's toc), which GitHub's matches
    for the headings linked to here."""
    text = re.sub(r"\s*\{#[^}]*\}\s*$", "", heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text).replace("`", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: str) -> set[str]:
    """The anchors a page has: its headings' and explicit ``{#id}``s."""
    found = set()
    for heading in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", page_text(page)), re.M):
        found.add(slug(heading))
        found.update(re.findall(r"\{#([\w-]+)\}", heading))
    return found


def links(page: str) -> list[str]:
    """The targets of a page's Markdown links and images, outside code."""
    text = re.sub(r"`[^`\n]*`", "", prose(page))
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)


def test_every_relative_link_resolves() -> None:
    """Each relative link of the README and the site's pages names a file of the repository, and
    an anchor into a page names one of its headings."""
    wrong = []
    count = 0
    for page in PAGES:
        for target in links(page):
            if re.match(r"[a-z]+:", target) or target.startswith("/"):
                continue
            count += 1
            path, _, anchor = target.partition("#")
            resolved = (ROOT / page).parent / path if path else ROOT / page
            try:
                name = str(resolved.resolve().relative_to(ROOT))
            except ValueError:
                wrong.append(f"{page}: {target}: outside the repository")
                continue
            if not resolved.is_file():
                wrong.append(f"{page}: {target}: no such file")
            elif anchor and name.endswith(".md") and anchor not in anchors(name):
                wrong.append(f"{page}: {target}: {name} has no heading #{anchor}")
    assert count > 100, count
    assert not wrong, "\n".join(wrong)


# --------------------------------------------------------------------------- the front page


def test_the_readme_is_a_front_page() -> None:
    """At most 300 lines; a screenshot within its first 30; the short loop before any longer
    Python; a table of commands; links into every part of the documentation."""
    text = page_text("README.md")
    lines = text.splitlines()
    assert len(lines) <= 300, len(lines)
    assert any(re.search(r"!\[[^\]]*\]\(screenshots/[\w-]+\.svg\)", line) for line in lines[:30])
    python = [b for b in blocks() if b.page == "README.md" and b.lang == "python"]
    assert python and python[0].value == "add-to-loop", [b.where for b in python]
    assert all(len(b.body.splitlines()) <= 12 for b in python), [b.where for b in python]
    assert "| command | what it does |" in text
    linked = {target.partition("#")[0] for target in links("README.md")}
    for part in ("getting-started.md", "guides/", "reference/", "explanation/", "troubleshooting"):
        assert any(part in target for target in linked), part


# --------------------------------------------------------------------------- generated pages

GENERATED = re.compile(r"^(<!-- (cli-reference|status-json-schema) -->|::: \S+)$", re.M)
"""A mark a reference page's tables are generated at when the site is built."""
PYTHON_VALUE = re.compile(
    r"Sentinel\.|\bUNSET\b|NODEFAULT|object at 0x[0-9a-f]+"
    r"|(<|&lt;)(class|function|bound method|built-in|enum|module) "
)
"""A Python value's repr where the reader should see words (a click sentinel, an object)."""


def docs_hooks() -> object:
    """``docs/hooks.py``, the site's generators, imported as a module (it needs no mkdocs)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("memtui_docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_pages_say_where_their_tables_are() -> None:
    """A page whose tables are generated says, in its prose, where the built page is (on GitHub
    it shows only the marks), and the README's promise that the pages read on GitHub as they
    are names each such page as the exception."""
    generated = [page for page in PAGES if GENERATED.search(page_text(page))]
    assert {"docs/reference/cli.md", "docs/reference/hooks.md"} <= set(generated), generated
    readme = links("README.md")
    for page in generated:
        built = "build/site/" + page.removeprefix("docs/").removesuffix(".md") + ".html"
        words = " ".join(prose(page).split())
        assert "On GitHub" in words and "make docs" in words and built in words, page
        assert page in readme, f"the README does not name {page} among the generated pages"


def test_the_cli_reference_shows_every_option_as_help_does() -> None:
    """The command line reference's Markdown: every command, every option with the default
    ``--help`` prints (never a Python value), and the demo's training options, each of them."""
    from click.testing import CliRunner

    from memtui.cli import main
    from memtui.demo.options import option_rows

    reference = docs_hooks().cli_reference()  # type: ignore[attr-defined]
    assert not PYTHON_VALUE.search(reference), PYTHON_VALUE.search(reference)
    for name in main.commands:
        assert f"### memtui {name} {{#memtui-{name}}}" in reference, name
    assert (
        "| `--ranks INTEGER` | Processes under torchrun (gloo on CPU, nccl on GPUs). [default: 1] |"
        in reference
    )
    demo = reference.split("### memtui demo ", 1)[1].split("\n### ", 1)[0]
    for names, _ in option_rows():
        assert f"| `{names}` |" in demo, names
    shown = CliRunner().invoke(main, ["demo", "--help"]).output
    assert all(names in shown for names, _ in option_rows())


def test_the_status_schema_shows_no_python_value() -> None:
    """The ``memtui status --json`` schema's Markdown names JSON types and values, not Python's."""
    schema = docs_hooks().status_schema()  # type: ignore[attr-defined]
    assert "| `verdict` |" in schema and not PYTHON_VALUE.search(schema), PYTHON_VALUE.search(
        schema
    )


def test_the_built_site_shows_no_python_value(tmp_path: Path) -> None:
    """The site as ``make docs`` builds it (strict): no page shows a Python value's repr (a
    click sentinel as an option's default, an object), and the demo's training options are on
    the command line page."""
    import importlib.util
    import shutil

    if importlib.util.find_spec("mkdocs") is not None:
        mkdocs = [sys.executable, "-m", "mkdocs"]
    elif shutil.which("mkdocs"):  # another environment's, on PATH
        mkdocs = [str(shutil.which("mkdocs"))]
    else:
        pytest.skip('mkdocs is not installed (pip install -e ".[docs]"): the site is not built')
    site = tmp_path / "site"
    built = subprocess.run(
        [*mkdocs, "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
        capture_output=True,
        text=True,
        timeout=patience(600),
    )
    assert built.returncode == 0, built.stderr
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 20, pages
    wrong = [
        f"{page.relative_to(site)}: {found.group(0)}"
        for page in pages
        for found in PYTHON_VALUE.finditer(page.read_text(encoding="utf-8"))
    ]
    assert not wrong, "\n".join(wrong)
    cli = (site / "reference" / "cli.html").read_text(encoding="utf-8")
    assert "--checkpoint-every K" in cli and "--out DIR" in cli


# --------------------------------------------------------------------------- the frameworks

FRAMEWORKS_PAGE = "docs/guides/frameworks.md"
RESTARTS = {
    "Hugging Face Trainer": ("resume_from_checkpoint=", "memtui_state.json"),
    "Lightning": ("ckpt_path=", "`memtui` key"),
    "Accelerate": ("load_state(", "memtui_state_<i>.json"),
}
"""Each framework's section: the call its restart resumes with, and where memtui's place is."""
VERSIONS = re.compile(
    r"The test suite runs transformers (\d+\.\d+), accelerate (\d+\.\d+) and Lightning (\d+\.\d+)"
)
A_VERSION = re.compile(r"\b(?:transformers|[Aa]ccelerate|[Ll]ightning) \d+\.\d+")


def page_section(page: str, heading: str) -> str:
    """A page's ``## heading`` section, up to the next ``## `` heading."""
    text = page_text(page)
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def test_every_framework_section_has_its_restart_lines() -> None:
    """Each framework's section shows its restart in code: ``resume=True`` and the framework's
    own resume (Accelerate's with the ``state_dir=`` it needs), and says where memtui's place is."""
    for heading, (resume, place) in RESTARTS.items():
        section = page_section(FRAMEWORKS_PAGE, heading)
        restarts = [
            b.body
            for b in blocks()
            if b.page == FRAMEWORKS_PAGE and b.lang == "python" and b.body in section
            if "resume=True" in b.body and resume in b.body
        ]
        assert restarts, f"{heading}: no restart lines (resume=True and {resume})"
        assert place in section, f"{heading}: where memtui's place is ({place})"
        if heading == "Accelerate":
            assert "state_dir=" in restarts[0], restarts[0]


def test_the_framework_versions_are_said_once_and_are_those_installed() -> None:
    """The versions the suite runs are said in one sentence of the frameworks guide, no other
    page gives a framework a version, each is in the ``frameworks`` extra's range, and each
    installed framework is that version."""
    import importlib.metadata

    from packaging.requirements import Requirement
    from packaging.version import Version

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        from pip._vendor import tomli as tomllib

    found = VERSIONS.search(" ".join(page_text(FRAMEWORKS_PAGE).split()))
    assert found, "the frameworks guide does not say the versions the suite runs"
    stated = dict(zip(("transformers", "accelerate", "lightning"), found.groups(), strict=True))
    said = [(p, m) for p in PAGES for m in A_VERSION.findall(" ".join(prose(p).split()))]
    assert len(said) == 3, said
    with open(ROOT / "pyproject.toml", "rb") as file:
        extra = tomllib.load(file)["project"]["optional-dependencies"]["frameworks"]
    ranges = {r.name: r.specifier for r in map(Requirement, extra)}
    for name, version in stated.items():
        assert Version(version) in ranges[name], (name, version, ranges[name])
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        assert ".".join(installed.split(".")[:2]) == version, (name, installed, version)
