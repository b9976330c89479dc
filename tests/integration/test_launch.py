"""``memtui run -- COMMAND``: the command runs as itself (exit status, signals, output), and its
Python processes start memtui's hook, the user's own start-up modules still run once, and the
processes that run no training (multiprocessing's children, launchers) are left alone."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

from memtui.launch.run import BOOT_DIR, command_environment, unwatched_python
from tests.support.clock import patience

WARNING = "memtui: not watching this process ("
ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from memtui.cli import main; main()"
"""``memtui`` from this checkout, for an interpreter started with ``-E``."""

STAND_IN = '''
"""A stand-in for the hook's activate(): logs each call (pid and command line) or fails."""
import os, sys

def activate():
    failure = os.environ.get("STAND_IN_FAILS")
    if failure == "error":
        raise RuntimeError("the hook failed")
    if failure == "exit":
        raise SystemExit(4)
    with open(os.environ["STAND_IN_LOG"], "a") as log:
        log.write(f"{os.getpid()} {sys.orig_argv[1:]}\\n")
'''


def boot_module() -> ModuleType:
    """The start-up module loaded under another name, so that it only defines its functions."""
    spec = importlib.util.spec_from_file_location("memtui_boot", Path(BOOT_DIR, "sitecustomize.py"))
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Launch:
    """Runs commands under ``memtui run`` in a scratch directory, with a stand-in hook."""

    def __init__(self, tmp_path: Path) -> None:
        self.dir = tmp_path
        self.log = tmp_path / "activations.log"
        self.log.touch()
        stand_in = tmp_path / "stand_in" / "memtui" / "hooks"
        stand_in.mkdir(parents=True)
        (stand_in.parent / "__init__.py").write_text("")
        (stand_in / "__init__.py").write_text("")
        (stand_in / "auto.py").write_text(STAND_IN)
        self.user_path = [str(tmp_path / "stand_in")]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMTUI_", "PYTHON"))}
        self.env.update(
            PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            STAND_IN_LOG=str(self.log),
            MEMTUI_RUNTIME_DIR=str(tmp_path / "runtime"),
        )

    def script(self, name: str, body: str) -> Path:
        path = self.dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(body))
        return path

    def environment(self, **extra: str) -> dict[str, str]:
        return {**self.env, "PYTHONPATH": os.pathsep.join(self.user_path), **extra}

    def memtui_run(self, *command: str | Path) -> list[str]:
        # -E: the launcher itself ignores PYTHONPATH (the stand-in is for the command's
        # interpreters); it passes the environment on to the command as it found it. It is this
        # checkout's memtui, wherever the interpreter's own installation points
        return [sys.executable, "-E", "-c", LAUNCHER, "run", "--", *map(str, command)]

    def run(
        self, *command: str | Path, memtui: bool = True, **extra: str
    ) -> subprocess.CompletedProcess[str]:
        argv = self.memtui_run(*command) if memtui else [*map(str, command)]
        return subprocess.run(
            argv,
            env=self.environment(**extra),
            cwd=self.dir,
            capture_output=True,
            text=True,
            timeout=patience(120),
        )

    def activations(self) -> list[str]:
        return self.log.read_text().splitlines()


@pytest.fixture
def launch(tmp_path: Path) -> Launch:
    return Launch(tmp_path)


PYTHON = "python"  # the venv's, first on PATH as in a user's shell


# ------------------------------------------------------------------ the command is the process


def test_exit_status_stdout_and_stderr_are_the_commands_own(launch: Launch) -> None:
    """A script that prints on both streams and exits 3: the same under memtui as without it."""
    script = launch.script(
        "train.py",
        """\
        import sys
        print("out line")
        print("err line", file=sys.stderr)
        sys.exit(3)
        """,
    )
    watched, plain = launch.run(PYTHON, script), launch.run(PYTHON, script, memtui=False)
    assert (watched.returncode, watched.stdout, watched.stderr) == (3, "out line\n", "err line\n")
    assert (plain.returncode, plain.stdout, plain.stderr) == (3, "out line\n", "err line\n")
    assert len(launch.activations()) == 1, "the plain run started no hook, the launched one did"


@pytest.mark.parametrize(
    ("sent", "handled"),
    [(signal.SIGTERM, "SIGTERM handled"), (signal.SIGINT, "KeyboardInterrupt handled")],
)
def test_a_signal_to_memtui_run_reaches_the_script(
    launch: Launch, sent: signal.Signals, handled: str
) -> None:
    """``memtui run``'s pid is the script's: SIGTERM and Ctrl-C's SIGINT reach its handlers."""
    script = launch.script(
        "serve.py",
        """\
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: (print("SIGTERM handled"), sys.exit(7)))
        try:
            print(os.getpid(), flush=True)
            time.sleep(60)
        except KeyboardInterrupt:
            print("KeyboardInterrupt handled")
            sys.exit(8)
        """,
    )
    with subprocess.Popen(
        launch.memtui_run(PYTHON, script),
        env=launch.environment(),
        cwd=launch.dir,
        stdout=subprocess.PIPE,
        text=True,
    ) as process:
        assert process.stdout is not None
        assert int(process.stdout.readline()) == process.pid, "the command replaced memtui run"
        process.send_signal(sent)
        rest, _ = process.communicate(timeout=patience(30))
    assert rest == f"{handled}\n"
    assert process.returncode == (7 if sent == signal.SIGTERM else 8)


def test_a_missing_command_is_one_line_and_exit_127(launch: Launch) -> None:
    """As a shell says it: the name, not found, 127; no command at all is a usage error."""
    missing = launch.run("no-such-command-here", "--flag")
    assert missing.returncode == 127
    assert missing.stderr == "memtui: no-such-command-here: command not found\n"
    none = subprocess.run(
        [sys.executable, "-m", "memtui", "run"],
        capture_output=True,
        text=True,
        timeout=patience(60),
    )
    assert none.returncode == 2 and "memtui run -- python train.py" in none.stderr


def test_the_environment_puts_the_start_up_module_first() -> None:
    """The boot directory leads PYTHONPATH once, the user's entries follow verbatim, and the
    name and state directory are passed on (the state directory absolute, for every rank)."""
    assert command_environment({})["PYTHONPATH"] == BOOT_DIR
    assert command_environment({"PYTHONPATH": ""})["PYTHONPATH"] == BOOT_DIR
    user = f"/a{os.pathsep}{os.pathsep}/b"
    env = command_environment({"PYTHONPATH": user}, name="exp", state_dir="ckpt")
    assert env["PYTHONPATH"] == f"{BOOT_DIR}{os.pathsep}{user}"
    assert command_environment(env)["PYTHONPATH"] == env["PYTHONPATH"], "nested: added once"
    assert env["MEMTUI_RUN_NAME"] == "exp"
    assert env["MEMTUI_RUN_STATE_DIR"] == str(Path.cwd() / "ckpt")
    assert "MEMTUI_RUN_NAME" not in command_environment({})


def test_options_before_the_command_are_memtuis_and_after_it_the_commands(
    launch: Launch,
) -> None:
    """``memtui run --name exp python ... --name other``: the first is memtui's, the second the
    script's, with or without ``--``."""
    show = "import os, sys; print(os.environ['MEMTUI_RUN_NAME'], sys.argv[1:])"
    command = [PYTHON, "-c", show, "--name", "other"]
    result = subprocess.run(
        [sys.executable, "-E", "-m", "memtui", "run", "--name", "exp", *command],
        env=launch.environment(),
        capture_output=True,
        text=True,
        timeout=patience(60),
    )
    assert result.stdout == "exp ['--name', 'other']\n", result.stderr


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_the_command_starts_with_the_signal_dispositions_a_shell_gives(launch: Launch) -> None:
    """Python ignores SIGPIPE in its own process; the command does not inherit that."""
    status = ("grep", "SigIgn", "/proc/self/status")
    assert launch.run(*status).stdout == launch.run(*status, memtui=False).stdout


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_signals_the_command_inherits_ignored_stay_ignored(launch: Launch) -> None:
    """An ignored SIGHUP (``nohup``) or SIGUSR1 passes through ``memtui run`` as through a shell
    (SIGPIPE and SIGXFSZ, which Python's start-up ignores and forgets, get a shell's defaults)."""

    def ignore() -> None:
        for number in (signal.SIGHUP, signal.SIGUSR1):
            signal.signal(number, signal.SIG_IGN)

    status = ["grep", "SigIgn", "/proc/self/status"]
    masks = [
        subprocess.run(
            command, env=launch.environment(), preexec_fn=ignore, capture_output=True, text=True
        ).stdout
        for command in (launch.memtui_run(*status), status)
    ]
    assert masks[0] == masks[1]
    mask = int(masks[0].split()[1], 16)
    assert mask & (1 << (signal.SIGHUP - 1)) and mask & (1 << (signal.SIGUSR1 - 1)), masks


def test_the_command_gets_the_environment_memtui_found(launch: Launch) -> None:
    """Under the C locale the launcher's Python sets ``LC_CTYPE`` in its own environment (PEP
    538): the command never gets it; its environment is the one given, memtui's own variables
    (the start-up module's PYTHONPATH) aside."""
    for name in ("LC_ALL", "LC_CTYPE"):
        launch.env.pop(name, None)
    launch.env["LANG"] = "C"
    watched, plain = launch.run("env"), launch.run("env", memtui=False)
    assert watched.returncode == plain.returncode == 0, watched.stderr

    def variables(listing: str) -> set[str]:
        return {line for line in listing.splitlines() if not line.startswith("PYTHONPATH=")}

    assert "LC_CTYPE" not in watched.stdout
    assert variables(watched.stdout) == variables(plain.stdout)


def older_pythons() -> list[Path]:
    """The interpreters older than memtui supports that this host has (pyenv's, uv's)."""
    roots = [
        Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions",
        Path.home() / ".local" / "share" / "uv" / "python",
    ]
    found = []
    for root in roots:
        for python in sorted(root.glob("*/bin/python[23].*")):
            version = re.fullmatch(r"python(\d)\.(\d+)", python.name)
            if (
                version
                and (int(version[1]), int(version[2])) < (3, 10)
                and os.access(python, os.X_OK)
            ):
                found.append(python)
    return found


OLDER = older_pythons()


@pytest.mark.parametrize(
    "python",
    OLDER or [pytest.param(None, marks=pytest.mark.skip(reason="no Python older than 3.10 here"))],
    ids=lambda python: python.name if python else "none",
)
def test_an_older_python_the_command_starts_runs_as_without_memtui(
    launch: Launch, python: Path
) -> None:
    """A Python memtui does not support (2.7 to 3.9: a tool's own environment) that the command
    starts says nothing of memtui, is not watched, and still runs the user's own
    ``sitecustomize``: its output is the same as without memtui."""
    launch.script("site_dir/sitecustomize.py", 'import sys\nsys.stderr.write("user site\\n")\n')
    launch.user_path.append(str(launch.dir / "site_dir"))
    watched = launch.run(python, "-c", "print('ran')")
    plain = launch.run(python, "-c", "print('ran')", memtui=False)
    assert (watched.returncode, watched.stdout, watched.stderr) == (0, "ran\n", "user site\n")
    assert (plain.stdout, plain.stderr) == (watched.stdout, watched.stderr)
    assert launch.activations() == []


def test_a_python_that_skips_the_start_up_module_is_said_so(launch: Launch) -> None:
    """``python -I`` / ``-E`` / ``-S`` run no memtui: one line says so, the script runs."""
    script = launch.script("train.py", "print('ran')\n")
    isolated = launch.run(PYTHON, "-I", script)
    assert isolated.stdout == "ran\n" and launch.activations() == []
    assert isolated.stderr == (
        "memtui: python -I does not run memtui's start-up module: this interpreter is not "
        "watched (the processes it starts may be)\n"
    )
    assert unwatched_python(["python3.11", "-uE", "x.py"]) == "-E"
    assert unwatched_python(["/usr/bin/python3", "-X", "dev", "-S", "x.py"]) == "-S"
    for command in (["python", "-c", "-I"], ["python", "x.py", "-I"], ["torchrun", "-I"]):
        assert unwatched_python(command) == "", command


def test_the_installed_hook_starts_without_a_warning(launch: Launch) -> None:
    """With memtui's own hook (no stand-in), a script starts watched and runs unchanged."""
    launch.user_path.clear()
    show = "import sys; print('memtui.hooks.auto' in sys.modules, 'torch' in sys.modules)"
    watched = launch.run(PYTHON, "-c", show)
    assert (watched.returncode, watched.stdout, watched.stderr) == (0, "True False\n", "")


# ------------------------------------------------------------------ the user's start-up modules


def test_a_users_sitecustomize_still_runs_once(launch: Launch) -> None:
    """The user's ``sitecustomize`` on PYTHONPATH runs once, after the hook, and is the module
    the script sees by that name; the output is the same as without memtui."""
    launch.script("site_dir/sitecustomize.py", 'import sys\nprint("user site", file=sys.stderr)\n')
    launch.user_path.append(str(launch.dir / "site_dir"))
    script = launch.script("train.py", "import sitecustomize\nprint(sitecustomize.__file__)\n")
    watched, plain = launch.run(PYTHON, script), launch.run(PYTHON, script, memtui=False)
    assert watched.stderr == plain.stderr == "user site\n"
    assert watched.stdout == plain.stdout == f"{launch.dir / 'site_dir' / 'sitecustomize.py'}\n"
    assert len(launch.activations()) == 1


def test_a_failing_user_sitecustomize_is_reported_as_python_does(launch: Launch) -> None:
    """Python's own start-up message for an error in the user's ``sitecustomize``, unchanged."""
    launch.script("site_dir/sitecustomize.py", "import no_such_module_anywhere\n")
    launch.user_path.append(str(launch.dir / "site_dir"))
    script = launch.script("train.py", "print('ran')\n")
    watched, plain = launch.run(PYTHON, script), launch.run(PYTHON, script, memtui=False)
    assert "Error in sitecustomize" in plain.stderr
    assert (
        (watched.stdout, watched.stderr) == (plain.stdout, plain.stderr) == ("ran\n", plain.stderr)
    )


def test_usercustomize_still_runs(launch: Launch) -> None:
    """An interpreter with user site-packages on still imports the user's ``usercustomize``."""
    base = getattr(sys, "_base_executable", sys.executable)
    check = "import site; print(site.ENABLE_USER_SITE)"
    enabled = subprocess.run(
        [base, "-c", check], capture_output=True, text=True, env=launch.environment()
    )
    if enabled.stdout.strip() != "True":
        pytest.skip(f"{base} has user site-packages off (a virtual environment's interpreter)")
    launch.script("site_dir/usercustomize.py", 'print("user customize")\n')
    launch.user_path.append(str(launch.dir / "site_dir"))
    script = launch.script("train.py", "print('ran')\n")
    watched, plain = launch.run(base, script), launch.run(base, script, memtui=False)
    assert watched.stdout == plain.stdout == "user customize\nran\n"
    assert watched.stderr == ""
    assert len(launch.activations()) == 1


# ------------------------------------------------------------------ entry points and processes


def test_python_dash_m_entry_point(launch: Launch) -> None:
    """``python -m pkg``: the package's ``__main__`` runs with its arguments, as without memtui."""
    launch.script("pkg/__init__.py", "")
    launch.script("pkg/__main__.py", "import sys\nprint(__name__, __package__, sys.argv[1:])\n")
    watched = launch.run(PYTHON, "-m", "pkg", "a", "--b")
    plain = launch.run(PYTHON, "-m", "pkg", "a", "--b", memtui=False)
    assert watched.stdout == plain.stdout == "__main__ pkg ['a', '--b']\n"
    assert watched.returncode == 0 and watched.stderr == ""
    assert (
        launch.activations() == [launch.activations()[0]]
        and "'-m', 'pkg'" in launch.log.read_text()
    )


def test_forked_children_inherit_and_start_nothing(launch: Launch) -> None:
    """``os.fork`` and multiprocessing's fork: the children run as without memtui and start no
    hook of their own (they run no interpreter start-up)."""
    script = launch.script(
        "forks.py",
        """\
        import multiprocessing as mp, os
        def child(tag):
            print(tag, flush=True)
        if __name__ == "__main__":
            pid = os.fork()
            if pid == 0:
                child("forked")
                os._exit(0)
            os.waitpid(pid, 0)
            process = mp.get_context("fork").Process(target=child, args=("mp fork",))
            process.start()
            process.join()
            print("done", process.exitcode)
        """,
    )
    watched = launch.run(PYTHON, script)
    assert (watched.returncode, watched.stdout) == (0, "forked\nmp fork\ndone 0\n")
    assert watched.stderr == ""
    assert len(launch.activations()) == 1


def test_spawned_children_start_the_hook_and_the_forkserver_does_not(launch: Launch) -> None:
    """multiprocessing's spawn children (a rank of ``torch.multiprocessing.spawn`` may be one)
    start the hook, the forkserver does not, and the output is as without memtui."""
    script = launch.script(
        "spawns.py",
        """\
        import multiprocessing as mp
        def square(n):
            return n * n
        if __name__ == "__main__":
            # two processes joined, not a pool: a pool's exit terminates a worker still starting
            spawned = [mp.get_context("spawn").Process(target=square, args=(n,)) for n in (2, 3)]
            for child in spawned:
                child.start()
            for child in spawned:
                child.join()
            print([child.exitcode for child in spawned])
            server = mp.get_context("forkserver").Process(target=square, args=(3,))
            server.start()
            server.join()
            print("forkserver", server.exitcode)
        """,
    )
    watched, plain = launch.run(PYTHON, script), launch.run(PYTHON, script, memtui=False)
    assert watched.stdout == plain.stdout == "[0, 0]\nforkserver 0\n"
    assert watched.stderr == plain.stderr == ""
    activations = launch.activations()
    assert len(activations) == 3, activations  # the script and its two spawned children


def test_a_script_that_re_execs_python_is_watched_again(launch: Launch) -> None:
    """``os.execv`` of Python: the same pid, a new interpreter that starts the hook again."""
    script = launch.script(
        "reexec.py",
        """\
        import os, sys
        print(sys.argv[1:], os.getpid(), flush=True)
        if not sys.argv[1:]:
            os.execv(sys.executable, [sys.executable, __file__, "again"])
        """,
    )
    watched = launch.run(PYTHON, script)
    first, second = watched.stdout.splitlines()
    assert first.startswith("[] ") and second.startswith("['again'] ")
    assert first.split()[-1] == second.split()[-1], "exec keeps the pid"
    activations = launch.activations()
    assert len(activations) == 2 and {line.split()[0] for line in activations} == {
        first.split()[-1]
    }


def test_torchrun_ranks_are_watched_and_its_launcher_is_not(launch: Launch) -> None:
    """``memtui run -- torchrun --nproc_per_node 2``: each rank starts the hook, the launcher
    (which trains nothing) does not, and the ranks' output and exit status come through."""
    script = launch.script(
        "ranks.py",
        """\
        import os
        # one write a line: the two ranks share the launcher's stdout, and print's separate
        # writes of the words and the newline interleave between processes
        os.write(1, f"rank {os.environ['RANK']}\\n".encode())
        """,
    )
    watched = launch.run("torchrun", "--standalone", "--nproc_per_node", "2", script)
    assert watched.returncode == 0, watched.stderr
    assert sorted(watched.stdout.split("\n")[:-1]) == ["rank 0", "rank 1"]
    activations = launch.activations()
    assert len(activations) == 2 and all("ranks.py" in a for a in activations), activations


# ------------------------------------------------------------------ off, failing, light


def test_memtui_disable_starts_nothing(launch: Launch) -> None:
    """``MEMTUI_DISABLE=1``: no hook, no message; the user's ``sitecustomize`` still runs."""
    launch.script("site_dir/sitecustomize.py", 'print("user site")\n')
    launch.user_path.append(str(launch.dir / "site_dir"))
    script = launch.script("train.py", "print('ran')\n")
    watched = launch.run(PYTHON, script, MEMTUI_DISABLE="1")
    assert (watched.returncode, watched.stdout, watched.stderr) == (0, "user site\nran\n", "")
    assert launch.activations() == []


@pytest.mark.parametrize("failure", ["error", "exit", "missing"])
def test_a_failing_hook_is_one_warning_line_and_the_script_runs(
    launch: Launch, failure: str
) -> None:
    """activate() raising (even SystemExit) or absent: one line on stderr, the script's output
    and exit status as without memtui."""
    if failure == "missing":
        (launch.dir / "stand_in" / "memtui" / "hooks" / "auto.py").unlink()
    script = launch.script("train.py", "import sys\nprint('ran')\nsys.exit(5)\n")
    watched = launch.run(PYTHON, script, STAND_IN_FAILS=failure)
    assert (watched.returncode, watched.stdout) == (5, "ran\n")
    warning, *rest = watched.stderr.splitlines()
    assert rest == [] and warning.startswith(WARNING), watched.stderr
    assert warning.endswith("); the script runs as without memtui")
    expected = {"error": "RuntimeError: the hook failed", "exit": "SystemExit: 4"}
    assert expected.get(failure, "No module named 'memtui.hooks.auto'") in warning


def test_start_up_loads_nothing_but_the_hook(launch: Launch) -> None:
    """The start-up module adds only itself and the hook's modules to a fresh interpreter's, and
    only itself when memtui is off or the process runs no training."""
    show = "import sys; print(' '.join(sorted(sys.modules)))"
    plain = set(launch.run(PYTHON, "-c", show, memtui=False).stdout.split())
    watched = set(launch.run(PYTHON, "-c", show).stdout.split())
    off = set(launch.run(PYTHON, "-c", show, MEMTUI_DISABLE="1").stdout.split())
    assert watched - plain == {"sitecustomize", "memtui", "memtui.hooks", "memtui.hooks.auto"}
    assert off - plain == {"sitecustomize"}


def test_processes_that_run_no_training_are_told_by_their_command_line() -> None:
    """multiprocessing's children and the launchers are recognised before anything is imported;
    scripts, modules and ``-c`` programs of the user's are not."""
    boot = boot_module()
    python = sys.executable
    spawn = "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=4, pipe_handle=6)"
    told = {
        "a multiprocessing helper": [
            [python, "-c", "from multiprocessing.forkserver import main; main(3, 4, ['__main__'])"],
            [python, "-B", "-c", "from multiprocessing.resource_tracker import main;main(3)"],
        ],
        "a launcher": [
            [python, "/venv/bin/torchrun", "--nproc_per_node", "2", "train.py"],
            [python, "-m", "torch.distributed.run", "train.py"],
            [python, "/venv/bin/accelerate", "launch", "train.py"],
            [python, "-u", "-mtorch.distributed.launch", "train.py"],
        ],
        "a compile worker": [
            [python, "/venv/lib/torch/_inductor/compile_worker/__main__.py", "--workers=2"]
        ],
    }
    for reason, commands in told.items():
        for command in commands:
            assert boot.not_training(command) == reason, command
    for command in (
        # a spawn child may be a rank (torch.multiprocessing.spawn): watched, registering nothing
        # unless it trains
        [python, "-B", "-c", spawn, "--multiprocessing-fork"],
        [python, "-uc", "from multiprocessing.spawn import spawn_main; spawn_main()"],
        [python, "train.py", "-m", "torch.distributed.run"],
        [python, "-u", "-X", "dev", "train.py"],
        [python, "-X", "dev", "-u", "train.py", "-c", "from multiprocessing.spawn import x"],
        [python, "-m", "pkg", "-c", "from multiprocessing.spawn import x"],
        [python, "-c", "import train"],
        [python, "-W", "ignore", "-m", "trainer_cli"],
        [python],
    ):
        assert boot.not_training(command) == "", command
