"""Weights & Biases: a job logs one run (offline here: no network), whose history is
metrics.jsonl row for row, with each island's series and the resolved config attached.
The run is read back from its .wandb file: wandb's own Record protobufs in a LevelDB log."""

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetjax.compile import backend
from hetjax.config import Config, ConfigError, validate
from hetjax.errors import MissingExtra
from hetjax.metrics import WandbConfig

ROOT = Path(__file__).resolve().parent.parent


def wandb_records(path: Path) -> list:
    """Every Record of a .wandb file (LevelDB's log format: 32 KiB blocks of chunks, each
    with a 7-byte header: crc32c, length, type FULL=1 FIRST=2 MIDDLE=3 LAST=4)."""
    from wandb.proto import wandb_internal_pb2
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, out, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # the block's tail is padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            pos += room
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def test_an_islands_job_logs_one_offline_run_whose_history_is_its_metrics(tmp_path):
    pytest.importorskip("wandb")
    run_dir = tmp_path / "run"
    # Offline, and any attempt at the network would go nowhere.
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", WANDB_MODE="offline", WANDB_SILENT="true",
               WANDB_BASE_URL="http://127.0.0.1:9", HTTPS_PROXY="http://127.0.0.1:9", HTTP_PROXY="http://127.0.0.1:9",
               XLA_FLAGS=backend.with_cpu_device_count(os.environ["XLA_FLAGS"], 4))
    r = subprocess.run([sys.executable, "-m", "hetjax.train", "--config", "tiny_hetero", f"--config.run_dir={run_dir}",
                        "--config.steps=3", "--config.eval_every=0",
                        "--config.tensorboard=false", "--config.checkpoint.every=0",
                        "--config.wandb.project=hetjax-test", "--config.wandb.group=job7"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    files = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files  # one run for the whole job
    records = wandb_records(files[0])
    runs = [x.run for x in records if x.WhichOneof("record_type") == "run"]
    assert len(runs) == 1 and runs[0].display_name == "tiny_hetero" and runs[0].run_group == "job7"
    assert runs[0].run_id == (run_dir / "wandb_run_id").read_text().strip()  # a restart continues it
    attached = {u.key: json.loads(u.value_json) for u in runs[0].config.update}
    saved = json.loads((run_dir / "config.json").read_text())
    assert {k: attached[k] for k in saved} == saved  # the resolved config, overrides included
    assert saved["wandb"]["project"] == "hetjax-test" and saved["steps"] == 3

    logged = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in x.history.item}
              for x in records if x.WhichOneof("record_type") == "history"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(logged) == len(rows) == 3
    for row, got in zip(rows, logged):
        assert {k: got[k] for k in row} == row  # every value, bit for bit
    for island in ("cuda", "rocm"):  # each island's times as series of their own
        assert all(f"{island}/step_time" in got and f"{island}/transfer_time" in got
                   for got in logged)


def test_a_bad_wandb_mode_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"config\.wandb\.mode='ofline'.*'offline'"):
        validate(Config(wandb=WandbConfig(mode="ofline")))


def test_an_online_run_without_a_wandb_login_is_refused_before_compiling(monkeypatch, tmp_path):
    pytest.importorskip("wandb")
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # no such file: no login
    with pytest.raises(ConfigError, match=r"not logged in to W&B.*wandb login.*--config\.wandb\.mode=offline"):
        validate(Config(wandb=WandbConfig(project="p")))
    validate(Config(wandb=WandbConfig(project="p", mode="offline")))
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    validate(Config(wandb=WandbConfig(project="p")))


def test_the_mode_is_found_where_wandb_finds_it_and_a_team_in_the_project_is_refused(monkeypatch, tmp_path):
    """Each failed only after the step compiled, or refused a run wandb would take:
    'team/project' (wandb's UsageError), WANDB_MODE=bogus or empty (a pydantic error),
    WANDB_MODE=shared, an online mode, with no login (wandb's "No API key"); and a run
    after `wandb offline` (./wandb/settings) was refused as not logged in."""
    pytest.importorskip("wandb")
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # no such file: no login
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    (tmp_path / "config").mkdir()
    (tmp_path / "work" / "wandb").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work")
    with pytest.raises(ConfigError, match=r"config\.wandb\.project='myteam/hetjax': .* / .*config\.wandb\.entity=myteam"):
        validate(Config(wandb=WandbConfig(project="myteam/hetjax", mode="offline")))
    for bad in ("bogus", ""):
        monkeypatch.setenv("WANDB_MODE", bad)
        with pytest.raises(ConfigError, match=f"WANDB_MODE='{bad}' is not a W&B mode: use one of online, offline"):
            validate(Config(wandb=WandbConfig(project="p")))
    monkeypatch.setenv("WANDB_MODE", "shared")
    with pytest.raises(ConfigError, match="not logged in"):
        validate(Config(wandb=WandbConfig(project="p")))
    monkeypatch.delenv("WANDB_MODE")
    with pytest.raises(ConfigError, match="not logged in"):
        validate(Config(wandb=WandbConfig(project="p")))
    for settings in (tmp_path / "work" / "wandb" / "settings", tmp_path / "config" / "settings"):
        settings.write_text("[default]\nmode = offline\n")  # what `wandb offline` writes
        validate(Config(wandb=WandbConfig(project="p")))
        settings.unlink()
    (tmp_path / "config" / "settings").write_text("[default]\nmode = ofline\n")
    with pytest.raises(ConfigError, match=r"mode in .*config/settings='ofline' is not a W&B mode"):
        validate(Config(wandb=WandbConfig(project="p")))


def test_a_login_to_a_self_hosted_server_is_found_where_wandb_finds_it(monkeypatch, tmp_path):
    """`wandb login` keys .netrc by host and port, and `wandb login --host URL` keeps the
    server in wandb's settings file: both logins were refused as "not logged in"."""
    from urllib.parse import urlparse
    wandb = pytest.importorskip("wandb")
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text("".join(f"machine {m}\n  login user\n  password {'x' * 40}\n"
                             for m in ("wandb.example.com:8443", "wandb.corp.example")))
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com:8443")
    validate(Config(wandb=WandbConfig(project="p")))
    monkeypatch.delenv("WANDB_BASE_URL")
    with pytest.raises(ConfigError, match="not logged in"):  # wandb's default server has no entry
        validate(Config(wandb=WandbConfig(project="p")))
    (tmp_path / "wandb").mkdir()
    (tmp_path / "wandb" / "settings").write_text("[default]\nbase_url = https://wandb.corp.example\n")
    validate(Config(wandb=WandbConfig(project="p")))
    # A login to api.wandb.ai, which wandb also reads for its newer default server.
    netrc.write_text(f"machine api.wandb.ai\n  login user\n  password {'x' * 40}\n")
    (tmp_path / "wandb" / "settings").unlink()
    validate(Config(wandb=WandbConfig(project="p")))
    (tmp_path / "wandb" / "settings").write_text("[default]\nbase_url = https://wandb.corp.example\n")
    # And a login to wandb's own default server, whichever it is in this version.
    (tmp_path / "wandb" / "settings").unlink()
    default = urlparse(wandb.Settings().base_url).netloc
    netrc.write_text(f"machine {default}\n  login user\n  password {'x' * 40}\n")
    validate(Config(wandb=WandbConfig(project="p")))


def test_a_wandb_project_without_wandb_installed_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(MissingExtra, match=r"config\.wandb\.project='p'.*pip install 'hetjax\[wandb\]'"):
        validate(Config(wandb=WandbConfig(project="p")))
    validate(Config())  # no project: wandb is never imported


def test_a_run_that_fails_is_marked_failed_in_wandb(tmp_path, monkeypatch):
    """train.py closes its writer in a `finally`; a crashed or diverged run used to be
    recorded as finished with exit code 0."""
    pytest.importorskip("wandb")
    from hetjax import metrics
    for k, v in dict(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_BASE_URL="http://127.0.0.1:9",
                     HTTPS_PROXY="http://127.0.0.1:9", HTTP_PROXY="http://127.0.0.1:9").items():
        monkeypatch.setenv(k, v)
    codes = []
    for name, failed in (("ok", False), ("failed", True)):
        run_dir = tmp_path / name
        run_dir.mkdir()
        writer = metrics.Writer(run_dir, 2, tensorboard=False,
                                wandb=metrics.WandbRun(WandbConfig(project="hetjax-test"), run_dir, {"name": name}))
        writer.write(0, {"loss": 1.0})
        writer.close(failed=failed)
        path, deadline, exits = next(run_dir.glob("wandb/offline-run-*/run-*.wandb")), time.monotonic() + 30, []
        while not exits and time.monotonic() < deadline:  # wandb's service may write it just after finish()
            exits = [x.exit.exit_code for x in wandb_records(path) if x.WhichOneof("record_type") == "exit"]
            time.sleep(0.2)
        codes += exits
    assert codes == [0, 1]
