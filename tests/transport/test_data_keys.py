"""`deltarl keys` makes the data plane's keys beside the CURVE keys, adds them to an older
directory, and a key others may read, or one missing, is a configuration error (exit 78)."""

from __future__ import annotations

import os
import shutil
import ssl
from pathlib import Path

import pytest

from deltarl.config.errors import ConfigError
from deltarl.transport.curve import CurveKeys, make_keys
from deltarl.transport.data_keys import DataKeyError, DataKeys


def test_keys_make_a_mac_key_and_a_tls_identity_signed_by_a_discarded_ca(tmp_path: Path) -> None:
    d = make_keys(tmp_path / "keys")
    keys = DataKeys.load(d)
    assert len(keys.mac_key) == 32
    assert os.stat(d / "data.key").st_mode & 0o777 == 0o600
    assert os.stat(keys.key).st_mode & 0o777 == 0o600
    # no CA private key anywhere: nobody can issue another identity from this directory
    assert not any("ca" in p.name and p.name.endswith(".key") for p in d.rglob("*"))
    assert keys.server_context().minimum_version == ssl.TLSVersion.TLSv1_3
    assert keys.client_context().verify_mode == ssl.CERT_REQUIRED
    # two clusters: two different keys
    assert DataKeys.load(make_keys(tmp_path / "other")).mac_key != keys.mac_key


def test_an_older_directory_gets_only_what_it_lacks(tmp_path: Path) -> None:
    d = make_keys(tmp_path / "keys")
    curve = CurveKeys.load(d)
    (d / "data.key").unlink()
    shutil.rmtree(d / "tls")
    with pytest.raises(DataKeyError, match="deltarl keys"):
        DataKeys.load(d)
    make_keys(d)
    assert CurveKeys.load(d) == curve  # the CURVE keys were not replaced
    DataKeys.load(d)
    with pytest.raises(FileExistsError, match="every key"):
        make_keys(d)


def test_a_secret_others_may_read_is_refused(tmp_path: Path) -> None:
    d = make_keys(tmp_path / "keys")
    os.chmod(d / "data.key", 0o644)
    with pytest.raises(DataKeyError, match="0644"):
        DataKeys.load(d)
    os.chmod(d / "data.key", 0o600)
    os.chmod(d / "tls" / "node.key", 0o640)
    with pytest.raises(ConfigError, match="0640"):
        DataKeys.load(d)
    os.chmod(d / "tls" / "node.key", 0o600)
    (d / "data.key").write_text("zz\n")
    with pytest.raises(DataKeyError, match="not hex"):
        DataKeys.load(d)
