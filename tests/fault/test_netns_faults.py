"""Network faults on the netns lab (every daemon in its own network namespace): the
metanode leader partitioned away, then a whole zone, then 5% packet loss on every
link, under the chaos workload."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator

import pytest

from cachefs.lab import netns
from cachefs.lab.chaos import Chaos, running_chaos

pytestmark = [pytest.mark.slow, pytest.mark.needs_fuse]


@pytest.fixture(scope="module")
def chaos(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chaos]:
    reason = netns.netns_supported()
    if reason:
        pytest.skip(f"network namespaces are not usable here: {reason}")
    if shutil.which("nsenter") is None:
        pytest.skip("nsenter is not installed")
    with running_chaos(tmp_path_factory.mktemp("chaosnet"), seed=11, netns_subnet=netns.DEFAULT_SUBNET) as c:
        yield c


def test_partition_the_metanode_leader(chaos: Chaos) -> None:
    row = chaos.partition_leader()
    assert row.lost == 0, row.lost_detail
    assert row.acknowledged > 0 and row.verified > 0


def test_partition_a_zone(chaos: Chaos) -> None:
    # ec:2+1 over three zones: a zone is a datanode, so writes may be refused
    # (write quorum K+1); reads and everything acknowledged must survive.
    row = chaos.partition_zone("z3")
    assert row.lost == 0, row.lost_detail
    assert row.verified > 0


def test_drop_5_percent_of_packets_on_all_links(chaos: Chaos) -> None:
    """5% loss each way on every link (daemons and client) while files, namespace changes and
    fio go through the mount: every acknowledged one is intact, under loss and after heal."""
    reason = netns.loss_supported()
    if reason:
        pytest.skip(f"packet loss needs nftables: {reason}")
    net = chaos.lab.network
    row = chaos.packet_loss(5)
    assert row.lost == 0, row.lost_detail
    assert row.injected == len(net.endpoints)
    assert row.acknowledged > 0 and row.verified > 0
    assert chaos.packets_dropped > 0  # the loss was real: nftables dropped packets
    assert net.loss == {} and net.cut_links == {}
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=True).stdout
    assert net.prefix not in tables  # heal removed the loss rules from the host
