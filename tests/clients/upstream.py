"""The third-party training scripts of the client corpus: their manifests, the git-ignored cache
that holds their upstream files, and the patched copies the tests run.

Each client is a directory ``tests/clients/<name>/`` with ``client.json`` (the upstream repository,
commit, paths, sha256 and license of each file) and the patches applied in order (``patches``:
``integration.patch`` holds memtui's lines, as the frameworks guide documents them). The upstream files are
not part of this repository: they live in ``tests/clients/upstream/<name>/<path>`` (or under
``$MEMTUI_CLIENTS_UPSTREAM``), filled by this module's command line::

    python -m tests.clients.upstream status
    python -m tests.clients.upstream fill nanogpt --from-git ~/src/nanoGPT/.git
    python -m tests.clients.upstream fill hf_run_clm --from-file run_clm.py

A file whose sha256 is not the manifest's is refused (the patches were written against it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

CLIENTS = Path(__file__).resolve().parent


@dataclass(frozen=True)
class UpstreamFile:
    """One file of a client's upstream repository."""

    path: str
    """Its path in the repository at the manifest's commit."""
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """What a client is: where its files come from, and what is done to them."""

    name: str
    repository: str
    commit: str
    license: str
    files: tuple[UpstreamFile, ...]
    entry: str
    """The script run (a file's base name: every file is copied flat into the run's directory)."""
    patches: tuple[str, ...]

    @classmethod
    def load(cls, name: str) -> Manifest:
        """The manifest in ``tests/clients/<name>/client.json``."""
        data = json.loads((CLIENTS / name / "client.json").read_text())
        return cls(
            name=name,
            repository=data["repository"],
            commit=data["commit"],
            license=data["license"],
            files=tuple(UpstreamFile(f["path"], f["sha256"]) for f in data["files"]),
            entry=data["entry"],
            patches=tuple(data["patches"]),
        )

    def fill_hint(self) -> str:
        """The command that fills the cache with this client's files."""
        command = f"python -m tests.clients.upstream fill {self.name}"
        hint = f"{command} --from-git <git dir of a clone of {self.repository}>"
        if len(self.files) == 1:
            hint += f", or {command} --from-file <{self.files[0].path} at that commit>"
        return f"{hint} (commit {self.commit})"


def names() -> list[str]:
    """Every client of the corpus."""
    return sorted(p.parent.name for p in CLIENTS.glob("*/client.json"))


def cache_root() -> Path:
    """Where the upstream files are kept (``$MEMTUI_CLIENTS_UPSTREAM``, else next to this file)."""
    return Path(os.environ.get("MEMTUI_CLIENTS_UPSTREAM") or CLIENTS / "upstream")


def cached(manifest: Manifest, file: UpstreamFile) -> Path:
    """The cache's copy of ``file``."""
    return cache_root() / manifest.name / file.path


def sha256_of(data: bytes) -> str:
    """The hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def missing(manifest: Manifest) -> str | None:
    """Why the client cannot run from the cache (None: every file is there, as the manifest says)."""
    for file in manifest.files:
        path = cached(manifest, file)
        if not path.is_file():
            return f"{path} is not there; fill it with: {manifest.fill_hint()}"
        if sha256_of(path.read_bytes()) != file.sha256:
            return (
                f"{path} is not {manifest.repository}@{manifest.commit[:12]}'s {file.path} (sha256 "
                f"differs); fill it again with: {manifest.fill_hint()}"
            )
    return None


def materialise(manifest: Manifest, into: Path) -> Path:
    """Copy the client's upstream files flat into ``into``, apply its patches there, and return
    the script to run (raises ``FileNotFoundError`` with ``missing``'s reason)."""
    reason = missing(manifest)
    if reason:
        raise FileNotFoundError(reason)
    into.mkdir(parents=True, exist_ok=True)
    for file in manifest.files:
        shutil.copyfile(cached(manifest, file), into / Path(file.path).name)
    for patch in manifest.patches:
        apply_patch((CLIENTS / manifest.name / patch).read_text(), into)
    return into / manifest.entry


HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def line_shifts(diff: str) -> dict[str, list[tuple[int, int]]]:
    """For each file a unified diff changes: (the line its hunk starts at in the file before it,
    the lines that hunk adds less those it removes), hunk by hunk."""
    shifts: dict[str, list[tuple[int, int]]] = {}
    name = ""
    for line in diff.splitlines():
        if line.startswith("+++ "):
            name = line[4:].strip().split("\t")[0].removeprefix("b/")
        match = HUNK.match(line)
        if match is not None:
            old, new = int(match.group(2) or 1), int(match.group(4) or 1)
            shifts.setdefault(name, []).append((int(match.group(1)), new - old))
    return shifts


def apply_patch(diff: str, root: Path, after: Sequence[str] = ()) -> None:
    """Apply a unified diff (``--- a/FILE`` / ``+++ b/FILE`` headers) to the files under ``root``,
    exactly: every context and removed line must be where the hunk says (no fuzz, no offset),
    ``after`` the diffs already applied to the same upstream files (a hunk of this one moves by
    the lines theirs added or removed above it)."""
    applied = [line_shifts(earlier) for earlier in after]
    lines = diff.splitlines(keepends=True)
    index = 0
    while index < len(lines):
        if not lines[index].startswith("--- "):
            index += 1
            continue
        name = lines[index + 1][4:].strip().split("\t")[0].removeprefix("b/")
        target = root / name
        index += 2
        original = target.read_text().splitlines(keepends=True)
        result: list[str] = []
        consumed = 0
        while index < len(lines) and lines[index].startswith("@@"):
            match = HUNK.match(lines[index])
            if match is None:
                raise ValueError(f"bad hunk header: {lines[index]!r}")
            start = int(match.group(1)) - 1 if match.group(2) != "0" else int(match.group(1))
            start += sum(
                delta
                for shifts in applied
                for at, delta in shifts.get(name, [])
                if at <= int(match.group(1))
            )
            result += original[consumed:start]
            consumed = start
            index += 1
            while index < len(lines) and lines[index][:1] in (" ", "-", "+", "\\"):
                tag, text = lines[index][:1], lines[index][1:]
                index += 1
                if tag == "\\":  # "\ No newline at end of file"
                    continue
                if tag in (" ", "-"):
                    if consumed >= len(original) or original[consumed] != text:
                        raise ValueError(
                            f"{target.name}:{consumed + 1}: the patch expects {text!r}, the file "
                            f"has {original[consumed] if consumed < len(original) else 'its end'!r}"
                        )
                    consumed += 1
                if tag in (" ", "+"):
                    result.append(text)
        result += original[consumed:]
        target.write_text("".join(result))


def fill(manifest: Manifest, from_git: str | None, from_file: str | None) -> list[Path]:
    """Put the client's files into the cache, from a git directory (``git show COMMIT:PATH``) or,
    for a client of one file, from a local copy; refuse any whose sha256 is not the manifest's."""
    written = []
    for file in manifest.files:
        if from_git:
            data = subprocess.run(
                ["git", "--git-dir", from_git, "show", f"{manifest.commit}:{file.path}"],
                check=True,
                capture_output=True,
            ).stdout
        elif from_file and len(manifest.files) == 1:
            data = Path(from_file).read_bytes()
        else:
            raise SystemExit(f"{manifest.name} has {len(manifest.files)} files: use --from-git")
        digest = sha256_of(data)
        if digest != file.sha256:
            raise SystemExit(
                f"{manifest.name}: {file.path} has sha256 {digest}, the manifest says {file.sha256}"
            )
        path = cached(manifest, file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    """``status``: each client's cache state; ``fill NAME``: fill the cache for one client."""
    parser = argparse.ArgumentParser(prog="python -m tests.clients.upstream")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("status", help="whether each client's upstream files are in the cache")
    filling = commands.add_parser("fill", help="put a client's upstream files into the cache")
    filling.add_argument("name", choices=names())
    source = filling.add_mutually_exclusive_group(required=True)
    source.add_argument("--from-git", metavar="DIR", help="a clone's or a mirror's git directory")
    source.add_argument("--from-file", metavar="FILE", help="a local copy (a client of one file)")
    args = parser.parse_args(argv)
    if args.command == "status":
        for name in names():
            manifest = Manifest.load(name)
            print(f"{name}: {missing(manifest) or 'ready'}")
        return 0
    for path in fill(Manifest.load(args.name), args.from_git, args.from_file):
        print(f"filled {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
