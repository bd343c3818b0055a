"""`data_dir` (issue 56): one folder the user chose holds the state `serve` keeps (the SQLite store,
its journal and lock files beside it, the checkpoints); the default is the current folder, as before."""

from __future__ import annotations

from pathlib import Path

from rlproxy.settings import Settings


def test_the_default_is_the_current_folder(monkeypatch):
    monkeypatch.delenv("RLPROXY_DATA_DIR", raising=False)
    monkeypatch.delenv("RLPROXY_DB_URL", raising=False)
    s = Settings()
    assert (s.db_url, s.checkpoint_dir) == ("rlproxy.db", "checkpoints")


def test_state_goes_in_the_data_dir_unless_given_apart(monkeypatch, tmp_path):
    monkeypatch.delenv("RLPROXY_DB_URL", raising=False)
    monkeypatch.setenv("RLPROXY_DATA_DIR", str(tmp_path / "state"))
    s = Settings()
    assert s.db_url == str(tmp_path / "state" / "rlproxy.db")
    assert s.checkpoint_dir == str(tmp_path / "state" / "checkpoints")
    apart = Settings(db_url="postgresql://h/db", checkpoint_dir="/ckpt")
    assert (apart.db_url, apart.checkpoint_dir) == ("postgresql://h/db", "/ckpt")
    assert Path(Settings(data_dir="~/x").db_url) == Path.home() / "x" / "rlproxy.db"
