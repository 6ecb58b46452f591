"""vjpsplit_cli.config: one rule for on/off variables, a clear error for a value it does not know."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vjpsplit_cli import config
from vjpsplit_cli.errors import VjpsplitError


@pytest.mark.parametrize("value", ["1", "true", "YES", " on "])
def test_on_values(monkeypatch, value):
    monkeypatch.setenv("VJPSPLIT_FSYNC", value)
    assert config.fsync_always() is True


@pytest.mark.parametrize("value", ["", "0", "false", "No", "OFF"])
def test_off_values(monkeypatch, value):
    monkeypatch.setenv("VJPSPLIT_FSYNC", value)
    assert config.fsync_always() is False


def test_unset_is_the_default(monkeypatch):
    monkeypatch.delenv("VJPSPLIT_DEBUG", raising=False)
    assert config.debug() is False
    assert config.flag("VJPSPLIT_DEBUG", default=True) is True


@pytest.mark.parametrize("name", ["VJPSPLIT_FSYNC", "VJPSPLIT_DEBUG"])
def test_an_unknown_value_names_the_variable(monkeypatch, name):
    monkeypatch.setenv(name, "ture")
    with pytest.raises(VjpsplitError, match=f"{name}='ture' is neither on"):
        config.flag(name)


@pytest.mark.parametrize("value", ["", "0", "off", "none", "false"])
def test_cache_dir_off(monkeypatch, value):
    monkeypatch.setenv("VJPSPLIT_CACHE_DIR", value)
    assert config.cache_dir() is None


def test_cache_dir_default_and_set(monkeypatch, tmp_path):
    monkeypatch.setenv("VJPSPLIT_CACHE_DIR", str(tmp_path / "c"))
    assert config.cache_dir() == str(tmp_path / "c")
    monkeypatch.delenv("VJPSPLIT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert config.cache_dir() == os.path.join(str(tmp_path), "vjpsplit", "jax")


def test_trust_key_paths(monkeypatch):
    monkeypatch.setenv("VJPSPLIT_TRUST_KEYS", os.pathsep.join(["a.pub", " ", "b.pub"]))
    assert config.trust_key_paths() == ["a.pub", "b.pub"]


def test_private_dir_rule(tmp_path):
    ok, why = config.ensure_private_dir(tmp_path / "new")
    assert ok and why == "" and (os.stat(tmp_path / "new").st_mode & 0o777) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    ok, why = config.ensure_private_dir(shared)
    assert not ok and "writable by others" in why
    (tmp_path / "file").write_text("x")
    assert config.ensure_private_dir(tmp_path / "file")[0] is False


def test_cli_refuses_an_unknown_debug_value(tmp_path):
    env = {**os.environ, "VJPSPLIT_DEBUG": "maybe"}
    r = subprocess.run(
        [sys.executable, "-m", "vjpsplit_cli", "inspect", str(tmp_path / "none.vjps")],
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2, r.stderr
    assert "VJPSPLIT_DEBUG='maybe'" in r.stderr and "Traceback" not in r.stderr


def test_xla_status_and_deserialize_recognition():
    from vjpsplit_cli.errors import cannot_deserialize, xla_status

    assert xla_status(RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 8 bytes")) == "RESOURCE_EXHAUSTED"
    assert xla_status(RuntimeError("INVALID_ARGUMENT: bad")) == "INVALID_ARGUMENT"
    assert xla_status(RuntimeError("the resource is exhausted")) == ""
    assert xla_status(RuntimeError("")) == ""
    assert cannot_deserialize("ValueError: Failed to deserialize StableHLO bytecode")
    assert not cannot_deserialize("ValueError: unknown op")


def test_corrupt_module_carries_its_module():
    from vjpsplit_cli.errors import CorruptModule

    e = CorruptModule("x.vjps: the bwd module's StableHLO is corrupt", "bwd", unreadable=True)
    assert isinstance(e, VjpsplitError) and e.module == "bwd" and e.unreadable
