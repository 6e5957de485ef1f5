"""Which stores the offline verbs read (cli.common.store_roots): the host's, then the analyst's import store."""

from __future__ import annotations


def test_offline_verbs_read_the_host_store_then_the_import_store(tmp_path, monkeypatch):
    """Root too: without options the offline verbs read the configured store and then ~/.debug; --store-root
    alone reads that store alone; --debug-dir adds the analyst's store back."""
    from argparse import Namespace

    from buildidd.cli.common import store_roots
    from buildidd.config import Config

    system, mine, other = tmp_path / "system", tmp_path / "home/.debug", tmp_path / "other"
    for d in (system, mine, other):
        d.mkdir(parents=True)
    cfg = Config(store_root=str(system))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert store_roots(cfg, Namespace(store_root=None, debug_dir=None)) == [str(system), str(mine)]
    assert store_roots(cfg.replace(store_root=str(other)), Namespace(store_root=str(other), debug_dir=None)) \
        == [str(other)]
    assert store_roots(cfg.replace(store_root=str(other)), Namespace(store_root=str(other), debug_dir=str(mine))) \
        == [str(other), str(mine)]
    assert store_roots(Config(store_root=str(tmp_path / "absent")), Namespace(store_root=None, debug_dir=None)) \
        == [str(mine)]
    assert store_roots(Config(store_root=""), Namespace(store_root="", debug_dir=str(other))) == [str(other)]
