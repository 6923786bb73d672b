"""Acknowledged means on disk: the servers gym-runtime starts sync every write before acknowledging it,
unless the config or ``server --sync`` asks for nats-server's 2-minute interval."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from gym_runtime.config import load_config
from gym_runtime.errors import ConfigError
from gym_runtime.ops.nats_server import EmbeddedServer


def _sync_always(srv: EmbeddedServer) -> bool:
    assert srv.monitor_url is not None
    with urllib.request.urlopen(f"{srv.monitor_url}/varz", timeout=5) as r:
        return json.loads(r.read())["jetstream"]["config"].get("sync_always") is True


def test_a_started_server_syncs_before_acknowledging_unless_told_interval(tmp_path: Path) -> None:
    with EmbeddedServer(store_dir=str(tmp_path / "a"), http_port=0) as srv:
        assert _sync_always(srv)
    with EmbeddedServer(store_dir=str(tmp_path / "b"), http_port=0, sync="interval") as srv:
        assert not _sync_always(srv)


def test_a_temporary_store_deleted_at_stop_is_not_synced() -> None:
    """``run``'s and ``Client``'s embedded store: nothing reads it after a crash, so a sync would buy nothing."""
    with EmbeddedServer(http_port=0) as srv:
        assert not _sync_always(srv)


def test_jetstream_sync_is_read_from_the_config_and_a_wrong_value_names_the_key(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("jetstream: {sync: interval}\n")
    assert load_config(str(cfg)).jetstream.sync == "interval"
    cfg.write_text("jetstream: {sync: sometimes}\n")
    with pytest.raises(ConfigError, match="jetstream.sync"):
        load_config(str(cfg))
