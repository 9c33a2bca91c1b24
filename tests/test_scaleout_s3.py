"""Scale-out: the lakehouse on S3 (a local moto server), and object-storage settings that fail fast.

Its own file so pytest-xdist (``--dist loadfile``) runs it beside the other scale-out tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from deltalake import DeltaTable
from test_scaleout import CLI, EXTENDED, START, _child_env

from ingest.simulator import generate
from lakehouse.settings import Settings


@pytest.fixture
def s3(tmp_path: Path):
    """moto's S3 server on loopback with signature checks on: (endpoint, key id, secret)."""
    pytest.importorskip("moto", reason="pip install 'moto[server]' (dev dependency)")
    import boto3

    from orchestration.services import free_port

    port = free_port()
    log_file = open(tmp_path / "moto.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"},
                            stdout=log_file, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1",
                                   aws_access_key_id="bootstrap", aws_secret_access_key="bootstrap")
                iam.create_user(UserName="lake")  # the first 3 calls need no credentials
                break
            except Exception:  # noqa: BLE001 - server still starting
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.3)
        iam.put_user_policy(UserName="lake", PolicyName="s3", PolicyDocument=json.dumps(
            {"Version": "2012-10-17",
             "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName="lake")["AccessKey"]
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                     aws_access_key_id=key["AccessKeyId"],
                     aws_secret_access_key=key["SecretAccessKey"]).create_bucket(Bucket="lake")
        yield endpoint, key["AccessKeyId"], key["SecretAccessKey"]
    finally:
        proc.terminate()
        proc.wait(10)
        log_file.close()


def _s3_config(settings: Settings, tmp_path: Path, endpoint: str, key_id: str, secret: str,
               name: str) -> Path:
    """A settings file for an s3:// data root; the secret lives in a file of its own."""
    secret_file = tmp_path / f"{name}.secret"
    secret_file.write_text(secret)
    d = json.loads(settings.model_dump_json())
    d["data_root"] = "s3://lake/iot"
    d["spark"].update(master="local[1]", driver_memory="768m")
    d["stream"]["max_offsets_per_trigger"] = 500
    d["storage"] = {"checkpoint_root": str(tmp_path / "state"), "endpoint_url": endpoint,
                    "allow_http": True, "access_key_id": key_id,
                    "secret_access_key_file": str(secret_file)}
    cfg = tmp_path / f"{name}.json"
    cfg.write_text(json.dumps(d))
    return cfg


def _backfill(cfg: Path, *layers: str) -> subprocess.CompletedProcess:
    args = [a for layer in layers for a in ("--layer", layer)]
    return subprocess.run([*CLI, "--config", str(cfg), "backfill", *args], capture_output=True,
                          text=True, timeout=600, env=_child_env())


def test_s3_tables_backfill_restart_time_travel_and_bad_credentials(
        settings: Settings, tmp_path: Path, s3, monkeypatch) -> None:
    from test_backfill import produce
    from test_pipeline import assert_gold_matches

    from lakehouse import storage
    from lakehouse.settings import load_settings

    endpoint, key_id, secret = s3
    cfg = _s3_config(settings, tmp_path, endpoint, key_id, secret, "good")
    s = load_settings(cfg, environ={})
    assert s.table_path("silver") == "s3://lake/iot/tables/silver"
    assert s.checkpoint_path("silver") == str(tmp_path / "state" / "checkpoints" / "silver")
    red = json.dumps(s.redacted())
    assert secret not in red and key_id not in red
    opts = storage.delta_options(s)
    for k, v in opts.items():  # for helpers that open tables without explicit options
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)

    def count(table: str, version: int | None = None) -> int:
        return DeltaTable(s.table_path(table), version=version,
                          storage_options=opts).to_pyarrow_dataset().count_rows()

    msgs = generate(s, 900, devices=5, duplicates=20, malformed=10,
                    start=pd.Timestamp(START).to_pydatetime())
    if EXTENDED:  # two processes: the second resumes silver and gold from its checkpoints on S3
        produce(s, msgs[:500])
        first = _backfill(cfg, "bronze", "silver", "gold")
        assert first.returncode == 0, first.stderr[-3000:]
        assert json.loads(first.stdout.strip().splitlines()[-1])["bronze"] == 500
        bronze_v1 = DeltaTable(s.table_path("bronze"), storage_options=opts).version()
        produce(s, msgs[500:])
        second = _backfill(cfg, "bronze", "silver", "gold")
        assert json.loads(second.stdout.strip().splitlines()[-1])["bronze"] == 400
    else:  # one Spark process; bronze takes two batches of at most 500 rows (two versions)
        produce(s, msgs)
        first = second = _backfill(cfg, "bronze", "silver", "gold")
        bronze_v1 = 1  # version 0 is the empty table
    assert second.returncode == 0, second.stderr[-3000:]
    assert count("bronze") == 900 and count("silver") == 900 - 30 and count("quarantine") == 10
    assert_gold_matches(s, msgs)
    assert count("bronze", version=bronze_v1) == 500  # time travel on S3
    for out in (first, second):
        assert secret not in out.stdout + out.stderr and key_id not in out.stdout + out.stderr
    assert not (tmp_path / "state" / "tables").exists()  # tables went to S3, state stayed local
    assert (tmp_path / "state" / "checkpoints" / "bronze_silver" / "commits").is_dir()

    # a command that starts no Spark reads S3 with the settings' credentials alone (no AWS_* env)
    env = {k: v for k, v in _child_env().items() if not k.startswith("AWS_")}
    q = subprocess.run([*CLI, "--config", str(cfg), "query", "--format", "json",
                        "SELECT count(*) AS n FROM silver"], capture_output=True, text=True,
                       timeout=120, env=env)
    assert q.returncode == 0, q.stderr[-3000:]
    assert json.loads(q.stdout)[0]["n"] == 900 - 30

    if EXTENDED:
        _compact_on_s3(cfg, count, bronze_v1, secret, key_id)

    wrong = "WRONG-secret-0123456789"
    bad = _backfill(_s3_config(settings, tmp_path, endpoint, key_id, wrong, "bad"), "bronze")
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert "cannot access s3://lake/iot" in bad.stderr and "storage.secret_access_key" in bad.stderr
    assert wrong not in bad.stderr + bad.stdout and secret not in bad.stderr + bad.stdout


def _compact_on_s3(cfg: Path, count, bronze_v1: int, secret: str, key_id: str) -> None:
    """Maintenance on S3 (delta-spark through S3A): OPTIMIZE commits dataChange=false, rows kept
    (a third Spark process: extended suite only)."""
    c = subprocess.run([*CLI, "--config", str(cfg), "compact", "--table", "bronze", "--no-zorder"],
                       capture_output=True, text=True, timeout=300, env=_child_env())
    assert c.returncode == 0, c.stderr[-3000:]
    stats = json.loads(c.stdout.strip().splitlines()[-1])
    assert stats["mode"] == "compact" and stats["files_after"] == 1, stats
    assert count("bronze") == 900 and count("bronze", version=bronze_v1) == 500
    assert secret not in c.stdout + c.stderr and key_id not in c.stdout + c.stderr


def test_settings_for_object_storage_fail_fast(tmp_path: Path) -> None:
    from lakehouse.settings import SettingsError, load_settings

    with pytest.raises(SettingsError, match="checkpoint_root is required") as e:
        load_settings(environ={}, data_root="s3://lake/iot", storage={"secret_access_key": "s3cr3t"})
    assert "s3cr3t" not in str(e.value)
    with pytest.raises(SettingsError, match="gs:// is not supported"):
        load_settings(environ={}, data_root="gs://lake/iot")
    s = load_settings(environ={"IOTLAKE_STORAGE__SECRET_ACCESS_KEY": "s3cr3t-value"},
                      data_root="s3://lake/iot/", storage={"checkpoint_root": str(tmp_path)})
    assert s.data_root == "s3://lake/iot" and s.root == tmp_path.resolve()
    assert "s3cr3t-value" not in json.dumps(s.redacted()) and "s3cr3t-value" not in repr(s)
