"""hetero.linkcheck: started like training (here by launch.local), every process checks
its island's links at the job's own addresses; a bad link is reported, not hidden."""

import io
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from hetjax.config import Config, ConfigError, HeteroConfig, IslandConfig, MeshConfig, ModelConfig
from hetjax.hetero import linkcheck
from hetjax.hetero.island import geometry, make_mesh
from hetjax.launch import local

# Island a: 2 processes x 2 devices; island b: 1 process x 3 devices (meshes of 4 and 3).
CONFIG = """
from hetjax.config import Config, HeteroConfig, IslandConfig, MeshConfig, ModelConfig

def get_config():
    return Config(model=ModelConfig(num_layers=2, embed_dim=96), batch_size=48, seq_len=16, run_dir={run_dir!r},
                  hetero=HeteroConfig(islands=(
                      IslandConfig(name="a", num_processes=2, devices_per_process=2, mesh=MeshConfig(fsdp=4)),
                      IslandConfig(name="b", platform="rocm", num_processes=1, devices_per_process=3,
                                   mesh=MeshConfig(fsdp=3))), timeout_s=30.0))
"""
COMMAND = [sys.executable, "-m", "hetjax.hetero.linkcheck", "--mib", "1", "--iters", "2"]


@pytest.fixture
def cfg_path(tmp_path):
    path = tmp_path / "islands.py"
    path.write_text(CONFIG.format(run_dir=str(tmp_path / "run")))
    return str(path)


def test_every_process_checks_its_links_at_the_jobs_addresses(cfg_path, capsys):
    # launch.local's own command line, the check's --mib and --iters for every process
    # (it refused them, so a local check always moved 64 MiB three times).
    code = local.main(["--config", cfg_path, "--stand_in", "cpu", "--backend", "host",
                       "--module", "hetjax.hetero.linkcheck", "--mib", "1", "--iters", "2"])
    text = capsys.readouterr().out
    assert code == 0, text
    for tag in ("a:0", "a:1", "b:0"):
        line = next(x for x in text.splitlines() if x.startswith(f"[{tag}] [linkcheck] a<->b (host): "))
        assert line.endswith("data OK") and "1.0 MiB each way" in line, line


THREE = """
from hetjax.config import Config, HeteroConfig, IslandConfig, MeshConfig, ModelConfig

def get_config():
    return Config(model=ModelConfig(num_layers=3, embed_dim=96), batch_size=24, seq_len=16, run_dir={run_dir!r},
                  hetero=HeteroConfig(islands=tuple(
                      IslandConfig(name=n, devices_per_process=d, mesh=MeshConfig(fsdp=d))
                      for n, d in (("a", 2), ("b", 1), ("c", 3))), timeout_s=30.0))
"""


def test_three_islands_check_every_pair(tmp_path):
    # Training uses every pair (a-c too: gradients and scalars), so the check does.
    path = tmp_path / "three.py"
    path.write_text(THREE.format(run_dir=str(tmp_path / "run")))
    out = io.StringIO()
    code = local.run(str(path), stand_in="cpu", backend="host", command=COMMAND[:-1] + ["1"], out=out)
    text = out.getvalue()
    assert code == 0, text
    for tag, pairs in (("a:0", ("a<->b", "a<->c")), ("b:0", ("a<->b", "b<->c")), ("c:0", ("a<->c", "b<->c"))):
        lines = [x for x in text.splitlines() if x.startswith(f"[{tag}] [linkcheck] ") and "each way" in x]
        assert [x.split("] [linkcheck] ")[1].split(" ")[0] for x in lines] == list(pairs), text
        assert all(x.endswith("data OK") for x in lines), lines


def test_islands_with_different_secrets_are_told_so(cfg_path, tmp_path):
    other = tmp_path / "other_secret"
    other.write_text("b" * 64)
    out = io.StringIO()
    code = local.run(cfg_path, {"hetero.link.timeout_s": "3"}, stand_in="cpu", backend="host", command=COMMAND,
                     island_overrides={"b": {"hetero.link.secret_file": str(other)}}, out=out)
    text = out.getvalue()
    assert code == 1, text
    assert "[linkcheck] FAILED: TransferError" in text and "the shared secrets differ" in text, text


def test_received_data_is_checked_bit_for_bit():
    cfg = Config(model=ModelConfig(num_layers=2), hetero=HeteroConfig(islands=(
        IslandConfig(name="a", num_processes=1, devices_per_process=4, mesh=MeshConfig(fsdp=4)),)))
    sharding = NamedSharding(make_mesh(geometry(cfg, 0), jax.devices()[:4]), linkcheck.SPEC)
    mine = linkcheck.pattern(64, 0, sharding)
    assert linkcheck.intact(mine, linkcheck.pattern(64, 0, sharding))
    assert not linkcheck.intact(mine, linkcheck.pattern(64, 1, sharding))
    words = np.array(mine)
    assert len(np.unique(words)) == 64  # every word differs: a shard sent to the wrong place shows
    words[17] ^= 1 << 9  # one flipped bit
    assert not linkcheck.intact(jax.device_put(words, sharding), mine)


def test_the_link_checks_options_without_the_link_check_are_refused():
    with pytest.raises(ConfigError, match="--mib=1: the link check's options; add --module hetjax.hetero.linkcheck"):
        local.main(["--config", "configs/tiny_hetero.py", "--mib", "1"])


def test_a_config_without_islands_is_refused_before_anything_starts():
    with pytest.raises(ConfigError, match="needs config.hetero.islands"):
        linkcheck.main(["--config", "configs/tiny.py", "--mib", "1"])
    with pytest.raises(ConfigError, match="--mib='0'"):
        linkcheck.main(["--config", "configs/tiny.py", "--mib", "0"])


class _Handle:
    """A transfer's handle, done: its value, or the error its wait raises."""
    first_byte, describe = None, "linkcheck"

    def __init__(self, value=None, error=None):
        self.value, self.error = value, error

    def wait(self):
        if self.error is not None:
            raise self.error
        return self.value


def test_the_check_waits_on_its_send_as_a_send(monkeypatch):
    """exchange waited on its send as on a receive: a failed send was named as the peer's
    link to us, and a send's wait was counted as the peer's (wait_peer)."""
    from types import SimpleNamespace

    import jax.numpy as jnp

    from hetjax.hetero.links import Links
    from hetjax.hetero.timeline import Timeline
    from hetjax.transfer import TransferError

    monkeypatch.setattr(linkcheck, "geometry", lambda cfg, j: SimpleNamespace(layout=lambda spec: None))
    links = object.__new__(Links)  # island a of a and b, without endpoints
    links.cfg, links.k, links.n, links.names, links.timeline = None, 0, 2, ["a", "b"], Timeline("a", 0)
    x = jnp.zeros(4, jnp.uint32)
    links.recv = lambda j, what, like, layouts: _Handle(x)
    links.send = lambda j, tree, what, layouts: _Handle()
    linkcheck.exchange(links, 1, x, "ok")
    assert set(links.timeline.seconds) == {"wait_sends", "wait_peer"}  # ours, then theirs
    links.send = lambda j, tree, what, layouts: _Handle(error=TransferError("connection reset"))
    with pytest.raises(TransferError, match="link from island a to island b: connection reset"):
        linkcheck.exchange(links, 1, x, "failed")
