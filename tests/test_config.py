"""Config files, command-line overrides, and bad input caught before any compile."""

import dataclasses
import json

import pytest

from hetjax import cli
from hetjax import config as config_lib
from hetjax import train
from hetjax.compile import aot
from hetjax.errors import ConfigError


def test_config_names_resolve_to_the_same_file():
    paths = {config_lib.find_config_file(n).resolve() for n in ("configs/tiny.py", "tiny.py", "tiny")}
    assert len(paths) == 1


def test_a_config_path_with_a_folder_is_that_file_or_an_error_never_the_shipped_one(tmp_path, monkeypatch):
    """`../exp/tiny` (the user's own tiny.py, .py left out) and `../expp/tiny.py` (a typo
    in the folder) both trained the shipped configs/tiny.py without a word; a run's
    config.json as --config was an AttributeError traceback."""
    (tmp_path / "exp").mkdir()
    (tmp_path / "work").mkdir()
    mine = (tmp_path / "exp" / "tiny.py")
    mine.write_text(config_lib.find_config_file("tiny").read_text().replace('name="tiny"', 'name="mine"'))
    monkeypatch.chdir(tmp_path / "work")
    assert config_lib.find_config_file("../exp/tiny") == config_lib.find_config_file("../exp/tiny.py")
    assert config_lib.load("../exp/tiny").name == "mine"
    with pytest.raises(ConfigError, match="'../expp/tiny.py': no such config file"):
        config_lib.find_config_file("../expp/tiny.py")
    assert config_lib.load("tiny").name == "tiny" and config_lib.load("configs/tiny.py").name == "tiny"
    (tmp_path / "work" / "config.json").write_text(json.dumps(config_lib.to_dict(config_lib.load("tiny"))))
    with pytest.raises(ConfigError, match="a config is a .py file defining get_config"):
        config_lib.load("config.json")


def test_published_shapes():
    llama = config_lib.load("llama8b.py").model
    assert (llama.num_layers, llama.embed_dim, llama.mlp_dim, llama.num_heads, llama.num_kv_heads,
            llama.vocab_size, llama.rope_theta, llama.rope_scaling_factor, llama.qkv_bias) == (
        32, 4096, 14336, 32, 8, 128256, 500000.0, 8.0, False)
    qwen = config_lib.load("qwen2_7b.py").model
    assert (qwen.num_layers, qwen.embed_dim, qwen.mlp_dim, qwen.num_heads, qwen.num_kv_heads,
            qwen.vocab_size, qwen.rope_theta, qwen.rope_scaling_factor, qwen.qkv_bias) == (
        28, 3584, 18944, 28, 4, 152064, 1e6, 1.0, True)
    for name in ("tiny", "llama8b", "qwen2_7b"):
        config_lib.validate(config_lib.load(name))


def test_overrides_are_parsed_by_field_type():
    cfg = config_lib.load("tiny", {
        "model.num_layers": "3", "optim.learning_rate": "1e-3", "model.qkv_bias": "true",
        "name": "x", "sharding.rules": "[('batch', ['data', 'fsdp'])]", "steps": "7"})
    assert cfg.model.num_layers == 3 and isinstance(cfg.model.num_layers, int)
    assert cfg.optim.learning_rate == 1e-3 and cfg.model.qkv_bias is True and cfg.name == "x"
    assert cfg.sharding.rules == (("batch", ("data", "fsdp")),)
    assert cfg.steps == 7


@pytest.mark.parametrize("key,value,message", [
    ("steps", "ten", "--config.steps='ten': expected an int"),
    ("optim.learning_rate", "nan", "--config.optim.learning_rate='nan': not finite"),
    ("optim.learning_rate", "1e999", "learning_rate='1e999': not finite"),
    ("seed", "1e999", "expected an int"),
    ("model.num_layers", "2.5", "model.num_layers"),
    ("model.qkv_bias", "maybe", "model.qkv_bias"),
    ("model.num_layer", "3", "did you mean model.num_layers"),
    ("optim.learnig_rate", "3", "did you mean optim.learning_rate"),
    ("modle.num_layers", "3", "did you mean model"),
    ("model", "3", "is a section"),
    ("pipeline.stage_layers", "2", "expected a tuple such as .2,. or"),
    ("tensorboard", "on", "expected a bool .true/false, yes/no or 1/0."),
])
def test_bad_overrides_name_the_key(key, value, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("?", r"\?")):
        config_lib.load("tiny", {key: value})


def test_command_line():
    args = cli.parse_command_line(["--config", "tiny.py", "--config.steps=5",
                                          "--config.model.dtype", "bfloat16", "--compile_only"])
    assert args.config == "tiny.py" and args.compile_only
    assert args.overrides == {"steps": "5", "model.dtype": "bfloat16"}
    with pytest.raises(ConfigError, match="did you mean --compile_only"):
        cli.parse_command_line(["--config", "tiny.py", "--compile-onyl"])
    with pytest.raises(ConfigError, match="--config is required"):
        cli.parse_command_line([])
    # `--config.KEY VALUE` whose VALUE is missing: the next option is not taken as the value
    with pytest.raises(ConfigError, match=r"--config.name: give a value.*the next argument, --config.steps=5, is"):
        cli.parse_command_line(["--config", "tiny.py", "--config.name", "--config.steps=5"])
    with pytest.raises(ConfigError, match="known configs: .*tiny"):
        config_lib.find_config_file("nope.py")
    with pytest.raises(ConfigError, match="--config given twice \\('tiny', then 'llama8b'\\)"):
        cli.parse_command_line(["--config", "tiny", "--config=llama8b"])  # the second won, silently


def test_settings_that_a_config_cannot_use_are_refused_not_ignored():
    """Each was accepted and did nothing: an islands job's own config.mesh (islands run on
    their own meshes), islands' settings without islands, W&B settings without a project;
    an island's field could not be overridden, and the error said nothing of how to."""
    hetero = config_lib.load("tiny_hetero")
    for key, value in (("mesh.tensor", "2"), ("mesh.fsdp", "1"), ("mesh.data", "2")):
        with pytest.raises(ConfigError, match=rf"config.{key}={value} with config.hetero.islands: .*islands\[k\].mesh"):
            config_lib.validate(config_lib.load("tiny_hetero", {key: value}))
    config_lib.validate(hetero)
    for key, value in (("hetero.placement", "dta"), ("hetero.island_layers", "(1,1)"), ("hetero.auto_split", "true")):
        with pytest.raises(ConfigError, match=rf"config.{key}=.* without config.hetero.islands"):
            config_lib.validate(config_lib.load("tiny", {key: value}))
    with pytest.raises(ConfigError, match=r"config.wandb.entity='me' without config.wandb.project"):
        config_lib.validate(config_lib.load("tiny", {"wandb.entity": "me"}))
    with pytest.raises(ConfigError, match=r"'hetero.islands' is a tuple of sections: override them in a config "
                                          r"file of your own.*dataclasses.replace"):
        config_lib.load("tiny_hetero", {"hetero.islands.0.mesh.fsdp": "1"})
    with pytest.raises(ConfigError, match=r"config.hetero.link.backend='bogus'"):  # links serve every pair
        config_lib.validate(dataclasses.replace(hetero, hetero=dataclasses.replace(
            hetero.hetero, links=(hetero.hetero.link,), link=dataclasses.replace(hetero.hetero.link, backend="bogus"))))


def test_resolved_config_round_trips_as_json(tmp_path):
    cfg = config_lib.load("tiny", {"steps": "9"})
    config_lib.save(cfg, tmp_path / "config.json")
    assert json.loads((tmp_path / "config.json").read_text())["steps"] == 9


@pytest.fixture
def no_compile(monkeypatch):
    """Fails the test if anything reaches the compiler."""
    def refuse(*args, **kwargs):
        raise AssertionError("compiled before rejecting the config")
    monkeypatch.setattr(aot, "compile", refuse)


@pytest.mark.parametrize("overrides,message", [
    # 8 devices, but the mesh asks for 3.
    (["--config.mesh.data=3", "--config.mesh.fsdp=1"], r"config.mesh .* has 3 devices but 8"),
    (["--config.mesh.data=3"], r"config.mesh.fsdp=-1 cannot take the rest"),
    # The tensor axis must divide heads, KV heads and the MLP width.
    (["--config.mesh.fsdp=2", "--config.mesh.tensor=4", "--config.model.num_heads=6",
      "--config.model.num_kv_heads=2"], r"config.model.num_heads=6 does not split over config.mesh.tensor=4"),
    (["--config.mesh.fsdp=2", "--config.mesh.tensor=4"], r"config.model.num_kv_heads=2 does not split"),
    (["--config.mesh.fsdp=2", "--config.mesh.tensor=4", "--config.model.num_kv_heads=4",
      "--config.model.mlp_dim=90"], r"config.model.mlp_dim=90 does not split"),
    # Rules that name a logical axis the model does not have, or a mesh axis that does not exist.
    (["--config.sharding.rules=" + repr(tuple(dict(config_lib.DEFAULT_RULES, embd="fsdp").items()))],
     r"unknown logical axis 'embd'; did you mean 'embed'"),
    (["--config.sharding.rules=(('batch', 'dta'),)"], r"'dta' is not a mesh axis"),
    (["--config.sharding.rules=(('batch', 'data'),)"], r"no rule for logical axes"),
    (["--config.sharding.rules=(('batch', 3),)"], r"config.sharding.rules\[0\]=\('batch', 3\): the target must be"),
    (["--config.optim.warmup_steps=20", "--config.optim.decay_steps=10"],
     r"config.optim.decay_steps=10 is not above config.optim.warmup_steps=20: it counts from step 0"),
    (["--config.model.num_heads=5"], r"num_heads=5 is not a multiple of config.model.num_kv_heads=2"),
    (["--config.model.remat=some"], r"config.model.remat='some'"),
    (["--config.batch_size=10", "--config.optim.grad_accum_steps=4"], r"config.batch_size=10"),
    (["--config.model.num_layres=4"], r"did you mean model.num_layers"),
    (["--config.steps=1.5"], r"--config.steps='1.5': expected an int"),
    # The global batch (and each micro-batch) must split over the batch's mesh axes.
    (["--config.batch_size=7"], r"config.batch_size=7 does not split evenly over config.mesh.data=1 x "
                                r"config.mesh.fsdp=8 .*multiple of 8; nearest valid values: 8$"),
    (["--config.batch_size=12", "--config.mesh.data=2", "--config.mesh.fsdp=4"],
     r"config.batch_size=12 does not split evenly over config.mesh.data=2 x config.mesh.fsdp=4 .*"
     r"multiple of 8; nearest valid values: 8 or 16"),
    # Rows of a micro-batch that the devices cannot share: every device computed rows others did too.
    (["--config.batch_size=16", "--config.optim.grad_accum_steps=4"],
     r"a micro-batch of config.batch_size/config.optim.grad_accum_steps = 16/4 = 4 rows does not split over "
     r"data x fsdp = 8 devices"),
    (["--config.optim.learning_rate=-1e-3"], r"config.optim.learning_rate=-0.001: must not be negative"),
    (["--config.optim.learning_rate=inf"], r"config.optim.learning_rate='inf': not finite"),
    (["--config.optim.min_lr_ratio=5"], r"config.optim.min_lr_ratio=5.0: .* must lie in \[0, 1\]"),
    (["--config.optim.eps=0"], r"config.optim.eps=0.0: must be above 0"),  # 0/0 at a zero gradient
    # Values that used to pass and then divide by zero, train silently wrong or write elsewhere.
    (["--config.memory_fraction=0"], r"config.memory_fraction=0.0: .* must lie in \(0, 1\]"),
    (["--config.memory_fraction=5"], r"config.memory_fraction=5.0"),
    (["--config.device_memory_gib=-1"], r"config.device_memory_gib=-1.0: must not be negative"),
    (["--config.eval_every=1", "--config.eval_batches=0"], r"config.eval_batches=0: must be positive"),
    (["--config.eval_every=-5"], r"config.eval_every=-5: use 0"),
    (["--config.data.seed=-1"], r"config.data.seed=-1: use an integer in \[0, 2\*\*32\)"),
    (["--config.seed=99999999999999999999"], r"config.seed=99999999999999999999: use an integer"),
    (["--config.model.norm_eps=-1"], r"config.model.norm_eps=-1.0: must be positive"),
    (["--config.model.rope_theta=0"], r"config.model.rope_theta=0.0: must be positive"),
    (["--config.model.rope_scaling_factor=8", "--config.model.rope_low_freq_factor=4"],
     r"rope_low_freq_factor=4.0 and rope_high_freq_factor=4.0: need 0 < low < high"),
    (["--config.run_dir="], r"config.run_dir='': give the run's directory"),
    (["--config.model.attention_impl=cudnn"], r"attention_impl='cudnn' runs on CUDA GPUs only, and this run is on cpu"),
    (["--config.steps=2", "--config.profile_steps=5:7"], r"step 5 is not below config.steps=2"),
    # The same when config.mesh.pipeline=-1 comes to 1 stage on this mesh (and an uneven split).
    (["--config.mesh.pipeline=-1", "--config.mesh.fsdp=8", "--config.pipeline.virtual_stages=2",
      "--config.pipeline.schedule=1f1b_fused"], r"config.pipeline.virtual_stages=2 with config.mesh.pipeline=-1, "
                                                r"which is 1 stage on this mesh"),
    (["--config.mesh.pipeline=-1", "--config.mesh.fsdp=8", "--config.model.num_layers=4",
      "--config.pipeline.stage_layers=(1,3)"], r"config.pipeline.stage_layers=\(1, 3\) with config.mesh.pipeline=-1"),
    # Interleaved chunks without pipeline stages used to train plain fsdp under the V=2 name.
    (["--config.pipeline.virtual_stages=2", "--config.pipeline.schedule=1f1b_fused"],
     r"config.pipeline.virtual_stages=2 with config.mesh.pipeline=1: .* set config.mesh.pipeline > 1"),
    (["--config.sharding.rules=" + repr(tuple(dict(config_lib.DEFAULT_RULES, batch=("fsdp", "fsdp")).items()))],
     r"mesh axis 'fsdp' is named twice"),
])
def test_bad_configs_fail_before_compiling(overrides, message, no_compile, tmp_path):
    argv = ["--config", "tiny.py", f"--config.run_dir={tmp_path / 'run'}", *overrides]
    with pytest.raises(ConfigError, match=message):
        train.main(argv)
    assert not (tmp_path / "run").exists()  # nothing written either


@pytest.mark.parametrize("assignment,message", [
    ("steps=2.5", r"config.steps=2.5: expected an int, got a float"),
    ("batch_size='16'", r"config.batch_size='16': expected an int, got a str"),
    ("tensorboard='no'", r"config.tensorboard='no': expected a bool"),
    ("mesh={'fsdp': -1}", r"config.mesh=\{'fsdp': -1\}: expected a MeshConfig\(...\) section"),
    ("model=dataclasses.replace(cfg.model, num_layers=2.0)", r"config.model.num_layers=2.0: expected an int"),
    ("sharding=dataclasses.replace(cfg.sharding, rules=[('batch', 'fsdp')])", r"expected a tuple"),
])
def test_a_config_file_s_values_are_checked_by_type_as_overrides_are(assignment, message, no_compile, tmp_path):
    path = tmp_path / "typed.py"
    path.write_text("import dataclasses\nfrom hetjax.config import load\n\n"
                    f"def get_config():\n    cfg = load('tiny')\n    return dataclasses.replace(cfg, {assignment})\n")
    with pytest.raises(ConfigError, match=message):
        train.main(["--config", str(path), f"--config.run_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()


def test_cli_exits_with_the_message(capsys, monkeypatch, no_compile):
    monkeypatch.setattr("sys.argv", ["hetjax.train", "--config", "tiny.py", "--config.mesh.data=3"])
    assert train.cli() == 2
    assert "config.mesh" in capsys.readouterr().err


def test_frozen():
    cfg = config_lib.load("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.steps = 3
