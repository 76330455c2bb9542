"""The fault-injection matrix (:mod:`cachefs.lab.chaos`) as a benchmark: every fault
under load on a fresh lab, then a check of everything acknowledged.

    python -m bench.chaos [--quick] [--json] [--netns]
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import click

from bench.common import print_table
from cachefs.lab import netns
from cachefs.lab.chaos import Chaos, full_config, quick_config, totals
from cachefs.testing.fuse import fuse_unavailable


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--quick", is_flag=True, help="The small lab (3 datanodes, ec:2+1) and a short workload.")
@click.option("--base-port", default=23000, show_default=True)
@click.option("--seed", default=1, show_default=True)
@click.option("--netns", "use_netns", is_flag=True,
              help="Run the lab on network namespaces and add the network faults (partitions, packet loss).")
def main(as_json: bool, quick: bool, base_port: int, seed: int, use_netns: bool) -> None:
    if reason := fuse_unavailable():
        raise click.ClickException(f"{reason}: the matrix runs real FUSE mounts and processes")
    root = tempfile.mkdtemp(prefix="cachefs-chaos-")
    mnt = Path(tempfile.mkdtemp(prefix="cachefs-chaos-mnt-"))
    config = (quick_config if quick else full_config)(root, base_port)
    if use_netns:
        reason = netns.netns_supported()
        if reason:
            raise click.ClickException(f"--netns: network namespaces are not usable here: {reason}")
        config.netns = netns.DEFAULT_SUBNET
    chaos = Chaos(config, mnt, quick=quick, seed=seed)
    started = time.monotonic()
    failed = True
    try:
        chaos.up()
        for scenario in chaos.scenarios():
            click.echo(f"... {scenario.__name__}", err=True)
            row = scenario()
            click.echo(f"    {asdict(row)}", err=True)
        under_replicated = chaos.settle_repairs()
        failed = False
    finally:
        chaos.down()
        if failed:  # keep the logs of a run that broke
            click.echo(f"the lab's data and logs are in {root}", err=True)
        else:
            shutil.rmtree(root, ignore_errors=True)
        if not os.path.ismount(mnt):
            mnt.rmdir()
    result = {**totals(chaos.rows), "power_cuts": chaos.power_cuts,
              "under_replicated_after_recovery": under_replicated,
              "hostile_messages_survived": chaos.hostile_messages_survived, "quick": quick,
              "seconds": round(time.monotonic() - started, 1), "policy": config.policy}
    if as_json:
        click.echo(json.dumps(result))
        return
    print_table(
        f"cachefs fault matrix ({config.policy}, {'quick' if quick else 'full'} lab)",
        ["fault", "injected", "acknowledged", "verified", "data lost", "recover s", "note"],
        [[r.fault, r.injected, r.acknowledged, r.verified, r.lost, r.recover_s, r.note] for r in chaos.rows],
        note=f"faults injected {result['faults_injected']}, data lost {result['data_lost']}, "
             f"power cuts {result['power_cuts']}, blocks under-replicated after recovery {under_replicated}",
    )
    for r in chaos.rows:
        for detail in r.lost_detail:
            click.echo(f"LOST in {r.fault}: {detail}")


if __name__ == "__main__":
    main()
