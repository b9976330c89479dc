"""The user's configuration file (``$MEMTUI_CONFIG``, else ``~/.config/memtui/config.yaml``), read
once where a command or a run starts: the values go to the advice, which reads no file itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from memtui.advice.verdict import THRESHOLDS, ThresholdConfig, parse_thresholds
from memtui.storage import paths


def load_thresholds(
    path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
) -> ThresholdConfig:
    """The verdict's thresholds from the config file (``path``, else ``paths.config_file``); the
    built-in defaults when there is none; never raises (a bad file is reported in ``problems``)."""
    file = Path(path) if path is not None else paths.config_file(env)
    explicit = path is not None or paths.config_file_named(env)
    missing = ThresholdConfig(
        THRESHOLDS,
        "built-in defaults",
        (f"{file}: no such file; defaults used",) if explicit else (),
    )
    if not os.path.lexists(file):  # no file, no YAML parser loaded: `memtui status` starts sooner
        return missing
    import yaml

    from memtui.storage import safeyaml

    try:
        data = safeyaml.read(file)
    except FileNotFoundError:
        return missing
    except (OSError, UnicodeDecodeError) as exc:
        return ThresholdConfig(
            THRESHOLDS, "built-in defaults", (f"{file}: cannot read ({exc}); defaults used",)
        )
    except yaml.YAMLError as exc:
        first = str(exc) or type(exc).__name__
        return ThresholdConfig(
            THRESHOLDS, "built-in defaults", (f"{file}: not valid YAML ({first}); defaults used",)
        )
    return parse_thresholds(data, str(file))
