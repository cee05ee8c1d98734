"""The config accepts what vLLM-Omni 0.30 accepts, with the same meaning, and refuses what it refuses.

A differential test: Hypothesis generates offload configs, valid and not (missing and unknown fields,
wrong types, None, repeats, junk), and each one goes through `resolve_config` here and through
vLLM-Omni 0.30.0's own ``parse_diffusion_offload_config`` / ``resolve_offload``, loaded from the
pinned wheel (tests/_vllm_omni.py).  Both must accept or both refuse; when both accept, the meaning
must match: mode, the components offloaded, each selected component's layer options and weight
transfer, pin_memory.

The documented extensions (docs/surface.md) are the only expected differences, each named here:

* "vae": a third component, with text_encoder's rules (no resident layers); vLLM-Omni refuses it.
* "module_options": module mode's per-component weight transfer (``{"dit": {"weight_transfer":
  "allgather"}}``); vLLM-Omni refuses the field.  A config with it means what the config without
  it means, with those transfers, when the options are well formed (see `with_module_options`).
* mode "auto" (`EXTENSION_MODES`) and its "auto_options" (`EXTENSION_FIELDS`): a plan chosen from a
  device budget.  An auto config means what it means with "mode": "module" (components absent:
  `LEGACY_COMPONENTS`), with its `AutoOptions`; "auto_options" with another mode is refused (see
  `with_auto`).
* "order" (`EXTENSION_FIELDS`): how threads waiting for groups take turns, in every mode; a
  config with it means what the config without it means, with that `TurnOrder` (a malformed one
  refused: see `with_order`).
* JSON text: ``resolve_config`` also takes the ``--diffusion-offload-config`` string itself.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from types import SimpleNamespace

import attrs
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from residency.options.budget import AutoOptions
from residency.options.order import TurnOrder, as_turn_order
from residency.options.vllm_omni import (
    EXTENSION_FIELDS,
    EXTENSION_MODES,
    LEGACY_COMPONENTS,
    WEIGHT_TRANSFERS,
    resolve_config,
)
from residency.core.errors import ConfigError

from _vllm_omni import vllm_omni_config, wheel_source

VO = vllm_omni_config()

REJECT = "rejected"
OFF = "offloading off"


@attrs.frozen
class Meaning:
    """What an accepted config asks for, in terms both parsers share."""

    mode: str
    components: frozenset
    #: component -> (weight_transfer, resident_layers), for every selected component.
    layer_options: tuple
    pin_memory: bool
    #: component -> the weight transfer it runs with, for every selected component.
    transfers: tuple
    #: Mode "auto" only (an extension): the plan's options.
    auto_options: AutoOptions | None = None
    #: The order of turns (an extension; None: the scheduler's default).
    order: TurnOrder | None = None


def _options(table: Mapping) -> tuple:
    return tuple(sorted(table.items()))


# -- the two sides ------------------------------------------------------------------------------


def ours(value, enable_cpu_offload=False):
    """Our verdict; any error but `ConfigError` fails the test (a refusal must be typed)."""
    try:
        config = resolve_config(value, enable_cpu_offload=enable_cpu_offload)
    except ConfigError:
        return REJECT
    if config is None:
        return OFF
    options = {c: (config.options_for(c).weight_transfer, config.options_for(c).resident_layers)
               for c in config.components}
    transfers = {c: config.weight_transfer_for(c) for c in config.components}
    return Meaning(config.mode, frozenset(config.components), _options(options), config.pin_memory,
                   _options(transfers), config.auto_options, config.order)


def theirs(value, enable_cpu_offload=False):
    """vLLM-Omni 0.30's verdict, through ``resolve_offload`` on an engine config holding both."""
    engine = SimpleNamespace(diffusion_offload_config=value, enable_cpu_offload=enable_cpu_offload)
    try:
        resolved = VO.resolve_offload(engine)
    except (TypeError, ValueError):
        return REJECT
    if resolved.strategy is VO.OffloadStrategy.NONE:
        return OFF
    public = resolved.public
    if public is None:  # the legacy switch alone: see test_the_legacy_switch_alone_...
        defaults = {c: ("rank-local", 0) for c in LEGACY_TOPOLOGY}
        return Meaning("module", LEGACY_TOPOLOGY, _options(defaults), resolved.pin_memory,
                       _options(_module_mode_transfers(LEGACY_TOPOLOGY)))
    options = {c: ((o.weight_transfer or VO.DLOTransfer.RANK_LOCAL).value, o.resident_layers)
               for c, o in public.layer_options.items()}
    transfers = (_module_mode_transfers(public.components) if public.mode.value == "module"
                 else {c: transfer for c, (transfer, _) in options.items()})
    return Meaning(public.mode.value, public.components, _options(options), resolved.pin_memory,
                   _options(transfers))


def _module_mode_transfers(components) -> dict:
    """vLLM-Omni 0.30's module mode copies every component rank-local (it has no all-gather)."""
    return {c: "rank-local" for c in components}


#: What 0.30's model-level backend offloads for the legacy switch alone (components=None).
LEGACY_TOPOLOGY = frozenset({"dit", "text_encoder"})


# -- the "vae" extension ------------------------------------------------------------------------


def _component_list(value) -> Collection | None:
    components = value.get("components") if isinstance(value, Mapping) else None
    if isinstance(components, (str, bytes, Mapping)) or not isinstance(components, Collection):
        return None
    return components


def _option_table(value) -> Mapping | None:
    options = value.get("layer_options") if isinstance(value, Mapping) else None
    return options if isinstance(options, Mapping) else None


def _mentions(value, component: str) -> bool:
    components, options = _component_list(value), _option_table(value)
    return (components is not None and any(c == component for c in components)) or (
        options is not None and component in options)


def _rewrite(value, rename: dict, drop: str):
    """`value` with component `drop` removed and the components in `rename` renamed."""
    data = dict(value)
    components, options = _component_list(value), _option_table(value)
    if components is not None:
        kept = [rename.get(c, c) if isinstance(c, str) else c for c in components if c != drop]
        data["components"] = kept if isinstance(components, list) else type(components)(kept)
    if options is not None:
        data["layer_options"] = {rename.get(k, k) if isinstance(k, str) else k: v
                                 for k, v in options.items() if k != drop}
    return data


def expected(value, enable_cpu_offload=False):
    """vLLM-Omni's verdict, extended by "auto", "module_options" and "vae" (see the module
    docstring)."""
    if isinstance(value, Mapping) and "order" in value:
        assert theirs(value, enable_cpu_offload) == REJECT  # vLLM-Omni does refuse the field
        rest = {key: item for key, item in value.items() if key != "order"}
        return with_order(expected(rest, enable_cpu_offload), value["order"])
    if isinstance(value, Mapping) and (_is_auto(value) or "auto_options" in value):
        return with_auto(value, enable_cpu_offload)
    if isinstance(value, Mapping) and "module_options" in value:
        assert theirs(value, enable_cpu_offload) == REJECT  # vLLM-Omni does refuse the field
        rest = {key: item for key, item in value.items() if key != "module_options"}
        return with_module_options(expected_with_vae(rest, enable_cpu_offload),
                                   value["module_options"])
    return expected_with_vae(value, enable_cpu_offload)


def expected_with_vae(value, enable_cpu_offload=False):
    """vLLM-Omni's verdict, extended by "vae": a second non-DiT component with text_encoder's rules.

    A config naming "vae" is judged twice by vLLM-Omni: once with "vae" in text_encoder's place
    (text_encoder's own entries dropped) and, when it also names text_encoder, once without "vae".
    It is accepted when both are, and means their union.
    """
    if not _mentions(value, "vae"):
        return theirs(value, enable_cpu_offload)
    assert theirs(value, enable_cpu_offload) == REJECT  # vLLM-Omni does refuse "vae"
    as_encoder = theirs(_rewrite(value, {"vae": "text_encoder"}, drop="text_encoder"),
                        enable_cpu_offload)
    without = (theirs(_rewrite(value, {}, drop="vae"), enable_cpu_offload)
               if _mentions(value, "text_encoder") else None)
    if REJECT in (as_encoder, without):
        return REJECT
    vae_options = dict(as_encoder.layer_options)["text_encoder"]
    vae_transfer = dict(as_encoder.transfers)["text_encoder"]
    rest = without or attrs.evolve(
        as_encoder, components=as_encoder.components - {"text_encoder"},
        layer_options=tuple(o for o in as_encoder.layer_options if o[0] != "text_encoder"),
        transfers=tuple(t for t in as_encoder.transfers if t[0] != "text_encoder"))
    return attrs.evolve(rest, components=rest.components | {"vae"},
                        layer_options=_options({**dict(rest.layer_options), "vae": vae_options}),
                        transfers=_options({**dict(rest.transfers), "vae": vae_transfer}))


# -- the "order" extension -----------------------------------------------------------------------


def with_order(meaning, order):
    """The meaning of a config accepted without "order", once it is added (or REJECT): any mode
    takes it; null means the default; a malformed order is refused."""
    if meaning in (REJECT, OFF):
        return meaning
    try:
        parsed = None if order is None else as_turn_order(order)
    except ConfigError:
        return REJECT
    return attrs.evolve(meaning, order=parsed)


# -- the "module_options" extension --------------------------------------------------------------


def with_module_options(meaning, options):
    """The meaning of a config accepted without its `options`, once they are added (or REJECT).

    The extension's rules, written out: a mapping, empty unless in module mode (as vLLM-Omni
    takes an empty ``layer_options`` in module mode), keyed by selected components (strings);
    each value a mapping with at most the key "weight_transfer", one of `WEIGHT_TRANSFERS`; a
    component given none is "rank-local".
    """
    if meaning == REJECT or not isinstance(options, Mapping):
        return REJECT
    if options and meaning.mode != "module":
        return REJECT
    transfers = dict(meaning.transfers)
    for component, table in options.items():
        if not isinstance(component, str) or component not in meaning.components:
            return REJECT
        if not isinstance(table, Mapping) or set(table) - {"weight_transfer"}:
            return REJECT
        transfer = table.get("weight_transfer", "rank-local")
        if not isinstance(transfer, str) or transfer not in WEIGHT_TRANSFERS:
            return REJECT
        transfers[component] = transfer
    return attrs.evolve(meaning, transfers=_options(transfers))


# -- the "auto" extension ------------------------------------------------------------------------


def _is_auto(value: Mapping) -> bool:
    return isinstance(value.get("mode"), str) and value["mode"] in EXTENSION_MODES


def with_auto(value: Mapping, enable_cpu_offload=False):
    """The verdict on a config with mode "auto" or an "auto_options" field (or REJECT).

    The extension's rules, written out: "auto_options" is for mode "auto" only (null counts as
    absent, as for "pin_memory"); an auto config is judged as the config with "mode": "module"
    and without "auto_options" (so "layer_options" is refused as in module mode, and
    "module_options" taken as there), its "components" defaulting to `LEGACY_COMPONENTS`; the
    legacy switch, which asks for module mode, refuses it; its "auto_options" must parse as
    `AutoOptions` (whose refusals tests/test_config.py checks one by one).
    """
    assert theirs(value, enable_cpu_offload) == REJECT  # vLLM-Omni refuses both
    given = value.get("auto_options")
    rest = {key: item for key, item in value.items() if key != "auto_options"}
    if not _is_auto(value):
        return REJECT if given is not None else expected(rest, enable_cpu_offload)
    if enable_cpu_offload:
        return REJECT
    meaning = expected({"components": list(LEGACY_COMPONENTS), **rest, "mode": "module"})
    if meaning == REJECT:
        return REJECT
    try:
        options = AutoOptions() if given is None else AutoOptions.from_dict(given)
    except ConfigError:
        return REJECT
    return attrs.evolve(meaning, mode="auto", auto_options=options)


# -- the configs --------------------------------------------------------------------------------

_junk = st.one_of(
    st.none(), st.booleans(), st.integers(-2, 3), st.floats(allow_nan=False, width=16),
    st.text(max_size=4), st.lists(st.integers(0, 1), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(0, 1), max_size=1),
)
_names = st.sampled_from(["dit", "text_encoder", "vae", "unet", "DIT", ""])
_modes = st.one_of(st.sampled_from(["module", "layer", "auto"]),
                   st.sampled_from(["Module", "sync", "Auto"]), _junk)
_components = st.one_of(
    st.lists(_names, max_size=4),
    st.lists(_names, max_size=3).map(tuple),
    st.frozensets(_names, max_size=3),
    st.lists(st.one_of(_names, _junk), max_size=3),
    _junk,
)
_transfers = st.one_of(st.sampled_from(["rank-local", "allgather"]),
                       st.sampled_from(["sync", "async", "Allgather"]), _junk)
_resident_layers = st.one_of(st.integers(-2, 4), _junk)
_one_layer_options = st.one_of(
    st.fixed_dictionaries({}, optional={"weight_transfer": _transfers,
                                        "resident_layers": _resident_layers}),
    st.fixed_dictionaries({"layers": st.integers(0, 2)}),
    _junk,
)
_layer_options = st.one_of(
    st.dictionaries(_names, _one_layer_options, max_size=3),
    st.dictionaries(st.one_of(_names, st.integers(0, 1)), _one_layer_options, max_size=2),
    _junk,
)
_one_module_options = st.one_of(
    st.fixed_dictionaries({}, optional={"weight_transfer": _transfers}),
    st.fixed_dictionaries({"resident_layers": st.integers(0, 2)}),
    _junk,
)
_module_options = st.one_of(
    st.dictionaries(_names, _one_module_options, max_size=3),
    st.dictionaries(st.one_of(_names, st.integers(0, 1)), _one_module_options, max_size=2),
    _junk,
)
_auto_options = st.one_of(
    st.fixed_dictionaries({}, optional={
        "device_budget": st.one_of(st.sampled_from(["1GiB", "500 MB", "12 parsecs", 0.5, 1.0, 2.0,
                                                    0, -1, None]), st.integers(1, 2**40)),
        "headroom": st.sampled_from(["64MiB", 0, 1024, -1, None]),
        "phase_order": st.sampled_from([["transformer", "vae"], [], [""], None]),
        "passes": st.sampled_from([{"transformer": 2}, {}, {"transformer": 0}, {"t": True},
                                   {"": 1}, [2], None]),
        "drift": st.sampled_from([0.25, 1, 0, -0.5]),
    }),
    st.fixed_dictionaries({"budget": st.integers(0, 2)}),
    _junk,
)
_pin_memory = st.one_of(st.none(), st.booleans(), _junk)
_orders = st.one_of(st.sampled_from([
    "group", "arrival", "fifo", 3, ["group"], None, {"by": "group"}, {"by": "arrival"},
    {"by": "group", "max_wait": 0.1}, {"by": "group", "max_wait": 0}, {"max_wait": 1},
    {"by": "group", "max_wait": -1}, {"by": "group", "max_wait": float("nan")},
    {"by": "group", "max_wait": True}, {"by": "arrival", "wait": 1}]), _junk)
configs = st.fixed_dictionaries({}, optional={
    "mode": _modes, "components": _components, "layer_options": _layer_options,
    "module_options": _module_options, "auto_options": _auto_options, "pin_memory": _pin_memory,
    "resident_layers": st.integers(0, 1), "order": _orders,
})
values = st.one_of(configs, st.none(), st.integers(), st.lists(_names, max_size=2))

#: The differences the issue found by hand; each must now agree (or be a named extension).
KNOWN = [
    {"mode": "module"},
    {"mode": "module", "components": []},
    {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"resident_layers": 0}}},
    {"mode": "layer", "components": ["text_encoder"],
     "layer_options": {"text_encoder": {"weight_transfer": "allgather"}}},
    {"mode": "module", "components": ["dit"], "pin_memory": None},
    {"mode": "layer", "components": ["text_encoder"],
     "layer_options": {"text_encoder": {"resident_layers": 1}}},
    {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"weight_transfer": "sync"}}},
    {"mode": "layer", "components": ["dit"],
     "layer_options": {"dit": {"weight_transfer": "allgather", "resident_layers": 2}}},
    {"mode": "module", "components": ["dit", "dit"]},
    {"mode": "module", "components": ["vae", "dit"]},
    {"mode": "layer", "components": ["vae", "text_encoder"],
     "layer_options": {"vae": {"weight_transfer": "allgather"}, "text_encoder": {}}},
    {"mode": "layer", "components": ["vae"], "layer_options": {"vae": {"resident_layers": 1}}},
    {"mode": "module", "components": ["dit", "text_encoder"],
     "module_options": {"dit": {"weight_transfer": "allgather"}}},
    {"mode": "module", "components": ["vae", "dit"],
     "module_options": {"vae": {"weight_transfer": "allgather"}, "dit": {}}},
    {"mode": "layer", "components": ["dit"],
     "module_options": {"dit": {"weight_transfer": "allgather"}}},
    {"mode": "module", "components": ["dit"],
     "module_options": {"dit": {"resident_layers": 1}}},
    {"mode": "auto", "auto_options": {"device_budget": "1GiB"}},
    {"mode": "auto", "components": ["vae", "dit"],
     "module_options": {"dit": {"weight_transfer": "allgather"}}},
    {"mode": "auto", "components": ["dit"], "layer_options": {"dit": {"resident_layers": 2}}},
    {"mode": "module", "components": ["dit"], "auto_options": {"device_budget": "1GiB"}},
    {"mode": "auto", "components": ["dit"], "auto_options": {"device_budget": 2.0}},
    {"mode": "auto", "components": [], "auto_options": {}},
    {"mode": "layer", "components": ["dit"], "order": {"by": "group", "max_wait": 0.25}},
    {"mode": "module", "components": ["dit"], "order": "lifo"},
    {"mode": "module", "components": [], "order": "arrival"},
]


def _with_examples(**arguments):
    def decorate(test):
        for value in KNOWN:
            test = example(value=value, **arguments)(test)
        return test
    return decorate


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=values)
@_with_examples()
def test_accepts_and_refuses_what_vllm_omni_does_with_the_same_meaning(value):
    assert ours(value) == expected(value)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=st.one_of(configs, st.none()), enable_cpu_offload=st.booleans())
@_with_examples(enable_cpu_offload=True)
@example(value=None, enable_cpu_offload=True)
@example(value={"mode": "module", "components": ["dit"]}, enable_cpu_offload=True)
@example(value={"mode": "layer", "components": ["dit"]}, enable_cpu_offload=True)
def test_the_legacy_switch_combines_with_a_config_as_in_vllm_omni(value, enable_cpu_offload):
    assert ours(value, enable_cpu_offload) == expected(value, enable_cpu_offload)


_auto_configs = st.fixed_dictionaries({"mode": st.just("auto")}, optional={
    "components": st.lists(st.sampled_from(["dit", "text_encoder", "vae"]), max_size=3),
    "module_options": st.dictionaries(st.sampled_from(["dit", "text_encoder", "vae"]),
                                      st.fixed_dictionaries({}, optional={
                                          "weight_transfer": st.sampled_from(WEIGHT_TRANSFERS)}),
                                      max_size=2),
    "layer_options": st.one_of(st.just({}), st.just({"dit": {}})),
    "auto_options": _auto_options,
    "pin_memory": st.one_of(st.none(), st.booleans()),
})


@settings(max_examples=200, deadline=None)
@given(value=_auto_configs, enable_cpu_offload=st.booleans())
def test_extension_auto_configs_mean_their_module_mode_meaning_with_their_options(
    value, enable_cpu_offload
):
    """Mostly well-formed auto configs (random ones rarely are): each means what `with_auto`
    says."""
    assert ours(value, enable_cpu_offload) == expected(value, enable_cpu_offload)


def _json_configs():
    plain = st.fixed_dictionaries({}, optional={
        "mode": st.sampled_from(["module", "layer", "auto", "x"]),
        "components": st.lists(_names, max_size=3),
        "layer_options": st.dictionaries(_names, st.fixed_dictionaries({}, optional={
            "weight_transfer": st.sampled_from(["rank-local", "allgather", "sync"]),
            "resident_layers": st.integers(-1, 3)}), max_size=2),
        "module_options": st.dictionaries(_names, st.fixed_dictionaries({}, optional={
            "weight_transfer": st.sampled_from(["rank-local", "allgather", "sync"])}),
            max_size=2),
        "auto_options": st.fixed_dictionaries({}, optional={
            "device_budget": st.sampled_from(["1GiB", 0.5, 2.0]),
            "phase_order": st.sampled_from([["vae"], []])}),
        "pin_memory": st.one_of(st.none(), st.booleans()),
    })
    return st.one_of(plain, st.none())


@settings(max_examples=150, deadline=None)
@given(value=_json_configs())
def test_extension_json_text_means_the_object_it_holds(value):
    assert ours(json.dumps(value)) == expected(value)


@pytest.mark.fast
def test_the_known_differences_are_settled():
    verdicts = [ours(value) for value in KNOWN]
    assert verdicts[:2] == [REJECT, REJECT]  # components is required and non-empty
    assert verdicts[2].layer_options == (("dit", ("rank-local", 0)),)
    assert verdicts[3].layer_options == (("text_encoder", ("allgather", 0)),)
    assert verdicts[4].pin_memory is True
    assert verdicts[5:8] == [REJECT, REJECT, REJECT]
    assert verdicts[8].components == {"dit"}
    assert verdicts[9].components == {"vae", "dit"}  # the extension
    assert dict(verdicts[10].layer_options) == {"text_encoder": ("rank-local", 0),
                                                "vae": ("allgather", 0)}
    assert verdicts[11] == REJECT
    assert dict(verdicts[12].transfers) == {"dit": "allgather", "text_encoder": "rank-local"}
    assert dict(verdicts[13].transfers) == {"dit": "rank-local", "vae": "allgather"}
    assert verdicts[14:16] == [REJECT, REJECT]  # module options need module mode, and no layers
    assert [theirs(value) for value in KNOWN[12:14]] == [REJECT, REJECT]  # the extension
    auto, gathered = verdicts[16:18]
    assert (auto.mode, auto.components) == ("auto", set(LEGACY_COMPONENTS))
    assert auto.auto_options == AutoOptions(device_budget="1GiB")
    assert dict(gathered.transfers) == {"dit": "allgather", "vae": "rank-local"}
    assert gathered.auto_options == AutoOptions()
    assert verdicts[18:22] == [REJECT] * 4  # layer options; auto options elsewhere; bad; empty
    assert [theirs(value) for value in KNOWN[16:18]] == [REJECT, REJECT]  # the extension
    ordered, refused, empty = verdicts[22:25]
    assert ordered.order == TurnOrder(by="group", max_wait=0.25) and ordered.mode == "layer"
    assert (refused, empty) == (REJECT, REJECT)  # a bad order; empty components, order or not
    assert [theirs(value) for value in KNOWN[22:24]] == [REJECT, REJECT]  # the extension
    assert (EXTENSION_FIELDS, EXTENSION_MODES) == (
        ("module_options", "auto_options", "order"), ("auto",))


@pytest.mark.fast
def test_the_legacy_switch_alone_offloads_dits_and_encoders_in_vllm_omni():
    """0.30's ``resolve_offload`` reports components {"dit"} for the bare switch, but its model-level
    backend is handed ``components=None`` and then offloads every encoder as well ("the legacy
    encoder topology"); a pipeline's ``enable_omni_model_cpu_offload`` gets no
    ``offload_components``.  These are the lines that say so; `LEGACY_COMPONENTS` follows them.
    """
    resolved = VO.resolve_offload(SimpleNamespace(enable_cpu_offload=True))
    assert (resolved.strategy, resolved.public) == (VO.OffloadStrategy.MODEL_LEVEL, None)
    base = wheel_source("vllm_omni/diffusion/offloader/base.py")
    assert "return self.components is None or self.offloads_encoder(name, plan)" in base
    assert ("if public_config is not None:\n            components: frozenset[str] | None = "
            "resolved.components\n        else:\n            components = None") in base
    backend = wheel_source("vllm_omni/diffusion/offloader/sequential_backend.py")
    resolver = wheel_source("vllm_omni/diffusion/offloader/plan_resolver.py")
    assert "selected = config.should_offload_encoder(path, declaration)" in resolver
    assert "offload_encoder_modules=selected_encoders," in backend
    assert set(LEGACY_COMPONENTS) == LEGACY_TOPOLOGY


@pytest.mark.fast
def test_the_parser_is_the_pinned_one_and_imports_only_the_standard_library():
    assert VO.__name__ == "_vllm_omni_0_30_0_offloader_config"
    assert VO.OFFLOAD_COMPONENTS == frozenset({"dit", "text_encoder"})
    with pytest.raises(ValueError, match=r"requires 'components'"):
        VO.parse_diffusion_offload_config({"mode": "module"})
