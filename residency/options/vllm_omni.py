"""`OffloadConfig`: the vLLM-Omni offload configuration, parsed and validated in one place.

    config = OffloadConfig.from_json('{"mode": "module", "components": ["dit", "text_encoder"]}')
    scheduler = Scheduler.from_pipeline(pipe, config)
    with scheduler.resident("transformer"):
        ...

The same schema arrives as a dict, a JSON string (``--diffusion-offload-config``) or the legacy
``enable_cpu_offload=True`` switch; `resolve_config` turns any of them into one `OffloadConfig` (or
None: offloading off).  It accepts exactly what vLLM-Omni 0.30's ``parse_diffusion_offload_config``
accepts, with the same meaning, plus the extensions listed in docs/surface.md ("vae",
``module_options``, mode "auto" with ``auto_options``, ``order``); ``tests/test_config_parity.py`` checks that
against vLLM-Omni's own parser.
Every refusal is a `ConfigError` naming the field, the value given and what is accepted.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Collection, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import attrs

from residency.options.budget import AutoOptions
from residency.options.order import TurnOrder, as_turn_order
from residency.core.errors import ConfigError

__all__ = [
    "COMPONENTS",
    "EXTENSION_COMPONENTS",
    "EXTENSION_FIELDS",
    "EXTENSION_MODES",
    "LEGACY_COMPONENTS",
    "MODES",
    "WEIGHT_TRANSFERS",
    "LayerOptions",
    "ModuleOptions",
    "OffloadConfig",
    "resolve_config",
]

#: Offload modes: "module" swaps whole components, "layer" streams a component's blocks, "auto"
#: lets a plan chosen from a device budget decide, group by group, which of the two (or neither).
MODES = ("module", "layer", "auto")
#: Modes accepted here that vLLM-Omni 0.30 refuses (documented extensions).
EXTENSION_MODES = ("auto",)
#: Component categories a config may select (in this order in `OffloadConfig.components`).
COMPONENTS = ("dit", "text_encoder", "vae")
#: Components accepted here that vLLM-Omni 0.30 refuses (documented extensions).
EXTENSION_COMPONENTS = ("vae",)
#: What ``enable_cpu_offload=True`` alone offloads: vLLM-Omni 0.30's model-level backend, given
#: the legacy switch, swaps every DiT against every encoder (``components=None``: "the legacy
#: topology").
LEGACY_COMPONENTS = ("dit", "text_encoder")
#: Accepted ``weight_transfer`` values (in ``layer_options`` and ``module_options``): each rank
#: copies its own weights ("rank-local", the default) or ranks all-gather shards ("allgather").
WEIGHT_TRANSFERS = ("rank-local", "allgather")
#: Config fields accepted here that vLLM-Omni 0.30 refuses (documented extensions).
EXTENSION_FIELDS = ("module_options", "auto_options", "order")
#: The only component whose layer options may keep blocks resident.
_RESIDENT_LAYERS_COMPONENT = "dit"

_FIELDS = ("mode", "components", "layer_options", "module_options", "auto_options", "pin_memory",
           "order")
#: The modes whose per-component options are `module_options` (auto swaps whole components too).
_MODULE_OPTION_MODES = ("module", "auto")
_LAYER_FIELDS = ("weight_transfer", "resident_layers")
_MODULE_FIELDS = ("weight_transfer",)
_EXAMPLE = '{"mode": "module", "components": ["dit", "text_encoder"]}'


def _accepted(values: Sequence[str]) -> str:
    return ", ".join(repr(v) for v in values)


def _did_you_mean(value: object, accepted: Sequence[str]) -> str:
    """" Did you mean 'x'?" for the accepted value closest to `value`, else ""."""
    close = difflib.get_close_matches(str(value), accepted, n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def _canonical(value: object, accepted: Sequence[str]) -> object:
    """The accepted plain string equal to `value` (a str subclass such as an enum), else `value`."""
    if isinstance(value, str) and value in accepted:
        return accepted[accepted.index(value)]
    return value


def _to_mode(mode: object) -> object:
    return _canonical(mode, MODES)


def _check_mode(_instance: object, _attribute: object, mode: object) -> None:
    if not isinstance(mode, str) or mode not in MODES:
        raise ConfigError(
            f"offload config field 'mode' is {mode!r}; accepted modes are {_accepted(MODES)}."
            f"{_did_you_mean(mode, MODES)}"
        )


def _to_components(components: object) -> tuple[str, ...]:
    """A collection of component names -> the distinct names, in `COMPONENTS` order."""
    if isinstance(components, (str, bytes, Mapping)) or not isinstance(components, Collection):
        raise ConfigError(
            f"offload config field 'components' is {components!r}, not a list; give a list drawn "
            f"from {_accepted(COMPONENTS)}, for example [\"dit\", \"text_encoder\"]"
        )
    for component in components:
        if not isinstance(component, str) or component not in COMPONENTS:
            raise ConfigError(
                f"offload config field 'components' contains {component!r}; accepted components "
                f"are {_accepted(COMPONENTS)}"
            )
    if not components:
        raise ConfigError(
            "offload config field 'components' is empty; select at least one of "
            f"{_accepted(COMPONENTS)}, for example [\"dit\"] (to turn offloading off, give no "
            "offload config at all)"
        )
    return tuple(c for c in COMPONENTS if c in components)


def _default_components(config: OffloadConfig) -> tuple[str, ...]:
    """Mode "auto" without ``components``: what module mode offloads by default (the legacy
    switch's `LEGACY_COMPONENTS`); every other mode requires the field."""
    _check_mode(config, None, config.mode)  # a bad mode first: it decides what is required
    if config.mode == "auto":
        return LEGACY_COMPONENTS
    raise ConfigError(
        f"offload config field 'components' is missing; mode {config.mode!r} requires it (list "
        f"some of {_accepted(COMPONENTS)}), for example {_EXAMPLE}"
    )


def _to_auto_options(options: object) -> AutoOptions | None:
    """``auto_options`` as `AutoOptions`; None (JSON null) stays None, like an absent field."""
    if options is None or isinstance(options, AutoOptions):
        return options
    try:
        return AutoOptions.from_dict(options)
    except ConfigError as error:
        raise ConfigError(f"offload config field 'auto_options': {error}") from None


def _to_order(order: object) -> TurnOrder | None:
    """``order`` as a `TurnOrder`; None (JSON null) stays None: the scheduler's default."""
    if order is None:
        return None
    try:
        return as_turn_order(order)
    except ConfigError as error:
        raise ConfigError(f"offload config field 'order': {error}") from None


def _check_bool(field: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(
            f"offload config field {field!r} is {value!r} ({type(value).__name__}); "
            "accepted values are true and false"
        )


def _to_pin_memory(value: object) -> object:
    """None (JSON null) means the default, like an absent field: pin."""
    return True if value is None else value


def _check_pin_memory(_instance: object, _attribute: object, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(
            f"offload config field 'pin_memory' is {value!r} ({type(value).__name__}); "
            "accepted values are true, false and null (null or absent: true)"
        )


def _to_weight_transfer(value: object) -> object:
    return _canonical(value, WEIGHT_TRANSFERS)


@attrs.frozen(kw_only=True)
class LayerOptions:
    """Layer-mode options for one component: how its blocks reach the device.

        options = LayerOptions(weight_transfer="rank-local", resident_layers=2)
        OffloadConfig(mode="layer", components=("dit",), layer_options={"dit": options})

    Defaults as in vLLM-Omni 0.30: rank-local transfer, no resident layers.  ``resident_layers``
    needs rank-local transfer and is for the "dit" component only (`OffloadConfig` checks that).
    """

    #: How block weights reach the device: "rank-local" (each rank copies its own) or
    #: "allgather" (ranks hold shards and all-gather each block).
    weight_transfer: str = attrs.field(default="rank-local", converter=_to_weight_transfer)
    #: How many leading blocks stay on the device (0: every block streams).
    resident_layers: int = attrs.field(default=0)

    @weight_transfer.validator
    def _check_weight_transfer(self, _attribute: object, value: object) -> None:
        if not isinstance(value, str) or value not in WEIGHT_TRANSFERS:
            raise ConfigError(
                f"offload config field 'layer_options.*.weight_transfer' is {value!r}; accepted "
                f"values are {_accepted(WEIGHT_TRANSFERS)}"
            )

    @resident_layers.validator
    def _check_resident_layers(self, _attribute: object, value: object) -> None:
        if type(value) is not int or value < 0:
            raise ConfigError(
                f"offload config field 'layer_options.*.resident_layers' is {value!r}; "
                "accepted values are whole numbers of at least 0"
            )

    def __attrs_post_init__(self) -> None:
        if self.resident_layers and self.weight_transfer == "allgather":
            raise ConfigError(
                f"offload config field 'layer_options.*.resident_layers' is "
                f"{self.resident_layers}, which needs weight_transfer 'rank-local', but "
                "weight_transfer is 'allgather'; set \"weight_transfer\": \"rank-local\" or "
                "\"resident_layers\": 0"
            )

    @classmethod
    def from_dict(cls, component: str, options: object) -> LayerOptions:
        """Parse ``layer_options[component]``: a mapping of `weight_transfer`, `resident_layers`."""
        field = f"layer_options.{component}"
        if not isinstance(options, Mapping):
            raise ConfigError(
                f"offload config field {field!r} is {options!r}, not an object; accepted keys "
                f"are {_accepted(_LAYER_FIELDS)}"
            )
        for key in options:
            if key not in _LAYER_FIELDS:
                raise ConfigError(
                    f"offload config field {field!r} has unknown key {key!r}; accepted keys "
                    f"are {_accepted(_LAYER_FIELDS)}.{_did_you_mean(key, _LAYER_FIELDS)}"
                )
        return cls(**options)

    def to_dict(self) -> dict[str, Any]:
        return {"weight_transfer": self.weight_transfer, "resident_layers": self.resident_layers}


def _to_options_per_component(
    field: str, options: object, kind: type, example: str
) -> dict[str, Any]:
    """``{component: options}`` from a mapping of component names to `kind`s or their dicts."""
    if not isinstance(options, Mapping):
        raise ConfigError(
            f"offload config field {field!r} is {options!r}, not an object; map a component "
            f"({_accepted(COMPONENTS)}) to its options, for example {example}"
        )
    parsed = {}
    for component, value in options.items():
        if not isinstance(component, str) or component not in COMPONENTS:
            raise ConfigError(
                f"offload config field {field!r} names component {component!r}; accepted "
                f"components are {_accepted(COMPONENTS)}.{_did_you_mean(component, COMPONENTS)}"
            )
        parsed[component] = value if isinstance(value, kind) else kind.from_dict(component, value)
    return parsed


def _to_layer_options(options: object) -> Mapping[str, LayerOptions]:
    parsed = _to_options_per_component(
        "layer_options", options, LayerOptions,
        '{"dit": {"weight_transfer": "rank-local", "resident_layers": 2}}',
    )
    for component, value in parsed.items():
        if value.resident_layers and component != _RESIDENT_LAYERS_COMPONENT:
            raise ConfigError(
                f"offload config field 'layer_options.{component}.resident_layers' is "
                f"{value.resident_layers}; resident layers are for the "
                f"{_RESIDENT_LAYERS_COMPONENT!r} component only: remove it or set it to 0"
            )
    return MappingProxyType(parsed)


@attrs.frozen(kw_only=True)
class ModuleOptions:
    """Module-mode options for one component: how its whole weights reach the device.

        OffloadConfig(mode="module", components=("dit",),
                      module_options={"dit": ModuleOptions(weight_transfer="allgather")})

    An extension (docs/surface.md): vLLM-Omni 0.30 has no all-gather in module mode and refuses
    options there.  ``"allgather"``: the ranks of a node share the component's host master, each
    copies 1/k of it host to device and one all-gather assembles it (`residency.multirank.sharded`); it needs
    ``process_group=`` with several ranks per host.  ``"rank-local"`` (the default): each rank
    copies all of it.
    """

    #: "rank-local" (each rank copies the whole component) or "allgather" (each copies 1/k).
    weight_transfer: str = attrs.field(default="rank-local", converter=_to_weight_transfer)

    @weight_transfer.validator
    def _check_weight_transfer(self, _attribute: object, value: object) -> None:
        if not isinstance(value, str) or value not in WEIGHT_TRANSFERS:
            raise ConfigError(
                f"offload config field 'module_options.*.weight_transfer' is {value!r}; accepted "
                f"values are {_accepted(WEIGHT_TRANSFERS)}"
            )

    @classmethod
    def from_dict(cls, component: str, options: object) -> ModuleOptions:
        """Parse ``module_options[component]``: a mapping with at most `weight_transfer`."""
        field = f"module_options.{component}"
        if not isinstance(options, Mapping):
            raise ConfigError(
                f"offload config field {field!r} is {options!r}, not an object; accepted keys "
                f"are {_accepted(_MODULE_FIELDS)}, for example {{\"weight_transfer\": "
                "\"allgather\"}"
            )
        for key in options:
            if key in _LAYER_FIELDS and key not in _MODULE_FIELDS:
                raise ConfigError(
                    f"offload config field {field!r} has key {key!r}, a layer-mode option; module "
                    f"mode accepts only {_accepted(_MODULE_FIELDS)}: remove it, or give it in "
                    "'layer_options' with \"mode\": \"layer\""
                )
            if key not in _MODULE_FIELDS:
                raise ConfigError(
                    f"offload config field {field!r} has unknown key {key!r}; accepted keys "
                    f"are {_accepted(_MODULE_FIELDS)}.{_did_you_mean(key, _MODULE_FIELDS)}"
                )
        return cls(**options)

    def to_dict(self) -> dict[str, Any]:
        return {"weight_transfer": self.weight_transfer}


def _to_module_options(options: object) -> Mapping[str, ModuleOptions]:
    return MappingProxyType(_to_options_per_component(
        "module_options", options, ModuleOptions, '{"dit": {"weight_transfer": "allgather"}}'
    ))


@attrs.frozen(kw_only=True)
class OffloadConfig:
    """Which components to offload and how: the vLLM-Omni ``diffusion_offload_config`` schema.

        config = OffloadConfig(mode="module", components=("dit", "text_encoder"))
        scheduler = Scheduler.from_pipeline(pipe, config)
        with scheduler.resident("text_encoder"):
            embeddings = pipe.text_encoder(ids)

    Rules (vLLM-Omni 0.30's): `mode` and `components` are required; `components` is a non-empty
    collection drawn from `COMPONENTS` (repeats count once; "vae" is this library's extension);
    `layer_options` only with ``mode="layer"``, keyed by selected components; `pin_memory` is a
    bool, or None for the default (true).  This library's extensions: `module_options` only with
    ``mode="module"`` or ``"auto"``, keyed by selected components (``{"dit": {"weight_transfer":
    "allgather"}}``); ``mode="auto"``, where a plan chosen from `auto_options` (a device budget)
    decides what stays, swaps or streams:

        OffloadConfig.from_dict({"mode": "auto", "auto_options": {"device_budget": "24GiB"}})
        # components ('dit', 'text_encoder') (absent under auto: LEGACY_COMPONENTS),
        # auto_options AutoOptions(device_budget='24GiB', ...)

    Under "auto", `components` means what it means in module mode (absent: `LEGACY_COMPONENTS`),
    `auto_options` is always an `AutoOptions` (absent or None: the defaults) and `layer_options`
    is refused (the plan chooses what streams); `auto_options` with another mode is refused.
    `weight_transfer_for` says how a component's weights reach the device in any mode.
    `from_dict` / `to_dict` and `from_json` round-trip.
    """

    #: "module" swaps whole components; "layer" streams a component's blocks; "auto": a plan
    #: chosen from `auto_options` decides.
    mode: str = attrs.field(converter=_to_mode, validator=_check_mode)
    #: Categories whose modules are offloaded, in `COMPONENTS` order; the modules of unselected
    #: categories stay resident.
    components: tuple[str, ...] = attrs.field(
        default=attrs.Factory(_default_components, takes_self=True), converter=_to_components
    )
    #: Layer-mode options per component, as given (empty in module mode); see `options_for`.
    layer_options: Mapping[str, LayerOptions] = attrs.field(
        factory=dict, converter=_to_layer_options, hash=False
    )
    #: Module-mode options per component, as given (empty in layer mode; an extension of
    #: vLLM-Omni's schema); see `weight_transfer_for`.
    module_options: Mapping[str, ModuleOptions] = attrs.field(
        factory=dict, converter=_to_module_options, hash=False
    )
    #: The auto plan's options (device budget, headroom, ...): an `AutoOptions` under mode
    #: "auto" (the defaults when none are given), else None (an extension of vLLM-Omni's schema).
    auto_options: AutoOptions | None = attrs.field(default=None, converter=_to_auto_options)
    #: Pin host masters where the device can use pinned memory (faster, page-locked copies).
    pin_memory: bool = attrs.field(
        default=True, converter=_to_pin_memory, validator=_check_pin_memory
    )
    #: How threads waiting for groups take turns ("group", "arrival" or ``{"by": ...,
    #: "max_wait": ...}``; None: the scheduler's default), in every mode (an extension).
    order: TurnOrder | None = attrs.field(default=None, converter=_to_order)

    def __attrs_post_init__(self) -> None:
        for field, options in (("layer_options", self.layer_options),
                               ("module_options", self.module_options)):
            for component in options:
                if component not in self.components:
                    raise ConfigError(
                        f"offload config field {field!r} names {component!r}, which is not in "
                        f"components {list(self.components)!r}; add it to 'components' or "
                        "remove its options"
                    )
        if self.layer_options and self.mode == "auto":
            raise ConfigError(self._auto_mode_layer_options_message())
        if self.layer_options and self.mode != "layer":
            raise ConfigError(self._module_mode_options_message())
        if self.module_options and self.mode not in _MODULE_OPTION_MODES:
            raise ConfigError(self._layer_mode_options_message())
        self._settle_auto_options()

    def _settle_auto_options(self) -> None:
        """Mode "auto" always has its options (the defaults when none were given); no other mode
        takes any."""
        if self.mode == "auto":
            if self.auto_options is None:
                object.__setattr__(self, "auto_options", AutoOptions())  # still being made
        elif self.auto_options is not None:
            raise ConfigError(
                f"offload config field 'auto_options' is {self.auto_options.to_dict()!r}, but "
                f"mode {self.mode!r} takes no auto options (they are the device budget of an auto "
                "plan); set \"mode\": \"auto\", or drop 'auto_options'"
            )

    def _auto_mode_layer_options_message(self) -> str:
        return (
            f"offload config field 'layer_options' is {self._layer_options_dict()!r}, but mode "
            "'auto' chooses itself which blocks stream and which stay resident; remove "
            "'layer_options', or set \"mode\": \"layer\" to fix weight_transfer and "
            "resident_layers by hand"
        )

    def _module_mode_options_message(self) -> str:
        message = (
            f"offload config field 'layer_options' is {self._layer_options_dict()!r}, but "
            f"mode {self.mode!r} rejects layer options ('weight_transfer', 'resident_layers'); "
            "remove 'layer_options', or set \"mode\": \"layer\""
        )
        gathered = {component: {"weight_transfer": "allgather"}
                    for component, options in self.layer_options.items()
                    if options.weight_transfer == "allgather"}
        if gathered:
            message += (
                ". To all-gather whole components in module mode, give \"module_options\": "
                f"{json.dumps(gathered)} instead (an extension of vLLM-Omni's schema, see "
                "docs/surface.md)"
            )
        return message

    def _layer_mode_options_message(self) -> str:
        options = self._module_options_dict()
        return (
            f"offload config field 'module_options' is {options!r}, but mode {self.mode!r} takes "
            f"its options in 'layer_options'; give \"layer_options\": {json.dumps(options)} "
            "instead, or set \"mode\": \"module\""
        )

    # -- parsing -------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: object) -> OffloadConfig:
        """Parse a mapping such as ``{"mode": "module", "components": ["dit"]}``."""
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"an offload config must be an object (a mapping), not {data!r}; write it like "
                f"{_EXAMPLE}"
            )
        for key in data:
            if key not in _FIELDS:
                raise ConfigError(
                    f"offload config has unknown field {key!r}; accepted fields are "
                    f"{_accepted(_FIELDS)}.{_did_you_mean(key, _FIELDS)}"
                )
        required = {"mode": f"accepted modes are {_accepted(MODES)}",
                    "components": f"list some of {_accepted(COMPONENTS)}"}
        if isinstance(data.get("mode"), str) and data["mode"] == "auto":  # module mode's default
            del required["components"]
        for key, accepted in required.items():
            if key not in data:
                raise ConfigError(
                    f"offload config field {key!r} is missing from {dict(data)!r}; it is "
                    f"required ({accepted}), for example {_EXAMPLE}"
                )
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> OffloadConfig:
        """Parse a JSON object such as ``'{"mode": "module", "components": ["dit"]}'``."""
        return cls.from_dict(_load_json(text))

    def to_dict(self) -> dict[str, Any]:
        """The config as plain JSON-ready data; ``from_dict(config.to_dict()) == config``."""
        data: dict[str, Any] = {"mode": self.mode, "components": list(self.components)}
        if self.layer_options:
            data["layer_options"] = self._layer_options_dict()
        if self.module_options:
            data["module_options"] = self._module_options_dict()
        if self.auto_options is not None:
            data["auto_options"] = self.auto_options.to_dict()
        data["pin_memory"] = self.pin_memory
        if self.order is not None:
            data["order"] = self.order.to_dict()
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def options_for(self, component: str) -> LayerOptions:
        """The layer options `component` runs with: as given, else the defaults.

            OffloadConfig(mode="layer", components=["dit"]).options_for("dit")
            # LayerOptions(weight_transfer='rank-local', resident_layers=0)
        """
        self._check_selected(component)
        return self.layer_options.get(component, _DEFAULT_LAYER_OPTIONS)

    def weight_transfer_for(self, component: str) -> str:
        """How a selected component's weights reach the device: "rank-local" or "allgather".

            config = OffloadConfig.from_dict({
                "mode": "module", "components": ["dit", "text_encoder"],
                "module_options": {"dit": {"weight_transfer": "allgather"}}})
            config.weight_transfer_for("dit")            # 'allgather'
            config.weight_transfer_for("text_encoder")   # 'rank-local' (no options: the default)

        Module and auto mode read `module_options`, layer mode `layer_options`; a component given
        no options is "rank-local".  Raises `ConfigError` for a component that is not selected.
        """
        self._check_selected(component)
        table = self.module_options if self.mode in _MODULE_OPTION_MODES else self.layer_options
        options = table.get(component)
        return "rank-local" if options is None else options.weight_transfer

    def allgathered(self) -> tuple[str, ...]:
        """The selected components whose weights the ranks all-gather, in `COMPONENTS` order.

            config.allgathered()   # ('dit',) with "module_options": {"dit": {"weight_transfer":
                                   # "allgather"}}; () when every component is rank-local
        """
        return tuple(c for c in self.components if self.weight_transfer_for(c) == "allgather")

    def require_runnable(self) -> None:
        """Every valid config runs, in either mode: a check that raises nothing.

            config.require_runnable()    # kept for callers that check before building a plan

        It refused layer mode while layer mode was not built; a config that cannot run is now
        refused when it is made.
        """

    def _check_selected(self, component: str) -> None:
        if component not in self.components:
            raise ConfigError(
                f"component {component!r} is not selected (components "
                f"{list(self.components)!r}); ask for one of them"
            )

    def _layer_options_dict(self) -> dict[str, dict[str, Any]]:
        return {name: options.to_dict() for name, options in self.layer_options.items()}

    def _module_options_dict(self) -> dict[str, dict[str, Any]]:
        return {name: options.to_dict() for name, options in self.module_options.items()}


_DEFAULT_LAYER_OPTIONS = LayerOptions()


def _load_json(text: object) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"offload config {text!r} is not valid JSON: {error.msg} at line {error.lineno}, "
            f"column {error.colno}; write it like {_EXAMPLE}"
        ) from None
    except TypeError:
        raise ConfigError(
            f"offload config JSON must be a string, not {type(text).__name__}"
        ) from None


def resolve_config(
    config: object = None, *, enable_cpu_offload: object = False
) -> OffloadConfig | None:
    """Merge a config (OffloadConfig, dict, JSON string or None) with the legacy switch.

        resolve_config(enable_cpu_offload=True)  # module mode, dit and text_encoder
        resolve_config('{"mode": "module", "components": ["dit"]}')
        resolve_config(None)                       # None: offloading is off (so is JSON 'null')

    As in vLLM-Omni 0.30: ``enable_cpu_offload=True`` alone offloads every DiT and every encoder
    in turn (`LEGACY_COMPONENTS`); with a config it is accepted when the config is of the same
    strategy (module mode), and then the config alone decides.  With a layer-mode or auto config
    it is a `ConfigError`.
    """
    _check_bool("enable_cpu_offload", enable_cpu_offload)
    parsed = _parse_any(config)
    if not enable_cpu_offload:
        return parsed
    if parsed is None:
        return OffloadConfig(mode="module", components=LEGACY_COMPONENTS)
    if parsed.mode != "module":
        raise ConfigError(
            f"enable_cpu_offload=True asks for module mode, but the offload config given with it "
            f"is {parsed.to_dict()!r} (mode {parsed.mode!r}); drop enable_cpu_offload (the config "
            "alone decides), or give a config with \"mode\": \"module\""
        )
    return parsed


def _parse_any(config: object) -> OffloadConfig | None:
    if isinstance(config, str):
        data = _load_json(config)
        return None if data is None else OffloadConfig.from_dict(data)
    if config is None or isinstance(config, OffloadConfig):
        return config
    if isinstance(config, Mapping):
        return OffloadConfig.from_dict(config)
    raise ConfigError(
        f"an offload config must be an OffloadConfig, a mapping or a JSON string, not "
        f"{type(config).__name__} ({config!r}); for example {_EXAMPLE}"
    )
