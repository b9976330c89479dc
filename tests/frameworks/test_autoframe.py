"""Trainers hooked with no code: a Hugging Face or Lightning script without a memtui line, started
with memtui's bootstrap (a ``sitecustomize`` calling ``autoframe.register``), registers a run and
takes a change at its next save as with ``hooks.install(trainer)``; a restart that resumes from a
checkpoint gets the tuned config, a fresh start keeps its own; without the bootstrap the script
runs as it always did; the wrapped class keeps its signature, pickling and subclasses."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.frameworks.harness import PYTHON, paused_run
from tests.support.cli import memtui_cli
from tests.support.processes import ROOT, wait_for

SITECUSTOMIZE = textwrap.dedent(
    '''
    """memtui's bootstrap, as ``memtui run`` gives a process: wrap the Trainers when imported."""
    import importlib.abc
    import sys


    class AfterImport(importlib.abc.MetaPathFinder):
        """Calls the callbacks of a module right after it finished importing."""

        def __init__(self):
            self.waiting = {}

        def find_spec(self, name, path, target=None):
            callbacks = self.waiting.pop(name, None)
            if callbacks is None:
                return None
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None)
                spec = find(name, path, target) if finder is not self and find else None
                if spec is not None:
                    break
            else:
                return None
            exec_module = spec.loader.exec_module

            def exec_then_call(module):
                exec_module(module)
                for callback in callbacks:
                    callback(module)

            spec.loader.exec_module = exec_then_call
            return spec


    after_import = AfterImport()
    sys.meta_path.insert(0, after_import)


    def on_import(name, callback):
        if name in sys.modules:
            callback(sys.modules[name])
        else:
            after_import.waiting.setdefault(name, []).append(callback)


    from memtui.hooks import autoframe

    autoframe.register(on_import)
    '''
)

HF_SCRIPT = textwrap.dedent(
    '''
    """A tiny GPT-2 trained by the Hugging Face Trainer, with no memtui line."""
    import argparse
    import json
    import os
    import sys
    import time
    from pathlib import Path

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback
    from transformers import TrainingArguments

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--go", default="")
    parser.add_argument("--wait-at", type=int, default=2)
    parser.add_argument("--resume-from", default="")
    cli = parser.parse_args()
    started_with = []


    class Tokens(torch.utils.data.Dataset):
        def __init__(self, size):
            self.ids = torch.randint(0, 64, (size, 16), generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, index):
            return {"input_ids": self.ids[index], "labels": self.ids[index]}


    class WaitForGo(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            started_with.append(
                [state.global_step, args.per_device_train_batch_size, args.gradient_accumulation_steps]
            )

        def on_step_end(self, args, state, control, **kwargs):
            if cli.go and state.global_step == cli.wait_at:
                print(f"rank 0 waiting at step {state.global_step}", flush=True)
                deadline = time.monotonic() + 60
                while not os.path.exists(cli.go) and time.monotonic() < deadline:
                    time.sleep(0.05)


    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))
    args = TrainingArguments(
        output_dir=cli.out,
        max_steps=8,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=4,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=7,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(64), callbacks=[WaitForGo()])
    output = trainer.train(resume_from_checkpoint=cli.resume_from or None)
    report = {
        "global_step": trainer.state.global_step,
        "output_step": output.global_step,
        "steps": [e["step"] for e in trainer.state.log_history if "learning_rate" in e],
        "started_with": started_with,
        "args": [args.per_device_train_batch_size, args.gradient_accumulation_steps],
        "wrapped": hasattr(Trainer.__init__, "__wrapped__"),
        "memtui_imported": "memtui" in sys.modules,
        "instance_methods": sorted(k for k in ("train", "get_batch_samples") if k in vars(trainer)),
    }
    Path(cli.report).write_text(json.dumps(report))
    '''
)

LIGHTNING_SCRIPT = textwrap.dedent(
    '''
    """A tiny LightningModule trained by a Lightning Trainer with its defaults, with no memtui line."""
    import argparse
    import importlib
    import json
    import os
    import time
    from pathlib import Path

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--go", default="")
    parser.add_argument("--wait-at", type=int, default=2)
    parser.add_argument("--package", default="lightning.pytorch")
    parser.add_argument("--ckpt-path", default=None)
    parser.add_argument("--devices", type=int, default=1)
    cli = parser.parse_args()
    pl = importlib.import_module(cli.package)


    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 1)
            self.micro = 0
            self.accum_per_step = []
            self.started_with = []

        def on_train_start(self):
            self.started_with.append([self.trainer.global_step, self.trainer.accumulate_grad_batches])

        def training_step(self, batch, batch_idx):
            self.micro += 1
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def on_before_optimizer_step(self, optimizer):
            self.accum_per_step.append(self.micro)
            self.micro = 0

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)


    class WaitForGo(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            if cli.go and trainer.global_step == cli.wait_at and not os.path.exists(cli.go):
                print(f"rank {trainer.global_rank} waiting at step {trainer.global_step}", flush=True)
                deadline = time.monotonic() + 60
                while not os.path.exists(cli.go) and time.monotonic() < deadline:
                    time.sleep(0.05)


    torch.manual_seed(0)
    data = TensorDataset(torch.randn(96, 8), torch.randn(96, 1))
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=cli.out, every_n_train_steps=4, save_top_k=-1)
    trainer = pl.Trainer(
        max_steps=12,
        accumulate_grad_batches=2,
        accelerator="cpu",
        devices=cli.devices,
        strategy="ddp" if cli.devices > 1 else "auto",
        default_root_dir=cli.out,
        log_every_n_steps=1,
        callbacks=[checkpoints, WaitForGo()],
    )
    model = Tiny()
    trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=4), ckpt_path=cli.ckpt_path)
    report = {
        "global_step": trainer.global_step,
        "accum_per_step": model.accum_per_step,
        "started_with": model.started_with,
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "progress_bar": type(trainer.progress_bar_callback).__name__,
        "checkpoints": sorted(p.name for p in Path(cli.out).glob("*.ckpt")),
    }
    suffix = f".rank{trainer.global_rank}" if trainer.world_size > 1 else ""
    Path(cli.report + suffix).write_text(json.dumps(report))
    '''
)

CLASS_SCRIPT = textwrap.dedent(
    '''
    """The wrapped Trainer class: signature, pickling, subclasses; the first Trainer to train."""
    import inspect
    import json
    import pickle
    import sys

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from memtui.hooks import autoframe

    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]


    class Mine(Trainer):
        def __init__(self, *args, tag="", **kwargs):
            super().__init__(*args, **kwargs)
            self.tag = tag


    def make(cls, name, **extra):
        args = TrainingArguments(
            output_dir=sys.argv[1] + "/" + name,
            max_steps=1,
            per_device_train_batch_size=4,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
        )
        return cls(model=model, args=args, train_dataset=data, **extra)


    idle = make(Trainer, "idle")  # constructed first, never trained
    first = make(Mine, "first", tag="mine")
    train_signature = inspect.signature(first.train) == inspect.signature(Trainer.train.__get__(first))
    first.train()
    second = make(Trainer, "second")
    second.train()
    third = make(Trainer, "third")
    third.train()
    init = Trainer.__init__
    print(json.dumps({
        "signature_kept": inspect.signature(init) == inspect.signature(init.__wrapped__)
        and list(inspect.signature(Trainer).parameters)[:2] == ["model", "args"],
        "train_signature_kept": train_signature,
        "name": init.__name__,
        "pickled": pickle.loads(pickle.dumps(Trainer)) is Trainer,
        "subclass": isinstance(first, Trainer) and first.tag == "mine",
        "hooked": [autoframe.tuner_of(t) is not None for t in (idle, first, second, third)],
        "steps": [t.state.global_step for t in (first, second, third)],
    }))
    '''
)


AUTO_SITECUSTOMIZE = "from memtui.hooks import auto\n\nauto.activate()\n"
"""The bootstrap with memtui's own import watch and its watch of a plain loop."""


def bootstrap(tmp_path: Path, site_code: str = SITECUSTOMIZE, **extra: str) -> dict[str, str]:
    """The environment of a process started with memtui's bootstrap (its ``sitecustomize``)."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(site_code)
    return {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), **extra}


def run_id_of_the_one_run() -> str:
    """The run the script registered (each test has its own runtime directory)."""
    from memtui.storage import registry

    runs: Any = wait_for(registry.list_runs, 30, what="the run to register")
    assert len(runs) == 1, runs
    return str(runs[0].run)


def audit_events(state_dir: Path) -> list[dict[str, Any]]:
    """memtui's audit log in ``state_dir``."""
    lines = (state_dir / "memtui-audit.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_an_hf_trainer_without_memtui_lines_takes_a_change_and_a_restart_resumes_it(
    tmp_path: Path,
) -> None:
    pytest.importorskip("transformers")
    script = tmp_path / "hf_plain.py"
    script.write_text(HF_SCRIPT)
    state = tmp_path / "state"
    env = bootstrap(tmp_path, MEMTUI_RUN_NAME="autohf", MEMTUI_RUN_STATE_DIR=str(state))
    first = tmp_path / "first"
    first.mkdir()
    with paused_run(first, PYTHON, script, env=env) as paused:
        run_id = run_id_of_the_one_run()
        assert run_id.startswith("autohf-"), run_id
        setting = memtui_cli("set", run_id, "batch_size=6", "grad_accum=1")
        assert setting.returncode == 0, setting.stderr + setting.stdout
        paused.go.touch()
        paused.finish(120)
    report = json.loads(paused.report.read_text())
    # the change lands at the save of step 4; train() resumes from checkpoint-4 in-process
    assert report["started_with"] == [[0, 4, 2], [4, 6, 1]]
    assert report["global_step"] == report["output_step"] == 8
    assert report["steps"] == list(range(1, 9)), "the global step went on"
    assert report["wrapped"] and report["memtui_imported"]
    applied = [e for e in audit_events(state) if e.get("event") == "applied"]
    assert [e["step"] for e in applied] == [4], "audited in MEMTUI_RUN_STATE_DIR"
    assert not (first / "out" / "memtui-audit.jsonl").exists()
    assert "memtui:" not in paused.output().replace("memtui: resuming", ""), paused.output()

    # started again from checkpoint-4, as a killed run would be: the tuned settings from the start
    again = tmp_path / "again"
    again.mkdir()
    resume = ("--resume-from", str(first / "out" / "checkpoint-4"))
    with paused_run(again, PYTHON, script, *resume, env=env, wait_at=5) as restarted:
        restarted.go.touch()
        restarted.finish(120)
    report = json.loads(restarted.report.read_text())
    assert report["started_with"] == [[4, 6, 1]]
    assert report["steps"] == list(range(1, 9)), "the checkpoint's history, then steps 5 to 8"

    # a fresh start with the same state directory keeps the script's own settings
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    with paused_run(fresh, PYTHON, script, env=env, wait_at=1) as started:
        started.go.touch()
        started.finish(120)
    report = json.loads(started.report.read_text())
    assert report["started_with"] == [[0, 4, 2]] and report["args"] == [4, 2]


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_a_lightning_trainer_without_memtui_lines_takes_a_change_after_its_next_checkpoint(
    tmp_path: Path, package: str
) -> None:
    pytest.importorskip(package)
    script = tmp_path / "lightning_plain.py"
    script.write_text(LIGHTNING_SCRIPT)
    with paused_run(
        tmp_path, PYTHON, script, "--package", package, env=bootstrap(tmp_path)
    ) as paused:
        run_id = run_id_of_the_one_run()
        assert run_id.startswith("lightning_plain-"), run_id
        setting = memtui_cli("set", run_id, "grad_accum=3")
        assert setting.returncode == 0, setting.stderr + setting.stdout
        paused.go.touch()
        paused.finish(120)
    report = json.loads(paused.report.read_text())
    assert report["global_step"] == 12
    assert report["accum_per_step"][:7] == [2] * 4 + [3] * 3, "whole groups of 3 from step 5 on"
    assert report["accumulate_grad_batches"] == 3
    assert report["progress_bar"] in ("RichProgressBar", "TQDMProgressBar"), "Lightning's default"
    assert report["checkpoints"], "its own checkpoints"
    # the state directory is the Trainer's default_root_dir, as for hooks.install(trainer)
    applied = [e for e in audit_events(tmp_path / "out") if e.get("event") == "applied"]
    assert [e["step"] for e in applied] == [4]

    # started again from the checkpoint of step 4 in the same root: the tuned accumulation
    again = tmp_path / "again"
    again.mkdir()
    resume = (
        "--out",
        str(tmp_path / "out"),
        "--ckpt-path",
        str(tmp_path / "out" / "epoch=0-step=4.ckpt"),
    )
    with paused_run(
        again, PYTHON, script, "--package", package, *resume, env=bootstrap(tmp_path), wait_at=5
    ) as restarted:
        restarted.go.touch()
        restarted.finish(120)
    report = json.loads(restarted.report.read_text())
    assert report["started_with"] == [[4, 3]]
    # groups of 3 (the first group after the restart is Lightning's: it counts groups from the
    # epoch's first batch, as under the explicit line)
    assert report["accum_per_step"][1:] == [3] * 7 and report["global_step"] == 12


@pytest.mark.parametrize("started", ["without-the-bootstrap", "with-memtui-disabled"])
def test_a_trainer_script_without_memtui_runs_as_it_always_did(
    tmp_path: Path, started: str
) -> None:
    pytest.importorskip("transformers")
    from memtui.storage import registry

    script = tmp_path / "hf_plain.py"
    script.write_text(HF_SCRIPT)
    report_path = tmp_path / "report.json"
    out = tmp_path / "out"
    env = dict(os.environ)
    if started == "with-memtui-disabled":
        env.update(bootstrap(tmp_path, MEMTUI_DISABLE="1"))
    done = subprocess.run(
        [*PYTHON, str(script), "--out", str(out), "--report", str(report_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(report_path.read_text())
    assert not report["wrapped"] and report["instance_methods"] == []
    assert report["memtui_imported"] == (started == "with-memtui-disabled")  # the bootstrap's
    assert report["started_with"] == [[0, 4, 2]] and report["steps"] == list(range(1, 9))
    assert not list(out.glob("memtui*")) and "memtui" not in done.stdout + done.stderr
    assert registry.list_runs() == [], "no run registered"


def test_the_wrapped_trainer_keeps_its_class_and_only_the_first_to_train_is_hooked(
    tmp_path: Path,
) -> None:
    pytest.importorskip("transformers")
    script = tmp_path / "classes.py"
    script.write_text(CLASS_SCRIPT)
    done = subprocess.run(
        [*PYTHON, str(script), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env=dict(os.environ, **bootstrap(tmp_path)),
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {
        "signature_kept": True,
        "train_signature_kept": True,
        "name": "__init__",
        "pickled": True,
        "subclass": True,
        "hooked": [False, True, False, False],
        "steps": [1, 1, 1],
    }
    said = [line for line in done.stderr.splitlines() if line.startswith("memtui:")]
    assert len(said) == 1 and "another Trainer" in said[0], done.stderr
    assert "trains without memtui" in said[0] and "classes.Mine" not in said[0].split("(")[1]


def test_a_trainer_memtui_cannot_hook_trains_as_without_memtui(tmp_path: Path) -> None:
    """The adapter fails on this Trainer (its ``add_callback`` raises): one line, it trains, and
    the Tuner the adapter had started is closed."""
    pytest.importorskip("transformers")
    script = tmp_path / "failing.py"
    script.write_text(
        HF_SCRIPT.replace(
            "trainer = Trainer(",
            textwrap.dedent(
                """
                class Refusing(Trainer):
                    def add_callback(self, callback):
                        if type(callback).__module__.startswith("memtui"):
                            raise RuntimeError("no callbacks from outside")
                        super().add_callback(callback)


                Trainer = Refusing
                """
            )
            + "trainer = Trainer(",
        )
        # the Tuner the failed adapter had started is closed: no run left that nothing drives
        + "\nimport memtui.hooks.tuner\nprint('live tuners', len(memtui.hooks.tuner.live_tuners()))\n"
    )
    report_path = tmp_path / "report.json"
    done = subprocess.run(
        [*PYTHON, str(script), "--out", str(tmp_path / "out"), "--report", str(report_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env=dict(os.environ, **bootstrap(tmp_path)),
    )
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if line.startswith("memtui:")]
    assert len(said) == 1 and "no callbacks from outside" in said[0], done.stderr
    assert "trains without memtui" in said[0]
    assert done.stdout.splitlines()[-1] == "live tuners 0"
    report = json.loads(report_path.read_text())
    assert report["steps"] == list(range(1, 9)) and report["global_step"] == 8


@pytest.mark.parametrize("framework", ["transformers", "lightning.pytorch"])
def test_a_script_with_its_own_install_line_keeps_it_under_the_bootstrap(
    tmp_path: Path, framework: str
) -> None:
    """The framework test scripts (``hooks.install(trainer)`` in them) under the bootstrap: one
    run, the script's own tuner, and a change lands as without the bootstrap."""
    pytest.importorskip(framework)
    from memtui.storage import registry

    hf = framework == "transformers"
    script = Path(__file__).with_name("hf_train.py" if hf else "lightning_train.py")
    with paused_run(tmp_path, PYTHON, script, env=bootstrap(tmp_path)) as paused:
        assert len(registry.list_runs()) == 1
        paused.queue_and_go("batch_size=6", "grad_accum=1" if hf else "grad_accum=3")
        paused.finish(120)
    report = json.loads(paused.report.read_text())
    assert report["global_step"] == report["tuner_step"] == 12
    if hf:
        assert report["restarts"] == 1 and report["steps"] == list(range(1, 13))
        assert report["args"] == {
            "per_device_train_batch_size": 6,
            "gradient_accumulation_steps": 1,
        }
    else:
        assert report["batch_size"] == 6 and report["accumulate_grad_batches"] == 3
        assert report["accum_per_step"][:7] == [2] * 4 + [3] * 3
    assert "memtui: another Trainer" not in paused.output()


def test_under_the_watch_of_memtui_run_the_trainer_is_one_run_that_takes_a_change(
    tmp_path: Path,
) -> None:
    """With ``memtui.hooks.auto`` as the bootstrap (its plain-loop watch on too), the Trainer's
    adapter is the process's one run and takes a change at its next save."""
    pytest.importorskip("transformers")
    auto = pytest.importorskip("memtui.hooks.auto")
    if not hasattr(auto, "activate"):
        pytest.skip("memtui.hooks.auto has no activate()")
    from memtui.storage import registry

    script = tmp_path / "hf_plain.py"
    script.write_text(HF_SCRIPT)
    env = bootstrap(tmp_path, AUTO_SITECUSTOMIZE)
    with paused_run(tmp_path, PYTHON, script, env=env) as paused:
        run_id = run_id_of_the_one_run()
        setting = memtui_cli("set", run_id, "batch_size=6", "grad_accum=1")
        assert setting.returncode == 0, setting.stderr + setting.stdout
        assert [run.run for run in registry.list_runs()] == [run_id]
        paused.go.touch()
        paused.finish(120)
    report = json.loads(paused.report.read_text())
    assert report["started_with"] == [[0, 4, 2], [4, 6, 1]]
    assert report["steps"] == list(range(1, 9))


def test_every_rank_of_lightnings_own_ddp_launcher_is_hooked_as_one_run(tmp_path: Path) -> None:
    """``strategy="ddp"`` on two CPU processes: Lightning starts the second rank as a new process
    of the script, which gets the bootstrap too; one run, the change at the same step on both."""
    pytest.importorskip("lightning.pytorch")
    from memtui.storage import registry

    script = tmp_path / "lightning_plain.py"
    script.write_text(LIGHTNING_SCRIPT)
    env = bootstrap(tmp_path)
    with paused_run(tmp_path, PYTHON, script, "--devices", "2", env=env, ranks=2) as paused:
        run_id = run_id_of_the_one_run()
        setting = memtui_cli("set", run_id, "grad_accum=3")
        assert setting.returncode == 0, setting.stderr + setting.stdout
        paused.go.touch()
        paused.finish(180)
    assert registry.list_runs() == []
    for rank in (0, 1):
        report = json.loads(Path(f"{paused.report}.rank{rank}").read_text())
        # 12 batches of 4 a rank an epoch: 8 in groups of 2, then 3 and the epoch's last alone
        assert report["accum_per_step"] == [2] * 4 + [3, 1] + [3] * 6, rank
        assert report["global_step"] == 12
