"""Reading TensorBoard event files back with the tensorboard package's own reader."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

TEXT_SUFFIX = "/text_summary"
"""What ``SummaryWriter.add_text`` appends to a text's tag."""


@dataclass
class Logged:
    """What event files hold: scalars by tag and texts by tag, each as (step, value) in order."""

    scalars: dict[str, list[tuple[int, float]]]
    texts: dict[str, list[tuple[int, str]]]


def read_events(root: Path) -> Logged:
    """Every scalar and text in the event files under ``root`` (each directory that holds some)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    logged = Logged({}, {})
    folders = sorted({path.parent for path in root.rglob("events.out.tfevents.*")})
    for folder in folders:
        reader = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
        reader.Reload()
        tags = reader.Tags()
        for tag in tags["scalars"]:
            points = [(event.step, event.value) for event in reader.Scalars(tag)]
            logged.scalars.setdefault(tag, []).extend(points)
        for tag in tags["tensors"]:
            if not tag.endswith(TEXT_SUFFIX):
                continue
            lines = [
                (event.step, tensor_util.make_ndarray(event.tensor_proto).item().decode())
                for event in reader.Tensors(tag)
            ]
            logged.texts.setdefault(tag.removesuffix(TEXT_SUFFIX), []).extend(lines)
    return logged
