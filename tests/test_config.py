import pytest

from medfed.config import BUNDLED_CONFIGS, find_config, load_config, parse_options
from medfed.errors import ConfigError
from medfed.federated.strategies.pfednet import PFedNet

BASE = """
data: {task: brats}
strategy: {name: pfednet, pfednet: {lam: 0.5}}
trainer: {rounds: 2}
output_dir: out/${strategy.name}
"""


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(BASE)
    return path


def test_overrides_and_interpolation(config_file):
    cfg = load_config(config_file, ["trainer.rounds=7", "strategy.name=fedavg"])
    assert cfg.trainer.rounds == 7
    assert cfg.trainer.local_epochs == 1  # schema default
    assert cfg.output_dir == "out/fedavg"


@pytest.mark.parametrize(
    "override, key",
    [("trainer.roundz=3", "trainer.roundz"), ("federaton.n_sites=3", "federaton"), ("logger.wandb_mode=x", "logger.wandb_mode")],
)
def test_unknown_keys_are_named(config_file, override, key):
    with pytest.raises(ConfigError, match=f"unknown config key '{key}'"):
        load_config(config_file, [override])


@pytest.mark.parametrize(
    "override, key",
    [
        ("trainer.rounds=0", "trainer.rounds"),
        ("federation.test_fraction=1.5", "federation.test_fraction"),
        ("trainer.device=tpu", "trainer.device"),
        ("federation.on_site_failure=retry", "federation.on_site_failure"),
        ("federation.update_norm_limit=1", "federation.update_norm_limit"),
        ("federation.max_consecutive_failures=0", "federation.max_consecutive_failures"),
    ],
)
def test_impossible_values_are_named(config_file, override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(config_file, [override])


def test_wrong_type_is_named(config_file):
    with pytest.raises(ConfigError, match="trainer.rounds"):
        load_config(config_file, ["trainer.rounds=many"])


def test_component_options_are_validated():
    options = parse_options(PFedNet.Options, {"name": "pfednet", "lam": 0.25, "p": "inf"}, "strategy", ignore=("name",))
    assert options.lam == 0.25 and options.p == "inf"
    with pytest.raises(ConfigError, match="unknown config key 'strategy.lamda'"):
        parse_options(PFedNet.Options, {"lamda": 1.0}, "strategy")
    with pytest.raises(ConfigError, match=r"config key 'strategy\.lam'"):
        parse_options(PFedNet.Options, {"lam": -1.0}, "strategy")
    with pytest.raises(ConfigError, match=r"config key 'strategy\.p'"):
        parse_options(PFedNet.Options, {"p": "3"}, "strategy")


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    "override, message",
    [
        ("federation.holdout=foo", r"config key 'federation\.holdout' = 'foo': expected test or validation"),
        ("federation.validation_fraction=1.5", r"config key 'federation\.validation_fraction' = 1\.5: expected a number in \[0, 1\)"),
        ("federation.validation_fraction=-0.1", r"config key 'federation\.validation_fraction' = -0\.1: expected a number in \[0, 1\)"),
        ("federation.holdout=validation", r"config key 'federation\.validation_fraction' = 0\.0: expected a number in \(0, 1\) with federation\.holdout=validation"),
        ("federation.site_sizes=[1, 2]", r"config key 'federation\.site_sizes' = \[1, 2\]: expected equal, skewed or a list of 5 relative weights"),
        ("federation.site_sizes=[1, 1, 0, 1, 1]", r"config key 'federation\.site_sizes' = \[1, 1, 0, 1, 1\]: expected positive finite weights"),
        ("federation.site_sizes=zipf", r"config key 'federation\.site_sizes' = 'zipf': expected equal, skewed or a list"),
    ],
)
def test_bad_holdout_settings_are_one_line_errors_naming_the_key(config_file, override, message):
    with pytest.raises(ConfigError, match=message) as caught:
        load_config(config_file, [override])
    assert "\n" not in str(caught.value)


def test_holdout_defaults_to_the_test_split(config_file):
    federation = load_config(config_file).federation
    assert federation.holdout == "test" and federation.validation_fraction == 0.0 and federation.site_sizes == "equal"
    overrides = ["federation.holdout=validation", "federation.validation_fraction=0.2"]
    assert load_config(config_file, overrides).federation.holdout == "validation"


@pytest.mark.parametrize("text, value", [("Yes", "Yes"), ("no", "no"), ("on", "on"), ("'true'", "true"), ("true", True), ("False", False)])
def test_yaml_12_booleans_keep_yes_and_no_as_strings(config_file, text, value):
    config_file.write_text(BASE.replace("data: {task: brats}", f"data: {{task: clinical, positive: {text}}}"))
    assert load_config(config_file).data.positive == value
    assert load_config(config_file, [f"data.positive={text}"]).data.positive == value


def test_typed_booleans_and_exponent_floats_still_parse(config_file):
    cfg = load_config(config_file, ["strategy.pfednet.graph_standardize=yes", "strategy.pfednet.server_lr=1e-3"])
    assert cfg.strategy.pfednet.server_lr == 0.001  # YAML 1.1 would have kept '1e-3' a string


@pytest.mark.parametrize(
    "text, message",
    [
        ("data: [brats\n", r"run\.yaml: not valid YAML at line 2, column 1"),
        ("data: {task: brats}\ndata: {task: luna16}\n", r"run\.yaml: not valid YAML at line 2, column 1: duplicate key 'data'"),
        ("- data\n- trainer\n", r"run\.yaml: expected a mapping of config groups .* got a list"),
        ("just a string\n", r"run\.yaml: expected a mapping of config groups .* got a str"),
    ],
)
def test_yaml_errors_and_non_mappings_are_one_line_errors_naming_the_file(config_file, text, message):
    config_file.write_text(text)
    with pytest.raises(ConfigError, match=message) as error:
        load_config(config_file)
    assert "\n" not in str(error.value)


def test_a_bundled_config_is_found_by_name_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ folder here
    assert find_config("brats_lack0") == find_config("brats_lack0.yaml") == BUNDLED_CONFIGS / "brats_lack0.yaml"
    assert load_config("luna16_delta4").data.task == "luna16"
    with pytest.raises(ConfigError, match=r"config file brats_lack9 not found \(nor a bundled config of that name: brats_lack0, "):
        find_config("brats_lack9")
