"""`OffloadConfig`: the vLLM-Omni offload configuration, parsed and validated in one place.

    config = OffloadConfig.from_json('{"mode": "module", "components": ["dit", "text_encoder"]}')
    scheduler = Scheduler.from_pipeline(pipe, config)
    with scheduler.resident("transformer"):
        ...

The same schema arrives as a dict, a JSON string (``--diffusion-offload-config``) or the legacy
``enable_cpu_offload=True`` switch; `resolve_config` turns any of them into one `OffloadConfig` (or
None: offloading off).  Every refusal is a `ConfigError` naming the field, the value given and what
is accepted.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import attrs

from residency.errors import ConfigError

__all__ = [
    "COMPONENTS",
    "LEGACY_COMPONENTS",
    "MODES",
    "WEIGHT_TRANSFERS",
    "LayerOptions",
    "OffloadConfig",
    "resolve_config",
]

#: Offload modes known to the schema.  Only "module" runs today; "layer" parses.
MODES = ("module", "layer")
#: Component categories a config may select.
COMPONENTS = ("dit", "text_encoder", "vae")
#: What ``enable_cpu_offload=True`` selects (module mode).
LEGACY_COMPONENTS = ("dit", "text_encoder")
#: Accepted ``layer_options[...]["weight_transfer"]`` values.
WEIGHT_TRANSFERS = ("sync", "async")

_FIELDS = ("mode", "components", "layer_options", "pin_memory")
_LAYER_FIELDS = ("weight_transfer", "resident_layers")
_EXAMPLE = '{"mode": "module", "components": ["dit", "text_encoder"]}'


def _accepted(values: Sequence[str]) -> str:
    return ", ".join(repr(v) for v in values)


def _check_mode(_instance: object, _attribute: object, mode: object) -> None:
    if mode not in MODES:
        raise ConfigError(
            f"offload config field 'mode' is {mode!r}; accepted modes are {_accepted(MODES)}"
        )


def _to_components(components: object) -> tuple[str, ...]:
    if not isinstance(components, (list, tuple)):
        raise ConfigError(
            f"offload config field 'components' is {components!r}, not a list; give a list drawn "
            f"from {_accepted(COMPONENTS)}, for example [\"dit\", \"text_encoder\"]"
        )
    for component in components:
        if component not in COMPONENTS:
            raise ConfigError(
                f"offload config field 'components' contains {component!r}; accepted components "
                f"are {_accepted(COMPONENTS)}"
            )
    if len(set(components)) != len(components):
        twice = next(c for c in components if components.count(c) > 1)
        raise ConfigError(
            f"offload config field 'components' lists {twice!r} twice ({list(components)!r}); "
            "list each component once"
        )
    return tuple(components)


def _check_bool(field: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(
            f"offload config field {field!r} is {value!r} ({type(value).__name__}); "
            "accepted values are true and false"
        )


def _check_pin_memory(_instance: object, _attribute: object, value: object) -> None:
    _check_bool("pin_memory", value)


@attrs.frozen(kw_only=True)
class LayerOptions:
    """Layer-mode options for one component (schema only: layer mode is not available yet)."""

    #: How block weights reach the device: "sync" (before the block) or "async" (prefetched).
    weight_transfer: str = attrs.field(default="async")
    #: How many blocks stay on the device at once (at least 1).
    resident_layers: int = attrs.field(default=1)

    @weight_transfer.validator
    def _check_weight_transfer(self, _attribute: object, value: object) -> None:
        if value not in WEIGHT_TRANSFERS:
            raise ConfigError(
                f"offload config field 'layer_options.*.weight_transfer' is {value!r}; accepted "
                f"values are {_accepted(WEIGHT_TRANSFERS)}"
            )

    @resident_layers.validator
    def _check_resident_layers(self, _attribute: object, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"offload config field 'layer_options.*.resident_layers' is {value!r}; "
                "accepted values are whole numbers of at least 1"
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
                    f"are {_accepted(_LAYER_FIELDS)}"
                )
        return cls(**options)

    def to_dict(self) -> dict[str, Any]:
        return {"weight_transfer": self.weight_transfer, "resident_layers": self.resident_layers}


def _to_layer_options(options: object) -> Mapping[str, LayerOptions]:
    if not isinstance(options, Mapping):
        raise ConfigError(
            f"offload config field 'layer_options' is {options!r}, not an object; map a "
            f"component ({_accepted(COMPONENTS)}) to its options, for example "
            '{"dit": {"weight_transfer": "async", "resident_layers": 2}}'
        )
    parsed = {}
    for component, value in options.items():
        if component not in COMPONENTS:
            raise ConfigError(
                f"offload config field 'layer_options' names component {component!r}; accepted "
                f"components are {_accepted(COMPONENTS)}"
            )
        if not isinstance(value, LayerOptions):
            value = LayerOptions.from_dict(component, value)
        parsed[component] = value
    return MappingProxyType(parsed)


@attrs.frozen(kw_only=True)
class OffloadConfig:
    """Which components to offload and how: the vLLM-Omni ``diffusion_offload_config`` schema.

        config = OffloadConfig(mode="module", components=("dit", "text_encoder"))
        scheduler = Scheduler.from_pipeline(pipe, config)
        with scheduler.resident("text_encoder"):
            embeddings = pipe.text_encoder(ids)

    Rules: `mode` is required ("module"; "layer" parses but cannot run yet); `components` is drawn
    from `COMPONENTS` (default: dit and text_encoder); `layer_options` only with ``mode="layer"``,
    keyed by selected components.  `from_dict` / `to_dict` and `from_json` round-trip.
    """

    #: "module" swaps whole components; "layer" (not available yet) would swap blocks.
    mode: str = attrs.field(validator=_check_mode)
    #: Categories whose modules are offloaded; modules of unselected categories stay resident.
    components: tuple[str, ...] = attrs.field(default=LEGACY_COMPONENTS, converter=_to_components)
    #: Layer-mode options per component (empty in module mode).
    layer_options: Mapping[str, LayerOptions] = attrs.field(
        factory=dict, converter=_to_layer_options, hash=False
    )
    #: Pin host masters where the device can use pinned memory (faster, page-locked copies).
    pin_memory: bool = attrs.field(default=True, validator=_check_pin_memory)

    def __attrs_post_init__(self) -> None:
        if self.layer_options and self.mode != "layer":
            raise ConfigError(
                f"offload config field 'layer_options' is {self._layer_options_dict()!r}, but "
                f"mode {self.mode!r} rejects layer options ('weight_transfer', "
                "'resident_layers'); remove 'layer_options', or set \"mode\": \"layer\""
            )
        for component in self.layer_options:
            if component not in self.components:
                raise ConfigError(
                    f"offload config field 'layer_options' names {component!r}, which is not in "
                    f"components {list(self.components)!r}; add it to 'components' or remove "
                    "its options"
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
                close = difflib.get_close_matches(str(key), _FIELDS, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ConfigError(
                    f"offload config has unknown field {key!r}; accepted fields are "
                    f"{_accepted(_FIELDS)}.{hint}"
                )
        if "mode" not in data:
            raise ConfigError(
                f"offload config field 'mode' is missing from {dict(data)!r}; accepted modes are "
                f"{_accepted(MODES)}, for example {_EXAMPLE}"
            )
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> OffloadConfig:
        """Parse a JSON object such as ``'{"mode": "module", "components": ["dit"]}'``."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(
                f"offload config {text!r} is not valid JSON: {error.msg} at line {error.lineno}, "
                f"column {error.colno}; write it like {_EXAMPLE}"
            ) from None
        except TypeError:
            raise ConfigError(
                f"offload config JSON must be a string, not {type(text).__name__}"
            ) from None
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain JSON-ready data; ``from_dict(config.to_dict()) == config``."""
        data: dict[str, Any] = {"mode": self.mode, "components": list(self.components)}
        if self.layer_options:
            data["layer_options"] = self._layer_options_dict()
        data["pin_memory"] = self.pin_memory
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def require_runnable(self) -> None:
        """Raise `ConfigError` when this config cannot run yet (layer mode)."""
        if self.mode == "layer":
            raise ConfigError(
                "offload config field 'mode' is 'layer': layer mode parses but is not available "
                "yet; use \"mode\": \"module\" (whole components swap between host and device)"
            )

    def _layer_options_dict(self) -> dict[str, dict[str, Any]]:
        return {name: options.to_dict() for name, options in self.layer_options.items()}


def resolve_config(
    config: object = None, *, enable_cpu_offload: object = False
) -> OffloadConfig | None:
    """Merge a config (OffloadConfig, dict, JSON string or None) with the legacy switch.

        resolve_config(enable_cpu_offload=True)  # module mode, dit and text_encoder
        resolve_config('{"mode": "module", "components": ["dit"]}')
        resolve_config(None)                       # None: offloading is off

    ``enable_cpu_offload=True`` together with a config is accepted only when the config agrees:
    module mode with both "dit" and "text_encoder" selected; anything else is a `ConfigError`.
    """
    _check_bool("enable_cpu_offload", enable_cpu_offload)
    parsed = _parse_any(config)
    if not enable_cpu_offload:
        return parsed
    if parsed is None:
        return OffloadConfig(mode="module", components=LEGACY_COMPONENTS)
    if parsed.mode != "module" or not set(LEGACY_COMPONENTS) <= set(parsed.components):
        raise ConfigError(
            f"enable_cpu_offload=True means mode 'module' with components "
            f"{list(LEGACY_COMPONENTS)!r}, but the offload config given with it is "
            f"{parsed.to_dict()!r}; drop enable_cpu_offload (the config alone decides) or make "
            "the config select module mode with 'dit' and 'text_encoder'"
        )
    return parsed


def _parse_any(config: object) -> OffloadConfig | None:
    if config is None or isinstance(config, OffloadConfig):
        return config
    if isinstance(config, str):
        return OffloadConfig.from_json(config)
    if isinstance(config, Mapping):
        return OffloadConfig.from_dict(config)
    raise ConfigError(
        f"an offload config must be an OffloadConfig, a mapping or a JSON string, not "
        f"{type(config).__name__} ({config!r}); for example {_EXAMPLE}"
    )
