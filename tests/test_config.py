import time
from pathlib import Path

import pytest

from medfed.components import resolve
from medfed.config import BUNDLED_CONFIGS, MAX_YAML_BYTES, check_wandb_key, find_config, load_config, parse_options
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


# --- hostile YAML and values that would fail later (issue 24) -----------------------------------------

ALIAS_BOMB = "\n".join(
    ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    + [f"{chr(98 + k)}: &{chr(98 + k)} [{','.join(['*' + chr(97 + k)] * 9)}]" for k in range(8)]
)
"""A 9^9 (387 million) string "billion laughs" document of about 400 bytes."""


def test_alias_bomb_is_refused_in_one_line_before_it_is_expanded(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(ALIAS_BOMB)
    assert len(ALIAS_BOMB) < 1024
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"bomb\.yaml: not valid YAML at line \d+.*aliases .* expanded") as error:
        load_config(path)
    assert time.perf_counter() - start < 1.0  # well under a second; typically a few ms
    assert "\n" not in str(error.value)


def _interpolation_bomb(reference, nest=lambda text: text):
    """About 1 KB whose ``${...}`` references expand to 9^8 (43 million) strings; ``reference(k)`` names list k's strings."""
    lines = ["data:", "  task: brats", "  l0: " + nest("[lol, lol, lol, lol, lol, lol, lol, lol, lol]")]
    lines += [f"  l{k}: " + nest("[" + ", ".join([f'"${{{reference(k - 1)}}}"'] * 9) + "]") for k in range(1, 8)]
    return "\n".join([*lines, "logger:", f'  tags: "${{{reference(7)}}}"']) + "\n"


@pytest.mark.parametrize(
    "text",
    [
        _interpolation_bomb(lambda k: f"data.l{k}"),
        _interpolation_bomb(lambda k: f"..l{k}"),  # relative to the list holding the reference: its group
        _interpolation_bomb(lambda k: f"data.l{k}[0]", nest=lambda text: f"[{text}]"),
    ],
    ids=["absolute", "relative", "brackets"],
)
def test_interpolation_bomb_is_refused_in_one_line_before_it_is_resolved(tmp_path, text):
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    assert len(text) < 1300
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"bomb\.yaml: its interpolations \(\$\{\.\.\.\}\) expand to more than 100000 values"):
        load_config(path)
    assert time.perf_counter() - start < 1.0  # well under a second; typically a few ms


def test_interpolations_that_expand_to_little_are_still_resolved(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(BASE + "logger: {tags: ['${strategy.name}', '${..project}-${trainer.seed}']}\n")
    cfg = load_config(path, ["trainer.seed=4"])
    assert list(cfg.logger.tags) == ["pfednet", "medfed-4"] and cfg.output_dir == "out/pfednet"


def test_aliases_that_expand_to_little_are_still_read(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(BASE + "model: &m {name: unet, channels: [4, 8, 16], strides: [2, 2]}\nlogger: {tags: [x, y]}\n")
    assert list(load_config(path).model.channels) == [4, 8, 16]


@pytest.mark.parametrize(
    "text", ["[" * 50_000 + "]" * 50_000, "a:\n" + "".join(" " * k + f"k{k}:\n" for k in range(1, 200))], ids=["brackets", "indented"]
)
def test_deep_nesting_is_refused_in_one_line_not_a_recursion_error(tmp_path, text):
    path = tmp_path / "deep.yaml"
    path.write_text(text)
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"deep\.yaml: not valid YAML at line \d+, column \d+: nested deeper than 64 levels"):
        load_config(path)
    assert time.perf_counter() - start < 5.0  # typically a few ms; generous for a loaded 2-core CI machine


def test_overlong_file_is_refused_without_reading_it(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text(BASE + "#" * (MAX_YAML_BYTES + 1))
    with pytest.raises(ConfigError, match=rf"big\.yaml: {MAX_YAML_BYTES + len(BASE) + 1} bytes, larger than any config file"):
        load_config(path)


def test_unknown_key_typed_on_the_command_line_is_blamed_on_it_with_a_suggestion(config_file):
    with pytest.raises(ConfigError) as error:
        load_config(config_file, ["trainer.roudns=3"])
    assert str(error.value) == (
        "command line override 'trainer.roudns=3': unknown config key 'trainer.roudns'; did you mean 'trainer.rounds'?"
    )


def test_an_unknown_group_typed_on_the_command_line_names_the_override(config_file):
    with pytest.raises(ConfigError) as error:
        load_config(config_file, ["trainer.seed=1", "trainr.rounds=3"])
    assert str(error.value) == "command line override 'trainr.rounds=3': unknown config key 'trainr'; did you mean 'trainer'?"


def test_unknown_key_in_the_file_is_blamed_on_the_file_with_a_suggestion(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(BASE + "federaton: {n_sites: 3}\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value) == f"{path}: unknown config key 'federaton'; did you mean 'federation'?"


def test_unknown_option_of_a_component_suggests_the_known_one():
    with pytest.raises(ConfigError, match=r"unknown config key 'strategy\.lamm' .*did you mean 'strategy\.lam'\?"):
        parse_options(PFedNet.Options, {"lamm": 0.1}, "strategy")


@pytest.mark.parametrize(
    "override, suggestion",
    [
        ("strategy.name=pfednt", "; did you mean 'pfednet' or 'pgfed' or 'fedbn'?"),
        ("strategy.pfednt.lam=1", "unknown config key 'strategy.pfednt'; did you mean 'strategy.pfednet' or "),
        ("strategy.nme=pfednet", "unknown config key 'strategy.nme'; did you mean 'strategy.name'? "),
        ("strategy.pfednet.lamm=1", "unknown config key 'strategy.pfednet.lamm' for PFedNetOptions; did you mean 'strategy.pfednet.lam'? "),
    ],
)
def test_a_mistyped_strategy_name_subgroup_or_option_suggests_the_registered_one(override, suggestion):
    # (The name and the subgroup were refused with the whole list and no suggestion; options had one.)
    with pytest.raises(ConfigError) as error:
        resolve(load_config(Path(__file__).resolve().parents[1] / "configs" / "clinical_delta1.yaml", [override]))
    assert suggestion in str(error.value)


@pytest.mark.parametrize(
    "override, key",
    [
        ("codec.gamma=inf", "codec.gamma"),
        ("codec.gamma=nan", "codec.gamma"),
        ("codec.quant_bits=0", "codec.quant_bits"),
        ("codec.quant_bits=17", "codec.quant_bits"),
        ("trainer.seed=-1", "trainer.seed"),
        (f"trainer.seed={2**63}", "trainer.seed"),
    ],
)
def test_values_that_would_fail_later_are_refused_with_the_config(config_file, override, key):
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        load_config(config_file, [override])


def test_largest_seed_and_quant_bits_are_accepted(config_file):
    cfg = load_config(config_file, [f"trainer.seed={2**63 - 1}", "codec.quant_bits=16"])
    assert (cfg.trainer.seed, cfg.codec.quant_bits) == (2**63 - 1, 16)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["model.lr=inf"], "model.lr"),
        (["model.lr=nan"], "model.lr"),
        (["model.lr=0"], "model.lr"),
        (["model.weight_decay=inf"], "model.weight_decay"),
        (["model.channels=[16]", "model.strides=[]"], "model.channels"),
        (["model.channels=[16,0]", "model.strides=[2]"], "model.channels"),
        (["model.channels=[16,32]", "model.strides=[0]"], "model.strides"),
        (["model.channels=[16,32]", "model.strides=[3]", "data.patch_size=32"], "data.patch_size"),
        (["model.channels=[8,16,32,64,128]", "model.strides=[2,2,2,2]", "data.patch_size=24"], "data.patch_size"),
        (["model.channels=[8,16,32,64,128]", "model.strides=[2,2,2,2]", "data.patch_size=16"], "data.patch_size"),
    ],
)
def test_model_options_that_cannot_train_or_build_are_refused_at_resolve(config_file, overrides, key):
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        resolve(load_config(config_file, ["model.name=unet", *overrides]))


def test_a_unet_the_check_accepts_builds_and_keeps_the_patch_size(config_file):
    import torch

    resolved = resolve(load_config(config_file, ["model.channels=[4,8,16]", "model.strides=[2,2]", "data.patch_size=8"]))
    model = resolved.model_cls(4, 2, resolved.model_options)
    assert model(torch.zeros(2, 4, 8, 8)).shape == (2, 2, 8, 8)


def test_wandb_online_without_a_key_is_refused_and_with_one_accepted(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    netrc_file = tmp_path / "netrc"
    monkeypatch.setenv("NETRC", str(netrc_file))
    check_wandb_key("offline")
    with pytest.raises(ConfigError, match=r"config key 'logger.wandb' = 'online': no W&B API key here"):
        check_wandb_key("online")
    netrc_file.write_text("machine api.wandb.ai\n  login user\n  password " + "0" * 40 + "\n")
    netrc_file.chmod(0o600)
    check_wandb_key("online")
    netrc_file.unlink()
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    check_wandb_key("online")


def test_flow_nesting_past_the_depth_bound_is_refused_before_pyyaml_scans_it_and_quoted_brackets_are_text():
    import time

    from medfed.config import MAX_YAML_DEPTH, _read_yaml

    start = time.perf_counter()
    with pytest.raises(ConfigError, match=rf"^x: not valid YAML at line 2, column {MAX_YAML_DEPTH + 4}: nested deeper than {MAX_YAML_DEPTH} levels$"):
        _read_yaml("a: 1\nb: " + "[" * 50_000, "x")
    assert time.perf_counter() - start < 0.1  # PyYAML's own scanner took a second at load 5
    deep = "[" * (MAX_YAML_DEPTH - 1) + "]" * (MAX_YAML_DEPTH - 1)  # at the bound (the document's mapping is a level): read
    assert _read_yaml(f"a: {deep}", "x")["a"] == eval(deep.replace("][", "],["))  # noqa: S307 - nested empty lists
    brackets = "[" * (MAX_YAML_DEPTH + 1)
    assert _read_yaml(f"a: '{brackets}'\nb: \"{brackets}\"  # {brackets}\n", "x") == {"a": brackets, "b": brackets}
