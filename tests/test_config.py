"""OffloadConfig: parsing, validation messages, round trips and the legacy switch."""

import json

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from residency.options.budget import AutoOptions
from residency.options.vllm_omni import (
    COMPONENTS,
    EXTENSION_MODES,
    LEGACY_COMPONENTS,
    MODES,
    WEIGHT_TRANSFERS,
    LayerOptions,
    ModuleOptions,
    OffloadConfig,
    resolve_config,
)
from residency.core.errors import ConfigError, ResidencyError


@pytest.mark.fast
def test_config_error_is_a_residency_error_and_a_value_error():
    with pytest.raises(ResidencyError):
        OffloadConfig.from_dict({})
    with pytest.raises(ValueError):
        OffloadConfig.from_dict({})


@pytest.mark.fast
def test_module_mode_parses_with_defaults():
    config = OffloadConfig.from_dict({"mode": "module", "components": ["dit"]})
    assert config.components == ("dit",)
    assert config.pin_memory is True
    assert dict(config.layer_options) == {}


@pytest.mark.fast
def test_components_are_a_set_in_canonical_order():
    config = OffloadConfig.from_dict({"mode": "module", "components": ["vae", "dit", "dit"]})
    assert config.components == ("dit", "vae")
    assert config == OffloadConfig(mode="module", components=frozenset({"dit", "vae"}))
    assert config == OffloadConfig(mode="module", components=("vae", "dit"))


@pytest.mark.fast
def test_pin_memory_null_means_the_default():
    config = OffloadConfig.from_json('{"mode": "module", "components": ["dit"], "pin_memory": null}')
    assert config.pin_memory is True
    assert config == OffloadConfig(mode="module", components=["dit"])


@pytest.mark.fast
def test_json_and_dict_agree():
    text = '{"mode": "module", "components": ["dit", "vae"], "pin_memory": false}'
    assert OffloadConfig.from_json(text) == OffloadConfig.from_dict(json.loads(text))
    assert OffloadConfig.from_json(text) == OffloadConfig(
        mode="module", components=("dit", "vae"), pin_memory=False
    )


@pytest.mark.fast
def test_layer_mode_parses_with_options():
    config = OffloadConfig.from_json(
        '{"mode": "layer", "components": ["dit", "text_encoder"],'
        ' "layer_options": {"dit": {"weight_transfer": "rank-local", "resident_layers": 2},'
        ' "text_encoder": {"weight_transfer": "allgather", "resident_layers": 0}}}'
    )
    assert config.layer_options["dit"] == LayerOptions(weight_transfer="rank-local",
                                                       resident_layers=2)
    assert config.options_for("text_encoder") == LayerOptions(weight_transfer="allgather")


@pytest.mark.fast
def test_layer_options_default_to_rank_local_with_no_resident_layers():
    config = OffloadConfig(mode="layer", components=("dit", "text_encoder"),
                           layer_options={"dit": {"resident_layers": 3}})
    assert config.options_for("dit") == LayerOptions(weight_transfer="rank-local",
                                                     resident_layers=3)
    assert config.options_for("text_encoder") == LayerOptions(weight_transfer="rank-local",
                                                              resident_layers=0)
    with pytest.raises(ConfigError, match=r"component 'vae' is not selected \(components "
                                          r"\['dit', 'text_encoder'\]\); ask for one of them"):
        config.options_for("vae")


@pytest.mark.fast
def test_layer_mode_is_runnable():
    for mode in ("layer", "module"):
        config = OffloadConfig(mode=mode, components=("dit",))
        assert config.require_runnable() is None  # refuses nothing: both modes run
    config = OffloadConfig.from_dict(
        {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"resident_layers": 2}}})
    config.require_runnable()
    assert config.options_for("dit").resident_layers == 2


# -- module_options (an extension: all-gather of whole components in module mode) --------------


@pytest.mark.fast
def test_module_options_parse_and_say_each_components_transfer():
    config = OffloadConfig.from_json(
        '{"mode": "module", "components": ["dit", "text_encoder", "vae"],'
        ' "module_options": {"dit": {"weight_transfer": "allgather"}, "vae": {}}}'
    )
    assert dict(config.module_options) == {"dit": ModuleOptions(weight_transfer="allgather"),
                                           "vae": ModuleOptions(weight_transfer="rank-local")}
    assert [config.weight_transfer_for(c) for c in ("dit", "text_encoder", "vae")] == [
        "allgather", "rank-local", "rank-local"]
    assert config.options_for("dit") == LayerOptions()  # layer options: none in module mode
    assert config == OffloadConfig(mode="module", components=["vae", "text_encoder", "dit"],
                                   module_options={"dit": {"weight_transfer": "allgather"},
                                                   "vae": ModuleOptions()})


@pytest.mark.fast
def test_empty_module_options_are_the_default():
    config = OffloadConfig.from_dict({"mode": "module", "components": ["dit"],
                                      "module_options": {}})
    assert config == OffloadConfig(mode="module", components=["dit"])
    assert "module_options" not in config.to_dict()
    assert config.weight_transfer_for("dit") == "rank-local"
    # empty, it is accepted in layer mode too (as vLLM-Omni takes empty layer_options in module mode)
    assert OffloadConfig.from_dict({"mode": "layer", "components": ["dit"],
                                    "module_options": {}}) == OffloadConfig(mode="layer",
                                                                            components=["dit"])


@pytest.mark.fast
def test_weight_transfer_for_reads_layer_options_in_layer_mode():
    config = OffloadConfig.from_dict({
        "mode": "layer", "components": ["dit", "text_encoder"],
        "layer_options": {"text_encoder": {"weight_transfer": "allgather"}}})
    assert config.weight_transfer_for("text_encoder") == "allgather"
    assert config.weight_transfer_for("dit") == "rank-local"
    assert dict(config.module_options) == {}


@pytest.mark.fast
def test_weight_transfer_for_refuses_a_component_not_selected():
    config = OffloadConfig(mode="module", components=["dit"],
                           module_options={"dit": {"weight_transfer": "allgather"}})
    with pytest.raises(ConfigError, match=r"component 'text_encoder' is not selected \(components "
                                          r"\['dit'\]\); ask for one of them"):
        config.weight_transfer_for("text_encoder")


@pytest.mark.fast
def test_module_options_are_frozen():
    config = OffloadConfig(mode="module", components=["dit"],
                           module_options={"dit": {"weight_transfer": "allgather"}})
    with pytest.raises(TypeError):
        config.module_options["dit"] = ModuleOptions()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.module_options["dit"].weight_transfer = "rank-local"


@pytest.mark.fast
def test_config_is_frozen():
    config = OffloadConfig(mode="module", components=["dit"])
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.mode = "layer"
    with pytest.raises(TypeError):
        config.layer_options["dit"] = LayerOptions()


_layer_options = st.fixed_dictionaries(
    {},
    optional={
        component: st.builds(
            lambda w, r: {"weight_transfer": w, "resident_layers": r},
            st.sampled_from(["rank-local", "allgather"]),
            st.integers(0, 64) if component == "dit" else st.just(0),
        ).filter(lambda o: not (o["resident_layers"] and o["weight_transfer"] == "allgather"))
        for component in COMPONENTS
    },
)


_module_options = st.dictionaries(
    st.sampled_from(COMPONENTS),
    st.sampled_from(WEIGHT_TRANSFERS).map(lambda w: {"weight_transfer": w}),
)


#: Auto options as `AutoOptions.to_dict` writes them: only what differs from the defaults.
_auto_options = st.fixed_dictionaries({}, optional={
    "device_budget": st.one_of(
        st.integers(1, 2**40), st.sampled_from(["38GiB", "500 MB", "1.5GB"]),
        st.floats(0, 1, exclude_min=True)),
    "headroom": st.one_of(st.integers(0, 2**30), st.sampled_from(["2GiB", "0B"])),
    "phase_order": st.lists(st.sampled_from(["text_encoder", "transformer", "vae"]), min_size=1),
    "drift": st.floats(0, 4, exclude_min=True).filter(lambda d: d != 0.25),
})


@st.composite
def _config_dicts(draw):
    chosen = set(draw(st.lists(st.sampled_from(COMPONENTS), min_size=1, unique=True)))
    components = [c for c in COMPONENTS if c in chosen]  # as to_dict writes them
    data = {"mode": draw(st.sampled_from(MODES)), "components": components}
    field, strategy = (("layer_options", _layer_options) if data["mode"] == "layer"
                       else ("module_options", _module_options))
    options = {k: v for k, v in draw(strategy).items() if k in components}
    if options:
        data[field] = options
    if data["mode"] == "auto":
        data["auto_options"] = draw(_auto_options)
    data["pin_memory"] = draw(st.booleans())
    return data


@settings(deadline=None)  # no per-example time limit: a stall on a loaded machine is no failure
@given(_config_dicts())
def test_to_dict_from_dict_and_json_round_trip(data):
    config = OffloadConfig.from_dict(data)
    assert config.to_dict() == data
    assert OffloadConfig.from_dict(config.to_dict()) == config
    assert OffloadConfig.from_json(config.to_json()) == config
    assert hash(OffloadConfig.from_dict(data)) == hash(config)


# -- every error message ------------------------------------------------------------------------


@pytest.mark.fast
@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"components": ["dit"]},
         r"field 'mode' is missing from \{'components': \['dit'\]\}; it is required "
         r"\(accepted modes are 'module', 'layer', 'auto'\), for example \{\"mode\": "
         r"\"module\""),
        ({"mode": "module"},
         r"field 'components' is missing from \{'mode': 'module'\}; it is required \(list "
         r"some of 'dit', 'text_encoder', 'vae'\), for example \{\"mode\": \"module\", "
         r"\"components\": \[\"dit\", \"text_encoder\"\]\}"),
        ({"mode": "modul", "components": ["dit"]},
         r"field 'mode' is 'modul'; accepted modes are 'module', 'layer', 'auto'\. Did you mean "
         r"'module'\?$"),
        ({"mode": "layers", "components": ["dit"]},
         r"field 'mode' is 'layers'; accepted modes are .*\. Did you mean 'layer'\?$"),
        ({"mode": None, "components": ["dit"]},
         r"field 'mode' is None; accepted modes are 'module', 'layer', 'auto'\.$"),
        ({"mode": "module", "compnents": ["dit"]},
         r"unknown field 'compnents'; accepted fields are 'mode', 'components', "
         r"'layer_options', 'module_options', 'auto_options', 'pin_memory', 'order'\. Did you mean "
         r"'components'\?"),
        ({"mode": "module", "components": ["dit"], "module_option": {}},
         r"unknown field 'module_option'; accepted fields are .*\. Did you mean "
         r"'module_options'\?"),
        ({"mode": "module", "components": "dit"},
         r"field 'components' is 'dit', not a list; give a list drawn from 'dit', "
         r"'text_encoder', 'vae'"),
        ({"mode": "module", "components": ["dit", "unet"]},
         r"field 'components' contains 'unet'; accepted components are 'dit', "
         r"'text_encoder', 'vae'"),
        ({"mode": "module", "components": []},
         r"field 'components' is empty; select at least one of 'dit', 'text_encoder', 'vae', "
         r"for example \[\"dit\"\] \(to turn offloading off, give no offload config at all\)"),
        ({"mode": "module", "components": {"dit": True}},
         r"field 'components' is \{'dit': True\}, not a list"),
        ({"mode": "module", "components": ["dit", 3]},
         r"field 'components' contains 3; accepted components are"),
        ({"mode": "module", "components": ["dit"],
          "layer_options": {"dit": {"weight_transfer": "rank-local"}}},
         r"field 'layer_options' is \{'dit': .*\}, but mode 'module' rejects layer options "
         r"\('weight_transfer', 'resident_layers'\); remove 'layer_options', or set "
         r"\"mode\": \"layer\""),
        ({"mode": "module", "components": ["dit", "text_encoder"],
          "layer_options": {"dit": {"weight_transfer": "allgather"}, "text_encoder": {}}},
         r"mode 'module' rejects layer options .*; remove 'layer_options', or set \"mode\": "
         r"\"layer\"\. To all-gather whole components in module mode, give \"module_options\": "
         r"\{\"dit\": \{\"weight_transfer\": \"allgather\"\}\} instead \(an extension of "
         r"vLLM-Omni's schema, see docs/surface\.md\)$"),
        ({"mode": "layer", "components": ["dit"],
          "module_options": {"dit": {"weight_transfer": "allgather"}}},
         r"field 'module_options' is \{'dit': \{'weight_transfer': 'allgather'\}\}, but mode "
         r"'layer' takes its options in 'layer_options'; give \"layer_options\": \{\"dit\": "
         r"\{\"weight_transfer\": \"allgather\"\}\} instead, or set \"mode\": \"module\""),
        ({"mode": "module", "components": ["dit"], "module_options": ["dit"]},
         r"field 'module_options' is \['dit'\], not an object; map a component \('dit', "
         r"'text_encoder', 'vae'\) to its options, for example \{\"dit\": "
         r"\{\"weight_transfer\": \"allgather\"\}\}"),
        ({"mode": "module", "components": ["dit"], "module_options": None},
         r"field 'module_options' is None, not an object"),
        ({"mode": "module", "components": ["dit"], "module_options": {"dti": {}}},
         r"field 'module_options' names component 'dti'; accepted components are 'dit', "
         r"'text_encoder', 'vae'\. Did you mean 'dit'\?"),
        ({"mode": "module", "components": ["dit"], "module_options": {"vae": {}}},
         r"field 'module_options' names 'vae', which is not in components \['dit'\]; add it to "
         r"'components' or remove its options"),
        ({"mode": "module", "components": ["dit"], "module_options": {"dit": "allgather"}},
         r"field 'module_options.dit' is 'allgather', not an object; accepted keys are "
         r"'weight_transfer', for example \{\"weight_transfer\": \"allgather\"\}"),
        ({"mode": "module", "components": ["dit"],
          "module_options": {"dit": {"weight_tranfser": "allgather"}}},
         r"field 'module_options.dit' has unknown key 'weight_tranfser'; accepted keys are "
         r"'weight_transfer'\. Did you mean 'weight_transfer'\?"),
        ({"mode": "module", "components": ["dit"],
          "module_options": {"dit": {"resident_layers": 2}}},
         r"field 'module_options.dit' has key 'resident_layers', a layer-mode option; module "
         r"mode accepts only 'weight_transfer': remove it, or give it in 'layer_options' with "
         r"\"mode\": \"layer\""),
        ({"mode": "module", "components": ["dit"],
          "module_options": {"dit": {"weight_transfer": "all-gather"}}},
         r"'module_options.\*.weight_transfer' is 'all-gather'; accepted values are "
         r"'rank-local', 'allgather'"),
        ({"mode": "module", "components": ["dit"],
          "module_options": {"dit": {"weight_transfer": None}}},
         r"'module_options.\*.weight_transfer' is None; accepted values are 'rank-local', "
         r"'allgather'"),
        ({"mode": "module", "components": ["dit"], "pin_memory": "yes"},
         r"field 'pin_memory' is 'yes' \(str\); accepted values are true, false and null "
         r"\(null or absent: true\)"),
        ({"mode": "module", "components": ["dit"], "pin_memory": 1},
         r"field 'pin_memory' is 1 \(int\); accepted values are true, false and null"),
        ({"mode": "layer", "components": ["dit"], "layer_options": ["dit"]},
         r"field 'layer_options' is \['dit'\], not an object; map a component"),
        ({"mode": "layer", "components": ["dit"], "layer_options": {"unet": {}}},
         r"field 'layer_options' names component 'unet'; accepted components are 'dit', "
         r"'text_encoder', 'vae'\.$"),  # no close match, no hint
        ({"mode": "layer", "components": ["dit"], "layer_options": {"text_encodr": {}}},
         r"field 'layer_options' names component 'text_encodr'; .*\. Did you mean "
         r"'text_encoder'\?"),
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
          "layer_options": {"dit": {"resident_layer": 2}}},
         r"field 'layer_options.dit' has unknown key 'resident_layer'; accepted keys are "
         r"'weight_transfer', 'resident_layers'\. Did you mean 'resident_layers'\?"),
        ({"mode": "layer", "components": ["dit"],
          "layer_options": {"dit": {"weight_transfer": "eager"}}},
         r"'layer_options.\*.weight_transfer' is 'eager'; accepted values are 'rank-local', "
         r"'allgather'"),
        ({"mode": "layer", "components": ["dit"],
          "layer_options": {"dit": {"weight_transfer": None}}},
         r"'layer_options.\*.weight_transfer' is None; accepted values are 'rank-local', "
         r"'allgather'"),
        ({"mode": "layer", "components": ["dit"],
          "layer_options": {"dit": {"resident_layers": -1}}},
         r"'layer_options.\*.resident_layers' is -1; accepted values are whole numbers of at "
         r"least 0"),
        ({"mode": "layer", "components": ["dit"],
          "layer_options": {"dit": {"resident_layers": True}}},
         r"'layer_options.\*.resident_layers' is True; accepted values are whole numbers"),
        ({"mode": "layer", "components": ["dit"],
          "layer_options": {"dit": {"resident_layers": 2, "weight_transfer": "allgather"}}},
         r"'layer_options.\*.resident_layers' is 2, which needs weight_transfer 'rank-local', "
         r"but weight_transfer is 'allgather'; set \"weight_transfer\": \"rank-local\" or "
         r"\"resident_layers\": 0"),
        ({"mode": "layer", "components": ["text_encoder"],
          "layer_options": {"text_encoder": {"resident_layers": 1}}},
         r"'layer_options.text_encoder.resident_layers' is 1; resident layers are for the 'dit' "
         r"component only: remove it or set it to 0"),
        ({"mode": "module", "components": ["dit"], "auto_options": {"device_budget": "1GiB"}},
         r"^offload config field 'auto_options' is \{'device_budget': '1GiB'\}, but mode "
         r"'module' takes no auto options \(they are the device budget of an auto plan\); set "
         r"\"mode\": \"auto\", or drop 'auto_options'$"),
        ({"mode": "layer", "components": ["dit"], "auto_options": {}},
         r"^offload config field 'auto_options' is \{\}, but mode 'layer' takes no auto "
         r"options .*; set \"mode\": \"auto\", or drop 'auto_options'$"),
        ({"mode": "auto", "layer_options": {"dit": {"resident_layers": 2}}},
         r"^offload config field 'layer_options' is \{'dit': \{'weight_transfer': 'rank-local', "
         r"'resident_layers': 2\}\}, but mode 'auto' chooses itself which blocks stream and "
         r"which stay resident; remove 'layer_options', or set \"mode\": \"layer\" to fix "
         r"weight_transfer and resident_layers by hand$"),
        ({"mode": "auto", "components": []},
         r"field 'components' is empty; select at least one of"),
        ({"mode": "auto", "components": ["dit"], "module_options": {"vae": {}}},
         r"field 'module_options' names 'vae', which is not in components \['dit'\]"),
        ({"mode": "Auto", "components": ["dit"]},
         r"field 'mode' is 'Auto'; accepted modes are 'module', 'layer', 'auto'\. Did you mean "
         r"'auto'\?$"),
    ],
)
def test_bad_config_messages_name_field_value_and_accepted(data, message):
    with pytest.raises(ConfigError, match=message):
        OffloadConfig.from_dict(data)


#: Bad auto options, each with the `AutoOptions` message it must surface with.
BAD_AUTO_OPTIONS = [
    ({"device_budget": 2.0},
     r"device_budget=2\.0; give bytes \(a whole number >= 1, or a size such as '38GiB', "
     r"'1\.5GiB', '500MB', '2048' \(units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; a decimal needs "
     r"KB or more and must come to whole bytes\)\) or a fraction of the free device memory: a "
     r"float in \(0, 1\] such as 0\.9, or a percentage such as '90%'; text is never a bare "
     r"fraction \(write 0\.5 or '50%', not '0\.5'\)"),
    ({"device_budget": 0}, r"device_budget=0; give bytes \(a whole number >= 1"),
    ({"device_budget": "0GiB"}, r"device_budget='0GiB'; give bytes \(a whole number >= 1"),
    ({"device_budget": "12 parsecs"}, r"device_budget='12 parsecs'; give bytes"),
    ({"device_budget": True}, r"device_budget=True; give bytes"),
    ({"headroom": -1}, r"headroom=-1; give bytes: a whole number >= 0, or a size such as "
                       r"'38GiB'"),
    ({"headroom": "lots"}, r"headroom='lots'; give bytes: a whole number >= 0"),
    ({"phase_order": []},
     r"phase_order=\[\]; give the group names one call enters, in order \(e\.g\. "
     r"\['text_encoder', 'transformer', 'vae'\]\), or leave it out to observe the first call"),
    ({"phase_order": ["transformer", 3]}, r"phase_order=\['transformer', 3\]; give the group"),
    ({"phase_order": "transformer"}, r"phase_order='transformer'; give the group names"),
    ({"passes": {"transformer": 0}},
     r"passes=\{'transformer': 0\}; give an object of group names and the forwards of each "
     r"group's model one call runs, each a whole number >= 1 \(e\.g\. \{'transformer': 100\} "
     r"for 50 steps under classifier-free guidance run as two batches\), or leave it out to "
     r"learn them from the first call"),
    ({"passes": {"transformer": True}}, r"passes=\{'transformer': True\}; give an object"),
    ({"passes": {}}, r"passes=\{\}; give an object of group names"),
    ({"passes": [2]}, r"passes=\[2\]; give an object of group names"),
    ({"passes": {"t": 1.5}}, r"passes=\{'t': 1\.5\}; give an object"),
    ({"drift": 0}, r"drift=0; give a positive fraction, e\.g\. 0\.25"),
    ({"drift": "0.1"}, r"drift='0\.1'; give a positive fraction"),
    ({"budget": "1GiB", "headroom": "1GiB"},
     r"auto_options has unknown keys \['budget'\]; the keys are device_budget, headroom, "
     r"phase_order, passes, drift\. Did you mean 'device_budget'\?"),
    ("1GiB",
     r"auto_options='1GiB'; give an object with any of the keys device_budget, headroom, "
     r"phase_order, passes, drift"),
    ([], r"auto_options=\[\]; give an object with any of the keys"),
]


def _surfaces(call, options, message):
    with pytest.raises(ConfigError, match=rf"^offload config field 'auto_options': {message}"):
        call({"mode": "auto", "components": ["dit"], "auto_options": options})


@pytest.mark.fast
@pytest.mark.parametrize(("options", "message"), BAD_AUTO_OPTIONS)
def test_bad_auto_options_surface_with_their_message_from_every_entry(options, message):
    _surfaces(OffloadConfig.from_dict, options, message)
    _surfaces(lambda data: OffloadConfig.from_json(json.dumps(data)), options, message)
    _surfaces(resolve_config, options, message)
    _surfaces(lambda data: resolve_config(json.dumps(data)), options, message)
    _surfaces(lambda data: OffloadConfig(**data), options, message)


@pytest.mark.fast
def test_auto_mode_parses_with_defaults():
    config = OffloadConfig.from_dict({"mode": "auto"})
    assert config.mode in EXTENSION_MODES
    assert config.components == LEGACY_COMPONENTS  # what module mode offloads by default
    assert config.auto_options == AutoOptions()
    assert (dict(config.layer_options), dict(config.module_options)) == ({}, {})
    assert config.weight_transfer_for("dit") == "rank-local"
    assert config.options_for("text_encoder") == LayerOptions()
    assert config.to_dict() == {"mode": "auto", "components": ["dit", "text_encoder"],
                                "auto_options": {}, "pin_memory": True}
    assert OffloadConfig(mode="auto") == config
    assert OffloadConfig.from_dict({"mode": "auto", "auto_options": None}) == config


@pytest.mark.fast
def test_auto_mode_takes_its_options_components_and_module_options():
    config = OffloadConfig.from_json(
        '{"mode": "auto", "components": ["vae", "dit"], "auto_options": {"device_budget": 0.9,'
        ' "headroom": "2GiB", "phase_order": ["transformer", "vae"], "drift": 0.5},'
        ' "module_options": {"dit": {"weight_transfer": "allgather"}}}')
    assert config.components == ("dit", "vae")
    assert config.auto_options == AutoOptions(device_budget=0.9, headroom="2GiB",
                                              phase_order=("transformer", "vae"), drift=0.5)
    assert config.weight_transfer_for("dit") == "allgather"
    assert config.allgathered() == ("dit",)
    assert config.to_dict()["auto_options"] == {"device_budget": 0.9, "headroom": "2GiB",
                                                "phase_order": ["transformer", "vae"],
                                                "drift": 0.5}
    given = AutoOptions(device_budget="1GiB")
    assert OffloadConfig(mode="auto", auto_options=given).auto_options is given


@pytest.mark.fast
def test_other_modes_have_no_auto_options():
    for mode in ("module", "layer"):
        config = OffloadConfig.from_dict({"mode": mode, "components": ["dit"],
                                          "auto_options": None})  # null: as if absent
        assert config.auto_options is None
        assert "auto_options" not in config.to_dict()


@pytest.mark.fast
def test_the_constructor_requires_components_outside_auto_mode():
    with pytest.raises(ConfigError, match=r"^offload config field 'components' is missing; mode "
                                          r"'module' requires it \(list some of 'dit', "
                                          r"'text_encoder', 'vae'\), for example"):
        OffloadConfig(mode="module")
    with pytest.raises(ConfigError, match=r"^offload config field 'mode' is 'sync'; accepted "
                                          r"modes are 'module', 'layer', 'auto'\.$"):
        OffloadConfig(mode="sync")


@pytest.mark.fast
def test_not_a_mapping():
    with pytest.raises(ConfigError, match=r"must be an object \(a mapping\), not \['dit'\]"):
        OffloadConfig.from_dict(["dit"])


@pytest.mark.fast
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


@pytest.mark.fast
def test_json_must_be_a_string():
    with pytest.raises(ConfigError, match=r"JSON must be a string, not int"):
        OffloadConfig.from_json(3)


@pytest.mark.fast
def test_constructor_validates_like_from_dict():
    with pytest.raises(ConfigError, match=r"field 'components' contains 'unet'"):
        OffloadConfig(mode="module", components=["unet"])
    with pytest.raises(ConfigError, match=r"field 'pin_memory' is 'no'"):
        OffloadConfig(mode="module", components=["dit"], pin_memory="no")
    with pytest.raises(ConfigError, match=r"'module_options.\*.weight_transfer' is 'x'"):
        ModuleOptions(weight_transfer="x")
    with pytest.raises(ConfigError, match=r"field 'module_options' is \{'dit': .*\}, but mode "
                                          r"'layer' takes its options in 'layer_options'"):
        OffloadConfig(mode="layer", components=["dit"], module_options={"dit": ModuleOptions()})


# -- the legacy switch --------------------------------------------------------------------------


@pytest.mark.fast
def test_off_unless_asked():
    assert resolve_config(None) is None
    assert resolve_config(None, enable_cpu_offload=False) is None


@pytest.mark.fast
def test_legacy_switch_means_module_mode_with_dit_and_text_encoder():
    # vLLM-Omni 0.30's model-level backend, given the switch alone, swaps every DiT against every
    # encoder (tests/test_config_parity.py pins where its code says so).
    assert resolve_config(enable_cpu_offload=True) == OffloadConfig(
        mode="module", components=("dit", "text_encoder")
    )


@pytest.mark.fast
@pytest.mark.parametrize(
    "config",
    [
        {"mode": "module", "components": ["text_encoder", "dit"]},
        {"mode": "module", "components": ["dit"],
         "module_options": {"dit": {"weight_transfer": "allgather"}}},
        '{"mode": "module", "components": ["dit", "text_encoder", "vae"]}',
        {"mode": "module", "components": ["dit"]},
        {"mode": "module", "components": ["vae"], "pin_memory": False},
        OffloadConfig(mode="module", components=["text_encoder"], pin_memory=False),
    ],
)
def test_legacy_switch_with_a_module_mode_config_keeps_the_config(config):
    resolved = resolve_config(config, enable_cpu_offload=True)
    assert resolved == resolve_config(config)


@pytest.mark.fast
def test_legacy_switch_with_a_layer_mode_config_is_refused():
    with pytest.raises(ConfigError, match=r"enable_cpu_offload=True asks for module mode, but the "
                                          r"offload config given with it is \{'mode': 'layer', "
                                          r".*\(mode 'layer'\); drop enable_cpu_offload \(the "
                                          r"config alone decides\), or give a config with "
                                          r"\"mode\": \"module\""):
        resolve_config({"mode": "layer", "components": ["dit"]}, enable_cpu_offload=True)


@pytest.mark.fast
def test_legacy_switch_with_an_auto_config_is_refused():
    with pytest.raises(ConfigError, match=r"enable_cpu_offload=True asks for module mode, but the "
                                          r"offload config given with it is \{'mode': 'auto', "
                                          r".*\(mode 'auto'\); drop enable_cpu_offload \(the "
                                          r"config alone decides\), or give a config with "
                                          r"\"mode\": \"module\""):
        resolve_config('{"mode": "auto"}', enable_cpu_offload=True)


@pytest.mark.fast
def test_json_null_means_offloading_off():
    assert resolve_config("null") is None
    assert resolve_config(" null ", enable_cpu_offload=True) == resolve_config(
        enable_cpu_offload=True)


@pytest.mark.fast
def test_legacy_switch_must_be_a_bool():
    with pytest.raises(ConfigError, match=r"field 'enable_cpu_offload' is 'true' \(str\); "
                                          r"accepted values are true and false"):
        resolve_config(None, enable_cpu_offload="true")


@pytest.mark.fast
def test_resolve_refuses_json_that_is_not_an_object():
    with pytest.raises(ConfigError, match=r"must be an object \(a mapping\), not 5"):
        resolve_config("5")


@pytest.mark.fast
def test_resolve_refuses_other_types():
    with pytest.raises(ConfigError, match=r"must be an OffloadConfig, a mapping or a JSON "
                                          r"string, not int \(5\)"):
        resolve_config(5)
