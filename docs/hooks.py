"""mkdocs hooks: the screenshots beside the pages, the command line reference and the
``memtui status --json`` schema.

- The pages link the viewer's screenshots where they lie in the repository (``screenshots/`` at
  its root, so the links work on GitHub too); the site serves them under ``screenshots/`` and the
  links are rewritten to that place.
- ``<!-- status-json-schema -->`` in a page becomes the schema of ``memtui status --json``,
  walked from ``memtui/runs/report.py``'s ``StatusReport`` (msgspec Structs and dataclasses): one table
  per object, each field with its JSON type and the docstring written under it in the code, or,
  for a field whose code has none, its entry in ``FIELD_NOTES`` below.
- ``<!-- cli-reference -->`` becomes every ``memtui`` command: its help, its usage and one row per
  option with the text and default ``--help`` prints (click's own help records, so a default is
  shown as ``--help`` shows it, never as a Python value), and for ``memtui demo`` the training
  options it passes through.

Nothing here needs mkdocs but ``on_files``: the generators can be imported and run without it.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import posixpath
import re
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import msgspec
import msgspec.inspect as mi

if TYPE_CHECKING:
    from mkdocs.structure.files import Files

ROOT = Path(__file__).resolve().parent.parent
SCREENSHOTS = "screenshots"
SCHEMA_MARK = "<!-- status-json-schema -->"
CLI_MARK = "<!-- cli-reference -->"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def on_files(files: Files, config: Any) -> Files:
    """Serve the repository's screenshots under ``screenshots/`` in the site."""
    from mkdocs.structure.files import File

    for svg in sorted((ROOT / SCREENSHOTS).glob("*.svg")):
        files.append(
            File(
                f"{SCREENSHOTS}/{svg.name}",
                src_dir=str(ROOT),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Rewrite links into the repository's ``screenshots/``; fill in the command line reference
    and the status schema."""
    page_dir = posixpath.dirname(page.file.src_uri)

    def relink(match: re.Match[str]) -> str:
        target = match.group(1)
        in_repo = posixpath.normpath(posixpath.join("docs", page_dir, target))
        if not in_repo.startswith(f"{SCREENSHOTS}/"):
            return match.group(0)
        return f"]({posixpath.relpath(in_repo, page_dir or '.')})"

    markdown = LINK.sub(relink, markdown)
    if SCHEMA_MARK in markdown:
        markdown = markdown.replace(SCHEMA_MARK, status_schema())
    if CLI_MARK in markdown:
        markdown = markdown.replace(CLI_MARK, cli_reference())
    return markdown


# --------------------------------------------------------------------------- the command line


def cli_reference() -> str:
    """Every ``memtui`` command as Markdown: a heading, its help, its usage and its options."""
    from memtui.cli import main

    root = click.Context(main, info_name="memtui", **main.context_settings)
    sections = []
    for name in main.list_commands(root):
        command = main.get_command(root, name)
        if command is None or command.hidden:
            continue
        ctx = click.Context(command, info_name=name, parent=root, **command.context_settings)
        sections.append(_command_section(ctx))
    return "\n\n".join(sections)


def _command_section(ctx: click.Context) -> str:
    """One command: ``### memtui NAME``, its help's paragraphs, its usage, its options' table."""
    command = ctx.command
    help_text = inspect.cleandoc(command.help or "")
    paragraphs = [" ".join(p.split()) for p in help_text.split("\n\n") if p.strip("\b \n")]
    usage = " ".join(command.collect_usage_pieces(ctx))
    rows = [
        _option_row(*record)
        for param in command.get_params(ctx)
        if (record := param.get_help_record(ctx)) is not None
    ]
    parts = [
        f"### {ctx.command_path} {{#{ctx.command_path.replace(' ', '-')}}}",
        *(_escaped(p) for p in paragraphs),
        f"```text\n{ctx.command_path} {usage}\n```",
        "| option | what it does |\n| --- | --- |\n" + "\n".join(rows),
    ]
    if command.name == "demo":
        from memtui.commands.demo import TRAINING_OPTIONS
        from memtui.demo.options import option_rows

        parts.append(f"{TRAINING_OPTIONS}:")
        parts.append(
            "| option | what it does |\n| --- | --- |\n"
            + "\n".join(_option_row(names, text) for names, text in option_rows())
        )
    return "\n\n".join(parts)


def _option_row(names: str, text: str) -> str:
    """A table row: the option's names and value (as code), and its help with its default."""
    spelled = ", ".join(f"`{name.strip()}`" for name in names.split(", "))
    return f"| {spelled} | {_escaped(' '.join(text.split()))} |"


def _escaped(text: str) -> str:
    """Help text as Markdown table or paragraph text: pipes and angle brackets escaped."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


# --------------------------------------------------------------------------- the schema


def status_schema() -> str:
    """The schema of ``memtui status --json`` as Markdown: one table per object, top first."""
    from memtui.runs.report import StatusReport

    tables: list[str] = []
    seen: set[type] = set()
    queue: list[type] = [StatusReport]
    while queue:
        cls = queue.pop(0)
        if cls in seen:
            continue
        seen.add(cls)
        rows, nested = _rows(cls)
        queue.extend(c for c in nested if c not in seen)
        doc = _first_paragraph(inspect.getdoc(cls) or "").replace("``", "`")
        if getattr(getattr(cls, "__struct_config__", None), "array_like", False):
            doc += " Written as a JSON array of these values, in this order."
        tables.append(
            f"### {cls.__name__} {{#{cls.__name__.lower()}}}\n\n{doc}\n\n"
            "| key | type | what it holds |\n| --- | --- | --- |\n" + "\n".join(rows)
        )
    return "\n\n".join(tables)


def _rows(cls: type) -> tuple[list[str], list[type]]:
    """One table row per field of ``cls``, and the object types its fields hold."""
    info = mi.type_info(cls)
    notes = _attribute_docs(cls)
    omits = getattr(getattr(cls, "__struct_config__", None), "omit_defaults", False)
    rows, nested = [], []
    for field in info.fields:  # type: ignore[attr-defined]
        shown, inner = _type_name(field.type)
        nested.extend(inner)
        optional = ""
        if field.default is msgspec.UNSET:
            optional = " (absent when not known)"
        elif not field.required and omits and field.default_factory is msgspec.NODEFAULT:
            optional = f" (left out when `{_json(field.default)}`)"
        elif not field.required and omits:
            optional = " (left out when empty)"
        note = _cell(notes.get(field.name) or FIELD_NOTES.get(f"{cls.__name__}.{field.name}", ""))
        rows.append(f"| `{field.encode_name}` | {shown}{optional} | {note} |")
    return rows, nested


def _type_name(t: Any) -> tuple[str, list[type]]:
    """A JSON type in words (objects linked to their table), and the object types inside it."""
    if isinstance(t, mi.StructType | mi.DataclassType):
        return f"[{t.cls.__name__}](#{t.cls.__name__.lower()})", [t.cls]
    if isinstance(t, mi.ListType | mi.SetType | mi.FrozenSetType | mi.VarTupleType):
        inner, nested = _type_name(t.item_type)
        return f"list of {inner}", nested
    if isinstance(t, mi.TupleType):
        parts = [_type_name(item) for item in t.item_types]
        return "[" + ", ".join(p for p, _ in parts) + "]", [c for _, n in parts for c in n]
    if isinstance(t, mi.DictType):
        inner, nested = _type_name(t.value_type)
        return f"object of {inner}", nested
    if isinstance(t, mi.UnionType):
        parts = [_type_name(item) for item in t.types]
        return " or ".join(p for p, _ in parts), [c for _, n in parts for c in n]
    if isinstance(t, mi.LiteralType):
        return " or ".join(f"`{v!r}`" for v in t.values), []
    if isinstance(t, mi.EnumType):
        return " or ".join(f"`{m.value!r}`" for m in t.cls), []
    return _SCALARS.get(type(t), type(t).__name__.removesuffix("Type").lower()), []


_SCALARS: dict[type, str] = {
    mi.IntType: "integer",
    mi.FloatType: "number",
    mi.StrType: "string",
    mi.BoolType: "boolean",
    mi.NoneType: "null",
    mi.AnyType: "any",
}


def _attribute_docs(cls: type) -> dict[str, str]:
    """The docstring under each field in the class body (and its bases', nearest first)."""
    found: dict[str, str] = {}
    for klass in cls.__mro__:
        if klass in (object, msgspec.Struct) or not (
            issubclass(klass, msgspec.Struct) or dataclasses.is_dataclass(klass)
        ):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0]
        if not isinstance(body, ast.ClassDef):
            continue
        for node, after in zip(body.body, [*body.body[1:], None], strict=True):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            if (
                isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                found.setdefault(node.target.id, inspect.cleandoc(after.value.value))
    return found


def _json(value: Any) -> str:
    """A default value as JSON writes it."""
    return msgspec.json.encode(value).decode()


def _first_paragraph(text: str) -> str:
    """A docstring's first paragraph on one line."""
    return " ".join(text.split("\n\n", 1)[0].split())


def _cell(text: str) -> str:
    """A docstring as one table cell: on one line, double backticks as code, pipes escaped."""
    text = " ".join(text.split()).replace("``", "`")
    return re.sub(r"\bNone\b", "null", text).replace("|", "\\|")


FIELD_NOTES = {
    # StatusReport
    "StatusReport.run": "The run id (`demo-3f2a1c`): a name prefix and six hex digits.",
    "StatusReport.pid": "Rank 0's process id.",
    "StatusReport.host": "Rank 0's host name.",
    "StatusReport.started": "When the run installed memtui (Unix time, seconds).",
    "StatusReport.command": "Rank 0's command line, as `sys.argv` had it.",
    "StatusReport.world_size": "How many ranks the run has.",
    "StatusReport.device": "Rank 0's device: `cpu`, `cuda:0`, ...",
    "StatusReport.step": "Optimizer steps done so far (continued across a resume).",
    "StatusReport.config": "Every knob (`batch_size`, `grad_accum`, `num_workers`, `pin_memory`, `prefetch_factor`) with its value now, tunable or not (`tunable` says which memtui can change, `config_measured` which were measured from the steps, `config_unused` which the loader does not use now); null where memtui does not know it.",
    "StatusReport.tunable": "The knobs a change may set on this run.",
    "StatusReport.effective_batch": "Micro-batch x accumulation x ranks, from the values in `config` (a run without an accumulation knob: the micro-batches its steps draw); null where either is unknown.",
    "StatusReport.pending": "Changes queued for the next checkpoint boundary, oldest first.",
    "StatusReport.applied": "Changes applied, rollbacks included, oldest first.",
    "StatusReport.rejected": "Changes refused, at queue time or at a boundary, with the reason.",
    "StatusReport.metrics": "Rank 0's step time, data wait and samples/s over its recent steps (null before the first steps); the job's samples/s is `throughput`.",
    "StatusReport.memory": "Device memory now and at peak (null before the first sample).",
    "StatusReport.verdict": "STARVED, UNDERUSED, BALANCED, OOM_RISK or HOST_PRESSURE, with the numbers behind it.",
    "StatusReport.static_memory": "Parameters, gradients, optimizer state and buffers, computed from the tensors (null without a model).",
    "StatusReport.recommendations": "Ranked options, the first the one the viewer's `o` queues.",
    "StatusReport.model": "The fitted memory model behind the predictions (null before one is fitted).",
    "StatusReport.prediction_accuracy": "How far predicted peaks were from observed ones.",
    "StatusReport.ooms": "Out-of-memory errors the hook saw, parsed, and what was done about each.",
    "StatusReport.disabled": "Why changes are switched off for this run (empty while they are on).",
    "StatusReport.ranks": "Every rank: where it runs and, when it answered, its own numbers.",
    "StatusReport.last_step": "The newest step record.",
    "StatusReport.host_memory": "The newest host memory sample of rank 0's host.",
    "StatusReport.checkpoints": "The last five checkpoint boundaries.",
    "StatusReport.counters": "The hook's counters: dropped records, errors, refused and rate-limited requests.",
    "StatusReport.state_dir": "Where the run keeps its audit log and tuned config.",
    "StatusReport.tuned_path": "The tuned config (`memtui-tuned.yaml`).",
    "StatusReport.requeue": "At a resume, the `memtui set` command that queues again what was pending when the run died (empty otherwise).",
    "StatusReport.tuned_unsaved_step": "The step since which the tuned config could not be written (null: it is saved).",
    "StatusReport.audit_path": "The audit log (`memtui-audit.jsonl`).",
    # changes
    "PendingChange.id": "The change id `memtui set` printed (`#3`); `memtui cancel` takes it.",
    "PendingChange.queued_time": "When it was queued (Unix time).",
    "PendingChange.queued_step": "The run's step when it was queued.",
    "PendingChange.keep_effective_batch": "Queued with `--keep-effective-batch`: `grad_accum` recomputed.",
    "PendingChange.client": "Who queued it, as the client named itself (a viewer, `memtui set`).",
    "PendingChange.note": "What the hook said when it queued it (a warning, a note that it does nothing here).",
    "Applied.ids": "The ids of the pending changes it applied.",
    "Applied.time": "When it was applied (Unix time).",
    "Applied.changes": "Each knob it moved, with its old and new value.",
    "Applied.note": "What the boundary said (the loader rebuilt, the LR warning).",
    "Applied.effect": "The measured effect, once 20 steps ran after it (null until then).",
    "Applied.rollback": "True for a rollback after an out-of-memory error.",
    "Applied.predicted_peak_bytes": "The peak the memory model predicted for the new config.",
    "Applied.observed_peak_bytes": "The peak measured after it.",
    "Applied.step": "The checkpoint boundary's step: the change holds from the next step on.",
    "Diff.old": "The value before (null where it was not known).",
    "Diff.new": "The value after.",
    "RejectedChange.requested": "What the client asked for.",
    "RejectedChange.reason": "Why it was refused.",
    "RejectedChange.time": "When (Unix time).",
    "RejectedChange.step": "The run's step then.",
    "RejectedChange.client": "Who asked, as the client named itself.",
    "CancelledChange.id": "The id of the change cancelled.",
    "CancelledChange.changes": "What it would have set.",
    "CancelledChange.time": "When it was cancelled (Unix time).",
    "CancelledChange.step": "The run's step then.",
    "CancelledChange.client": "Who cancelled it: this viewer, another shell, the autopilot.",
    # numbers
    "Metrics.window_steps": "How many recent steps the figures cover.",
    "Metrics.step_time_s": "Mean wall time of a step, in seconds.",
    "Metrics.data_wait_s": "Mean time a step waited for data, in seconds.",
    "Metrics.data_wait_fraction": "Data wait over step time (0.3: 30%).",
    "Metrics.samples_per_s": "Samples trained per second.",
    "Metrics.steps_per_s": "Optimizer steps per second.",
    "Memory.kind": "`cuda` or `cpu`.",
    "Memory.capacity_bytes": "What the device holds: the GPU's memory, or on the CPU the memory limit (a cgroup's, one given, else total RAM).",
    "Memory.current_bytes": "In use now (CUDA: torch's allocated; CPU: main RSS plus the workers' own memory).",
    "Memory.reserved_bytes": "Reserved now by torch's caching allocator (CPU: as `current_bytes`).",
    "Memory.peak_bytes": "The peak in use that the OOM bands apply to: torch's peak reserve plus memory beyond torch.",
    "Memory.peak_allocated_bytes": "torch's peak allocated.",
    "Memory.peak_fraction": "`peak_bytes` over `capacity_bytes`.",
    "Memory.fragmentation_bytes": "Reserved but unallocated (the allocator's inactive split blocks).",
    "Memory.nvml_used_bytes": "The device's used memory as NVML sees it (null on the CPU or without NVML).",
    "Memory.beyond_torch_bytes": "Device memory outside torch's reserve: CUDA context, NCCL, other processes.",
    "Memory.ooms": "Out-of-memory errors torch's allocator counted.",
    "Memory.alloc_retries": "Allocations torch retried after freeing its cache.",
    "HostSample.time": "When it was sampled (Unix time).",
    "HostSample.ram_total_bytes": "The host's RAM.",
    "HostSample.ram_available_bytes": "RAM available to new work.",
    "HostSample.ram_used_bytes": "RAM in use.",
    "HostSample.swap_total_bytes": "Swap configured.",
    "HostSample.swap_used_bytes": "Swap in use.",
    "HostSample.main_rss_bytes": "The training process's RSS.",
    "StaticMemory.kind": "`cuda` or `cpu`.",
    "StaticMemory.parameters_bytes": "The model's parameters.",
    "StaticMemory.optimizer_bytes": "The optimizer's state (moments, step counts).",
    "StaticMemory.buffers_bytes": "The model's buffers (BatchNorm statistics and the like).",
    "Checkpoint.step": "The step of the boundary.",
    "Checkpoint.time": "When the boundary took the pending changes (Unix time).",
    "Checkpoint.save_s": "The loop's own save before it, in seconds.",
    "Counters.last_error": "The hook's last own error, in one line (empty: none).",
    # advice
    "VerdictReport.state": "`STARVED`, `UNDERUSED`, `BALANCED`, `OOM_RISK` or `HOST_PRESSURE`.",
    "VerdictReport.severity": "0 fine, 1 at a threshold's edge, 2 over it.",
    "VerdictReport.headline": "The verdict in one line.",
    "VerdictReport.thresholds_from": "The config file the thresholds came from, or `built-in defaults`.",
    "VerdictReport.thresholds": "The thresholds in force.",
    "VerdictReport.reasons": "The numbers behind the verdict.",
    "Option.title": "The option in a few words.",
    "Option.changes": "The knobs it would queue, with their values (empty for advice memtui cannot apply).",
    "Option.applicable": "Whether memtui can apply it (false: a restart or a code change).",
    "Option.needs_restart": "It takes a restart (an environment variable, for instance).",
    "Option.why": "The reason it is offered.",
    "Option.memory_delta_bytes": "The expected change of the device peak (null: unknown).",
    "Option.host_delta_bytes": "The expected change of host memory (null: unknown).",
    "Option.speed_delta": "The expected relative change of samples/s (0.25: +25%; null: unknown until measured).",
    "Option.speed_note": "How the speed was estimated, or why it could not be.",
    "Option.predicted_peak_bytes": "The device peak predicted with it.",
    "Option.effective_batch": "The effective batch it results in.",
    "ModelReport.kind": "`cuda` or `cpu`.",
    "ModelReport.capacity_bytes": "The capacity the model predicts against.",
    "ModelReport.points": "The (micro-batch, peak) points it was fitted on.",
    "ModelReport.confidence": "How sure the model is, in words (`2 micro-batches seen, +-3% at 8`).",
    "ModelPoint.batch_size": "The micro-batch of the point.",
    "Accuracy.changes_measured": "Applied changes whose peak was observed.",
    "Accuracy.mean_abs_error": "Mean |predicted / observed - 1| over them (null: none yet).",
    "Accuracy.changes_out_of_memory": "Changes the run ran out of memory at before the next one landed (misses, left out of the mean).",
    "Accuracy.note": "The same in words.",
    "SpeedAccuracyReport.changes_measured": "Applied changes whose speed was both predicted and measured.",
    "SpeedAccuracyReport.no_estimate": "Applied changes that had no speed estimate.",
    "SpeedAccuracyReport.note": "The same in words.",
    "OomEvent.time": "When it happened (Unix time).",
    "OomEvent.step": "The step it happened in.",
    "OomEvent.kind": "`cuda` or `cpu` (a `MemoryError`).",
    "OomEvent.message": "The error's own message.",
    "OomEvent.tried_bytes": "What the failing allocation asked for.",
    "OomEvent.capacity_bytes": "The device's capacity, from the message.",
    "OomEvent.free_bytes": "Free on the device, from the message.",
    "OomEvent.process_in_use_bytes": "In use by the process, from the message.",
    "OomEvent.allocated_bytes": "Allocated by PyTorch, from the message.",
    "OomEvent.reserved_unallocated_bytes": "Reserved by PyTorch but unallocated, from the message.",
    "RankReport.rank": "The rank.",
    "RankReport.local_rank": "Its rank on its node.",
    "RankReport.host": "Its host name.",
    "RankReport.pid": "Its process id.",
    "RankReport.reachable": "Whether it answered this report's request.",
    "RankReport.step": "Its step.",
    "RankReport.config": "Its own knob values.",
    "RankReport.applied": "The changes it applied (the same steps on every rank).",
    "RankReport.metrics": "Its step time, data wait and throughput.",
    "RankReport.memory": "Its device memory.",
    "RankReport.host_memory": "Its host's memory.",
    "RankReport.counters": "Its hook's counters.",
    "EffectReport.steps_before": "Steps measured before the change.",
    "EffectReport.steps_after": "Steps measured after it (settling steps left out).",
    "EffectReport.samples_per_s_before": "Samples per second before.",
    "EffectReport.samples_per_s_after": "Samples per second after.",
    "EffectReport.step_time_s_before": "Mean step time before, in seconds.",
    "EffectReport.step_time_s_after": "Mean step time after.",
    "EffectReport.data_wait_s_before": "Mean data wait per step before, in seconds.",
    "EffectReport.data_wait_s_after": "Mean data wait per step after.",
    "EffectReport.peak_bytes_before": "The device peak before.",
    "EffectReport.peak_bytes_after": "The device peak after.",
    "EffectReport.summary": "The effect in one line (`+180% +-9% samples/s, step 116.7 ms -> 41.2 ms, ...`).",
    "Knobs.batch_size": "The micro-batch size.",
    "Knobs.grad_accum": "Gradient accumulation steps.",
    "Knobs.num_workers": "DataLoader worker processes.",
    "Knobs.pin_memory": "Whether the loader pins its batches.",
}
"""Descriptions of the fields whose code carries no docstring, by ``Class.field``."""
