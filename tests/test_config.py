"""Recipes, overrides and every configuration error a user can make."""

import dataclasses

import pytest

from dtrain.config import Config, ConfigError, field_docs, find_recipe, help_text, load_config


def test_defaults_without_recipe():
    cfg = load_config()
    assert cfg == Config()


def test_recipe_by_name_and_by_path(tmp_path):
    by_name = load_config("debug")
    assert by_name.model.name == "llama3_debug" and by_name.training.seq_len == 256
    assert load_config("debug.toml") == by_name
    path = tmp_path / "mine.toml"
    path.write_text('[training]\nsteps = 7\n[optimizer]\nbetas = [0.8, 0.9]\n')
    cfg = load_config(path)
    assert cfg.training.steps == 7 and cfg.optimizer.betas == [0.8, 0.9]


def test_recipe_not_found_lists_known_recipes():
    with pytest.raises(ConfigError, match="recipe 'nope' not found.*debug"):
        find_recipe("nope")


@pytest.mark.parametrize("overrides", [
    ["--training.steps", "100", "--parallel.tp=2"],
    ["training.steps=100", "parallel.tp=2"],
    {"training.steps": 100, "parallel.tp": 2},
])
def test_dotted_overrides_in_every_form(overrides):
    cfg = load_config("debug", overrides)
    assert cfg.training.steps == 100 and cfg.parallel.tp == 2


def test_override_booleans_lists_floats_and_strings():
    cfg = load_config("debug", ["--compile.enabled", "--metrics.tensorboard=false",
                                "--optimizer.betas", "[0.9,0.99]", "--optimizer.lr", "1e-4",
                                "--job.name", "x"])
    assert cfg.compile.enabled is True and cfg.metrics.tensorboard is False
    assert cfg.optimizer.betas == [0.9, 0.99] and cfg.optimizer.lr == 1e-4
    assert cfg.job.name == "x"


def test_int_accepted_where_float_expected():
    assert load_config(overrides={"optimizer.lr": 1}).optimizer.lr == 1.0


def test_unknown_section_suggests_closest():
    with pytest.raises(ConfigError, match=r"unknown section 'trainig' \(did you mean 'training'"):
        load_config(overrides=["trainig.steps=3"])


def test_unknown_key_suggests_closest_and_lists_valid_keys():
    with pytest.raises(ConfigError, match=r"unknown key 'training.step' \(did you mean "
                                          r"'training.steps'\?\).*valid keys in \[training\]"):
        load_config(overrides=["training.step=3"])


def test_unknown_key_in_recipe(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[optimizer]\nlearning_rate = 1e-3\n")
    with pytest.raises(ConfigError, match="unknown key 'optimizer.learning_rate'"):
        load_config(path)


@pytest.mark.parametrize("override, message", [
    ("training.steps=ten", r"training.steps = 'ten' has the wrong type: expected an integer"),
    ("compile.enabled=maybe", r"compile.enabled = 'maybe' has the wrong type: expected true"),
    ("optimizer.lr=fast", r"optimizer.lr = 'fast' has the wrong type: expected a number"),
])
def test_wrong_type_from_cli(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[override])


def test_wrong_type_in_recipe(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[training]\nseq_len = "long"\n')
    with pytest.raises(ConfigError, match="training.seq_len = 'long' has the wrong type"):
        load_config(path)


def test_bool_is_not_an_integer(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[training]\nsteps = true\n")
    with pytest.raises(ConfigError, match="expected an integer"):
        load_config(path)


def test_invalid_choice_lists_choices():
    with pytest.raises(ConfigError, match="lr_schedule.decay = 'exp' is not a valid choice: "
                                          "use one of cosine, linear, constant, wsd"):
        load_config(overrides=["lr_schedule.decay=exp"])


@pytest.mark.parametrize("override, allowed", [
    ("training.steps=0", "an integer >= 1"),
    ("parallel.dp_shard=0", "-1 or an integer >= 1"),
    ("optimizer.lr=-1", "a number > 0"),
    ("optimizer.betas=[0.9]", "two numbers in"),
    ("lr_schedule.wsd_decay_fraction=1.5", r"a number in \[0, 1\]"),
    ("parallel.fsdp_auto_memory_fraction=0", r"a number in \(0, 1\]"),
    ("optimizer.lr=inf", "a finite number > 0"),
    ("training.max_norm=nan", "a finite number >= 0"),
    ("optimizer.betas=[0.9, nan]", "two numbers in"),
    ("training.hang_timeout_s=0", "a number of seconds > 0"),
    ("training.startup_timeout_s=0", "a number of seconds > 0"),
    ("training.save_timeout_s=-1", "a number of seconds > 0"),
])
def test_out_of_range(override, allowed):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{key} = .* is out of range: use {allowed}"):
        load_config(overrides=[override])


def test_invalid_toml_is_a_config_error(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[training\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(path)


def test_toml_round_trip(tmp_path):
    cfg = load_config("debug", ["--training.steps", "3", "--optimizer.betas", "0.8,0.9"])
    path = tmp_path / "config.toml"
    path.write_text(cfg.to_toml())
    assert load_config(path) == cfg


def test_every_field_has_a_docstring():
    for section in dataclasses.fields(Config()):
        values = getattr(Config(), section.name)
        docs = field_docs(type(values))
        assert set(docs) == {f.name for f in dataclasses.fields(values)}, section.name
    assert "--training.steps (int, default 100)" in help_text()
