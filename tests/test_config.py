"""OffloadConfig: parsing, validation messages, round trips and the legacy switch."""

import json

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from residency.config import COMPONENTS, LayerOptions, OffloadConfig, resolve_config
from residency.errors import ConfigError, ResidencyError


def test_config_error_is_a_residency_error_and_a_value_error():
    with pytest.raises(ResidencyError):
        OffloadConfig.from_dict({})
    with pytest.raises(ValueError):
        OffloadConfig.from_dict({})


def test_module_mode_parses_with_legacy_default_components():
    config = OffloadConfig.from_dict({"mode": "module"})
    assert config.components == ("dit", "text_encoder")
    assert config.pin_memory is True
    assert dict(config.layer_options) == {}


def test_json_and_dict_agree():
    text = '{"mode": "module", "components": ["dit", "vae"], "pin_memory": false}'
    assert OffloadConfig.from_json(text) == OffloadConfig.from_dict(json.loads(text))
    assert OffloadConfig.from_json(text) == OffloadConfig(
        mode="module", components=("dit", "vae"), pin_memory=False
    )


def test_layer_mode_parses_with_options():
    config = OffloadConfig.from_json(
        '{"mode": "layer", "components": ["dit"],'
        ' "layer_options": {"dit": {"weight_transfer": "sync", "resident_layers": 2}}}'
    )
    assert config.layer_options["dit"] == LayerOptions(weight_transfer="sync", resident_layers=2)


def test_running_layer_mode_is_refused_clearly():
    config = OffloadConfig(mode="layer", components=("dit",))
    with pytest.raises(ConfigError, match=r"'mode' is 'layer': layer mode parses but is not "
                                          r"available yet; use \"mode\": \"module\""):
        config.require_runnable()
    OffloadConfig(mode="module").require_runnable()  # module mode runs


def test_config_is_frozen():
    config = OffloadConfig(mode="module")
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.mode = "layer"
    with pytest.raises(TypeError):
        config.layer_options["dit"] = LayerOptions()


_layer_options = st.fixed_dictionaries(
    {},
    optional={
        component: st.builds(
            lambda w, r: {"weight_transfer": w, "resident_layers": r},
            st.sampled_from(["sync", "async"]),
            st.integers(1, 64),
        )
        for component in COMPONENTS
    },
)


@st.composite
def _config_dicts(draw):
    components = draw(st.lists(st.sampled_from(COMPONENTS), unique=True))
    data = {"mode": draw(st.sampled_from(["module", "layer"])), "components": components,
            "pin_memory": draw(st.booleans())}
    if data["mode"] == "layer":
        options = draw(_layer_options)
        data["layer_options"] = {k: v for k, v in options.items() if k in components}
        if not data["layer_options"]:
            del data["layer_options"]
    return data


@given(_config_dicts())
def test_to_dict_from_dict_and_json_round_trip(data):
    config = OffloadConfig.from_dict(data)
    assert config.to_dict() == data
    assert OffloadConfig.from_dict(config.to_dict()) == config
    assert OffloadConfig.from_json(config.to_json()) == config
    assert hash(OffloadConfig.from_dict(data)) == hash(config)


# -- every error message ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"components": ["dit"]},
         r"field 'mode' is missing from \{'components': \['dit'\]\}; accepted modes are "
         r"'module', 'layer'"),
        ({"mode": "modul"}, r"field 'mode' is 'modul'; accepted modes are 'module', 'layer'"),
        ({"mode": None}, r"field 'mode' is None; accepted modes are 'module', 'layer'"),
        ({"mode": "module", "compnents": ["dit"]},
         r"unknown field 'compnents'; accepted fields are 'mode', 'components', "
         r"'layer_options', 'pin_memory'\. Did you mean 'components'\?"),
        ({"mode": "module", "components": "dit"},
         r"field 'components' is 'dit', not a list; give a list drawn from 'dit', "
         r"'text_encoder', 'vae'"),
        ({"mode": "module", "components": ["dit", "unet"]},
         r"field 'components' contains 'unet'; accepted components are 'dit', "
         r"'text_encoder', 'vae'"),
        ({"mode": "module", "components": ["dit", "dit"]},
         r"field 'components' lists 'dit' twice \(\['dit', 'dit'\]\); list each component once"),
        ({"mode": "module", "components": ["dit"],
          "layer_options": {"dit": {"weight_transfer": "async"}}},
         r"field 'layer_options' is \{'dit': .*\}, but mode 'module' rejects layer options "
         r"\('weight_transfer', 'resident_layers'\); remove 'layer_options', or set "
         r"\"mode\": \"layer\""),
        ({"mode": "module", "pin_memory": "yes"},
         r"field 'pin_memory' is 'yes' \(str\); accepted values are true and false"),
        ({"mode": "module", "pin_memory": 1},
         r"field 'pin_memory' is 1 \(int\); accepted values are true and false"),
        ({"mode": "layer", "components": ["dit"], "layer_options": ["dit"]},
         r"field 'layer_options' is \['dit'\], not an object; map a component"),
        ({"mode": "layer", "components": ["dit"], "layer_options": {"unet": {}}},
         r"field 'layer_options' names component 'unet'; accepted components are 'dit', "
         r"'text_encoder', 'vae'"),
        ({"mode": "layer", "components": ["dit"], "layer_options": {"vae": {}}},
         r"field 'layer_options' names 'vae', which is not in components \['dit'\]; add it to "
         r"'components' or remove its options"),
        ({"mode": "layer", "components": ["dit"], "layer_options": {"dit": 3}},
         r"field 'layer_options.dit' is 3, not an object; accepted keys are "
         r"'weight_transfer', 'resident_layers'"),
        ({"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"layers": 2}}},
         r"field 'layer_options.dit' has unknown key 'layers'; accepted keys are "
         r"'weight_transfer', 'resident_layers'"),
        ({"mode": "layer", "components": ["dit"],
          "layer_options": {"dit": {"weight_transfer": "eager"}}},
         r"'layer_options.\*.weight_transfer' is 'eager'; accepted values are 'sync', 'async'"),
        ({"mode": "layer", "components": ["dit"],
          "layer_options": {"dit": {"resident_layers": 0}}},
         r"'layer_options.\*.resident_layers' is 0; accepted values are whole numbers of at "
         r"least 1"),
    ],
)
def test_bad_config_messages_name_field_value_and_accepted(data, message):
    with pytest.raises(ConfigError, match=message):
        OffloadConfig.from_dict(data)


def test_not_a_mapping():
    with pytest.raises(ConfigError, match=r"must be an object \(a mapping\), not \['dit'\]"):
        OffloadConfig.from_dict(["dit"])


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ('{"mode": "module",', r"line 1, column 19"),
        ('{"mode": "module",\n "components": [dit]}', r"line 2, column 17"),
        ("", r"line 1, column 1"),
    ],
)
def test_json_that_does_not_parse_says_where(text, where):
    with pytest.raises(ConfigError, match=rf"is not valid JSON: .* at {where}; write it like"):
        OffloadConfig.from_json(text)


def test_json_must_be_a_string():
    with pytest.raises(ConfigError, match=r"JSON must be a string, not int"):
        OffloadConfig.from_json(3)


def test_constructor_validates_like_from_dict():
    with pytest.raises(ConfigError, match=r"field 'components' contains 'unet'"):
        OffloadConfig(mode="module", components=["unet"])
    with pytest.raises(ConfigError, match=r"field 'pin_memory' is None"):
        OffloadConfig(mode="module", pin_memory=None)


# -- the legacy switch --------------------------------------------------------------------------


def test_off_unless_asked():
    assert resolve_config(None) is None
    assert resolve_config(None, enable_cpu_offload=False) is None


def test_legacy_switch_means_module_mode_with_dit_and_text_encoder():
    assert resolve_config(enable_cpu_offload=True) == OffloadConfig(
        mode="module", components=("dit", "text_encoder")
    )


@pytest.mark.parametrize(
    "config",
    [
        {"mode": "module", "components": ["text_encoder", "dit"]},
        '{"mode": "module", "components": ["dit", "text_encoder", "vae"]}',
        OffloadConfig(mode="module", pin_memory=False),
    ],
)
def test_legacy_switch_with_an_agreeing_config_keeps_the_config(config):
    resolved = resolve_config(config, enable_cpu_offload=True)
    assert resolved == resolve_config(config)


@pytest.mark.parametrize(
    "config",
    [
        {"mode": "module", "components": ["dit"]},
        {"mode": "module", "components": ["vae"]},
        {"mode": "layer", "components": ["dit", "text_encoder"]},
    ],
)
def test_legacy_switch_with_a_disagreeing_config_is_refused(config):
    with pytest.raises(ConfigError, match=r"enable_cpu_offload=True means mode 'module' with "
                                          r"components \['dit', 'text_encoder'\], but the offload "
                                          r"config given with it is \{'mode': "):
        resolve_config(config, enable_cpu_offload=True)


def test_legacy_switch_must_be_a_bool():
    with pytest.raises(ConfigError, match=r"field 'enable_cpu_offload' is 'true' \(str\); "
                                          r"accepted values are true and false"):
        resolve_config(None, enable_cpu_offload="true")


def test_resolve_refuses_other_types():
    with pytest.raises(ConfigError, match=r"must be an OffloadConfig, a mapping or a JSON "
                                          r"string, not int \(5\)"):
        resolve_config(5)
