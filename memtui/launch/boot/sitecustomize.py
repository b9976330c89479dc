"""The ``sitecustomize`` that ``memtui run`` puts first on PYTHONPATH: each Python process of the
command starts memtui's hook, then the user's own ``sitecustomize`` runs."""

# Python imports ``sitecustomize`` from ``sys.path`` while it starts, before the script's first
# line, in every interpreter the command starts (each rank of ``torchrun`` or ``accelerate
# launch`` too). This module imports only ``os`` and ``sys`` (loaded before it) until it knows the
# process is one to watch, and no failure of memtui's stops the script: it prints one line and the
# script runs as without memtui. Its directory is no package: it is found by its place on
# PYTHONPATH, and memtui's own code never imports it.
#
# A command may start interpreters memtui does not support (Python 2.7 to 3.9: a tool's own
# environment): this module parses in every one of them (no annotations, no f-strings), watches
# nothing there and says nothing, and still runs their own ``sitecustomize``.

import os
import sys

BOOT_DIR = os.path.dirname(os.path.abspath(__file__))

LAUNCHER_MODULES = frozenset(
    {
        "torch.distributed.run",
        "torch.distributed.launch",
        "accelerate.commands.launch",
        "accelerate.commands.accelerate_cli",
    }
)
"""``python -m`` launchers that start the ranks and run no training themselves."""

LAUNCHER_SCRIPTS = frozenset({"torchrun", "accelerate", "accelerate-launch"})
"""The same launchers' console scripts (the interpreter runs them as a script path)."""

COMPILE_WORKER = os.sep + os.path.join("torch", "_inductor", "compile_worker") + os.sep
"""torch.compile's worker pool runs ``python .../torch/_inductor/compile_worker/__main__.py``."""

OPTIONS_WITH_VALUE = frozenset({"--check-hash-based-pycs"})

SPAWN_CHILD = "from multiprocessing.spawn import"
"""The start of the program multiprocessing gives a spawn child (``spawn_main``)."""

SUPPORTED = (3, 10)
"""The oldest Python memtui runs in: an older interpreter the command starts is left alone."""


def entry_point(argv):
    """How the interpreter started with ``argv`` (``sys.orig_argv``) runs its program:
    ``("-c", code)``, ``("-m", module)``, ``("script", path)`` or ``("", "")`` (stdin, a REPL)."""
    words = iter(argv[1:])
    for word in words:
        if word == "-" or word == "--":
            return "", ""
        if not word.startswith("-"):
            return "script", word
        if word.startswith("--"):
            if word in OPTIONS_WITH_VALUE:
                next(words, None)
            continue
        for index, letter in enumerate(word[1:], 2):  # a cluster of short options: -uc CODE
            if letter in "cmWX":  # the option's value: the rest of the word, else the next word
                value = word[index:] or next(words, "")
                if letter in "cm":
                    return "-" + letter, value
                break
    return "", ""


def not_training(argv):
    """Why the interpreter started with ``argv`` runs no training of its own ("" when it may)."""
    # multiprocessing starts every interpreter it spawns (a spawn child, the forkserver, the
    # resource tracker) as `python -c "from multiprocessing.<module> import ..."`: the command
    # line says so before anything is imported. A spawn child may be a rank (the ranks
    # `torch.multiprocessing.spawn` starts) or a DataLoader's spawn worker: it is watched, and the
    # watch registers a run only where an optimizer steps or a DataLoader is iterated, never in a
    # loader worker. The forkserver and the resource tracker train nothing. A forked child runs
    # no start-up at all: it inherits its parent's state as it is.
    how, what = entry_point(argv)
    if how == "-c" and what.startswith("from multiprocessing.") and SPAWN_CHILD not in what:
        return "a multiprocessing helper"
    if how == "-m" and what in LAUNCHER_MODULES:
        return "a launcher"
    if how == "script":
        if os.path.basename(what) in LAUNCHER_SCRIPTS:
            return "a launcher"
        if COMPILE_WORKER in os.path.abspath(what):
            return "a compile worker"
    return ""


def switched_off(value):
    """``MEMTUI_DISABLE`` as the hook reads it: 1, true or yes switch memtui off."""
    return (value or "").strip().lower() in ("1", "true", "yes")


def warn(reason):
    """One line on stderr: memtui does not watch this process, and why."""
    reason = " ".join(reason.split())[:300]
    try:
        sys.stderr.write(
            "memtui: not watching this process (" + reason + "); the script runs as without "
            "memtui\n"
        )
        sys.stderr.flush()
    except BaseException:  # no stderr (closed, or None): the script still runs
        pass


def reason_of(error):
    """The failure in a few words: memtui missing from this interpreter, else the error."""
    if isinstance(error, ImportError) and error.name == "memtui":
        return "memtui is not installed for " + str(sys.executable)
    name = type(error).__name__
    return name + ": " + str(error) if str(error) else name


def activate():
    """Start watching this process with memtui's import hooks; any failure is one warning line."""
    try:
        from memtui.hooks.auto import activate as start_watching

        start_watching()
    except BaseException as error:  # even SystemExit or an interrupt: the script runs regardless
        warn(reason_of(error))


def run_user_sitecustomize():
    """Import the ``sitecustomize`` Python would have run without memtui (the next one on
    ``sys.path``), once, its own errors left to Python's start-up to report as usual."""
    ours = sys.modules.pop("sitecustomize", None)
    places = [i for i, entry in enumerate(sys.path) if os.path.abspath(entry or ".") == BOOT_DIR]
    for index in reversed(places):
        del sys.path[index]
    try:
        import sitecustomize  # noqa: F401  (the user's, found with this directory out of the search)
    except ImportError as error:
        if not _no_sitecustomize(error):
            raise
        if ours is not None:
            sys.modules["sitecustomize"] = ours
    finally:
        # back at its place (the user's module may have added entries): sys.path reads as started
        for index in places:
            sys.path.insert(min(index, len(sys.path)), BOOT_DIR)


def _no_sitecustomize(error):
    """Whether ``error`` says there is no other ``sitecustomize`` (not that one failed inside)."""
    name = getattr(error, "name", None)  # Python 3.3 on; older ones say it in the message only
    if name is not None:
        return name == "sitecustomize"
    return str(error).endswith("sitecustomize")


def main():
    """Watch this process unless it is switched off, runs no training or is a Python memtui
    does not support, then chain the user's."""
    if (
        sys.version_info >= SUPPORTED
        and not switched_off(os.environ.get("MEMTUI_DISABLE"))
        and not not_training(list(getattr(sys, "orig_argv", sys.argv)))
    ):
        activate()
    run_user_sitecustomize()


if __name__ == "sitecustomize":  # Python's start-up imports it by this name; a test by another
    main()
