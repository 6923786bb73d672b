"""A corrupted minority: one node of a 3-node R3 cluster has its stream files damaged while it is stopped.

300 results are stored (acknowledged by the cluster); one follower of the results stream is stopped,
its stream files are damaged (16 bytes inverted in the middle of its message block, or the block cut
in half), and it is started again. Then it is made the stream's leader, so that what
it holds is what readers see, and every acknowledged result is read back through it.

What nats-server 2.15.1 does (docs/operations.md, "What survives what"):
* 16 inverted bytes mid-block: the node logs ``indexCacheBuf corrupt record state in <file>`` and serves
  every result intact once it leads (one position tested; Jepsen found flips elsewhere that lose writes);
* a block cut in half: the node logs only ``Stream state outdated, last block has additional entries,
  will rebuild``, keeps the lost half as deleted sequences (``num_deleted`` in its ``/jsz``), reports
  itself healthy and current, and once it leads, those acknowledged results cannot be read (xfail below).
  Its two peers still hold them: stopping the node, removing its copy of the stream (the stream's
  directory and its Raft group's) and starting it again makes it copy them back.

~15 s a test on this machine (2 shared cores); no FUSE needed.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from gym_runtime.ops.nats_server import EmbeddedServer
from tests.cluster import LocalCluster, cut_last_block, monitor, stream_dir, stream_messages
from tests.pools import publish_results, wait_until

RESULTS = "GYM_RESULTS_agent"
N = 300


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path / "nats", size=3).start()
    try:
        c.create_streams()
        anyio.run(lambda: publish_results(c.urls, range(N)))
        yield c
    finally:
        c.stop()


def _replica(c: LocalCluster, node: EmbeddedServer) -> dict:
    """``node``'s own copy of the results stream, as its monitoring endpoint reports it."""
    data = monitor(node, "/jsz?streams=true")
    return next(s for a in data["account_details"] for s in a["stream_detail"] if s["name"] == RESULTS)


def _raft_dir(c: LocalCluster, node: EmbeddedServer) -> Path:
    group = _replica(c, node)["cluster"]["raft_group"]
    return Path(node.store_dir or "") / "jetstream" / "$SYS" / "_js_" / group


def _flip(path: Path) -> None:
    """Invert 16 bytes in the middle of ``path``."""
    with open(path, "r+b") as f:
        size = f.seek(0, 2)
        f.seek(size // 2)
        chunk = f.read(16)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))


def _damage(c: LocalCluster, how: str) -> EmbeddedServer:
    """Stop a follower of the results stream, damage its files ``how``, start it again: the node."""
    acked = stream_messages(c.urls, RESULTS)
    assert acked is not None and len(acked) == N
    leader = c.stream_leader(RESULTS)
    victim = next(n for n in c.nodes if n.server_name != leader)
    victim.stop()
    if how == "flip":
        blocks = sorted((stream_dir(victim, RESULTS) / "msgs").glob("*.blk"))
        assert blocks
        _flip(blocks[-1])
    else:
        cut_last_block(victim, RESULTS)
    victim.start()
    c.wait_ready(60)
    return victim


def _log(node: EmbeddedServer) -> str:
    return Path(node.log_file or "").read_text(errors="replace")


def test_flipped_bits_on_one_node_are_reported_and_lose_nothing(cluster: LocalCluster) -> None:
    acked = stream_messages(cluster.urls, RESULTS)
    victim = _damage(cluster, "flip")
    assert "corrupt record state" in _log(victim)  # the report: nats-server's log names the damaged file
    cluster.move_leader(RESULTS, victim.server_name or "")  # what the damaged node holds is what is read
    assert stream_messages(cluster.urls, RESULTS) == acked


def test_a_truncated_block_on_one_node_shows_in_its_jsz_and_a_resync_repairs_it(cluster: LocalCluster) -> None:
    """What happens today, step by step, and the repair docs/operations.md gives."""
    acked = stream_messages(cluster.urls, RESULTS)
    victim = _damage(cluster, "truncate")
    assert "Stream state outdated" in _log(victim)  # the only line in its log
    mine = _replica(cluster, victim)["state"]
    assert mine["messages"] < N and mine.get("num_deleted", 0) == N - mine["messages"]  # holes, not a shorter log
    for peer in (n for n in cluster.nodes if n is not victim):
        assert _replica(cluster, peer)["state"]["messages"] == N  # the majority holds every result
    assert stream_messages(cluster.urls, RESULTS) == acked  # read through a healthy leader: all there
    # the repair: the node's copy of the stream removed while it is stopped; it copies it back from its peers
    raft = _raft_dir(cluster, victim)
    victim.stop()
    shutil.rmtree(stream_dir(victim, RESULTS))
    shutil.rmtree(raft)
    victim.start()
    cluster.wait_ready(60)
    wait_until(lambda: _replica(cluster, victim)["state"]["messages"] == N, timeout=60)
    cluster.move_leader(RESULTS, victim.server_name or "")
    assert stream_messages(cluster.urls, RESULTS) == acked


@pytest.mark.xfail(
    strict=True,
    reason="nats-server 2.15.1: a replica whose block was cut in half keeps the lost half as deleted sequences "
    "(healthy, current, never copied back from its peers); once that node leads the stream, those acknowledged "
    "results are gone for every reader (a get answers 'no message found'; a consumer skips them: 151 of 300 delivered "
    "in a probe) - nats-server issue #7549's kind",
)
def test_a_truncated_block_on_one_node_loses_nothing_when_it_leads(cluster: LocalCluster) -> None:
    acked = stream_messages(cluster.urls, RESULTS)
    victim = _damage(cluster, "truncate")
    cluster.move_leader(RESULTS, victim.server_name or "")
    assert stream_messages(cluster.urls, RESULTS) == acked
