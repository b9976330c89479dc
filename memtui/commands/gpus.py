"""`memtui gpus`: every GPU on this host, freest first."""

from __future__ import annotations

import time
from typing import Any

import click

from memtui.commands.common import fail


@click.command("gpus")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list, freest first.")
@click.option("--watch", is_flag=True, help="Refresh every --interval seconds until Ctrl-C.")
@click.option("--interval", default=2.0, show_default=True, help="Seconds between refreshes.")
@click.option(
    "--pick",
    "pick_count",
    type=int,
    default=None,
    is_flag=False,
    flag_value=1,
    help="Print the ids of the N freest GPUs for CUDA_VISIBLE_DEVICES (default 1).",
)
@click.option("--uuid", is_flag=True, help="With --pick: print GPU UUIDs instead of indices.")
def gpus_command(
    as_json: bool, watch: bool, interval: float, pick_count: int | None, uuid: bool
) -> None:
    """Every GPU on this host: free / used / total memory, utilisation, processes; freest first.

    Without an NVIDIA driver it says so on stderr and exits 1 (with or without --pick).
    """
    import json

    from memtui.core.stats import format_bytes
    from memtui.planning.gpus import NoDriver, format_gpus, host_gpus, pick

    def read() -> list[Any]:
        try:
            return host_gpus()
        except NoDriver as exc:
            fail(str(exc))
            raise

    if pick_count is not None:
        found = read()
        if pick_count < 1 or pick_count > len(found):
            fail(f"asked for {pick_count} GPU(s), this host has {len(found)}")
        click.echo(pick(found, pick_count, uuid))
        return
    while True:
        found = read()
        if as_json:
            click.echo(json.dumps([g.as_dict() for g in found], indent=2))
        else:
            if watch:
                click.clear()
            click.echo(format_gpus(found, format_bytes))
        if not watch:
            return
        try:
            time.sleep(interval)
        except KeyboardInterrupt:
            return
