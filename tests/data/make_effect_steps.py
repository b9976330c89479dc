"""Write tests/data/effect_steps.json: step records of real runs through loader changes.

It takes the steps and applied changes that ``benchmarks/effect_truth.py --json PATH`` gathered
(every step of each script's run) and keeps, for one script, the steps up to ``--last`` and the
changes among them, with the load the benchmark saw: the tests replay the hook's effect
measurement over them as it ran, and compare each stated interval with the speed the config
then kept.

    .venv/bin/python benchmarks/effect_truth.py --scripts demo --json /tmp/effect.json
    .venv/bin/python tests/data/make_effect_steps.py /tmp/effect.json --script demo --last 1000
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    """Cut the benchmark's steps down to the part the tests replay."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("benchmark", type=Path, help="the JSON of benchmarks/effect_truth.py")
    parser.add_argument("--script", default="demo")
    parser.add_argument("--last", type=int, default=1000, help="the last step kept")
    parser.add_argument("--out", type=Path, default=HERE / "effect_steps.json")
    args = parser.parse_args()
    data = json.loads(args.benchmark.read_text())
    raw = data["raw"][args.script]
    rows = [r for r in data["rows"] if r["script"] == args.script and r["step"] is not None]
    steps = [
        [s[0], round(s[1], 3), round(s[2], 5), round(s[3], 5), s[4], s[5], s[6]]
        for s in raw["steps"]
        if s[0] <= args.last
    ]
    changes = [
        {
            "step": r["step"],
            "config_before": r["config_before"],
            "changes": r["changes"],
            "loadavg": r["loadavg"],
        }
        for r in rows
        if r["step"] + data["after"] + data["window"] <= args.last  # its steady window is kept
    ]
    out = {
        "source": f"benchmarks/effect_truth.py, script {args.script}, {data['hogs']} CPU hogs",
        "after": data["after"],
        "window": data["window"],
        "cpu": data.get("cpu", ""),
        "steps": steps,
        "changes": changes,
    }
    args.out.write_text(json.dumps(out, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
