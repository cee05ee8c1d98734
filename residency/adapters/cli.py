"""argparse flags for offloading: ``--diffusion-offload-config JSON`` and ``--enable-cpu-offload``.

    parser = argparse.ArgumentParser()
    add_offload_arguments(parser)
    args = parser.parse_args()
    config = offload_config_from_args(parser, args)      # OffloadConfig, or None: offloading off
    scheduler = Scheduler.from_pipeline(pipe, config)

The flags take the vLLM-Omni spelling, so existing command lines keep working.  A bad value is an
argparse error (usage, the `ConfigError` message, exit status 2), not a traceback.
"""

from __future__ import annotations

import argparse

from residency.options.vllm_omni import OffloadConfig, resolve_config
from residency.core.errors import ConfigError

__all__ = ["add_offload_arguments", "offload_config_from_args"]

_CONFIG_HELP = (
    'offload configuration as JSON, for example \'{"mode": "module", "components": '
    '["dit", "text_encoder"]}\'; "mode" (module: whole components swap; layer: their blocks '
    'stream; auto: a plan chosen from "auto_options", e.g. {"device_budget": "20GiB"}, decides) '
    'and "components" (dit, text_encoder, vae; optional under auto) are required; null means no '
    'offloading'
)
_LEGACY_HELP = (
    "compatibility switch: offload every DiT and text encoder in turn (module mode); with "
    "--diffusion-offload-config in module mode, that config decides"
)


def _parse_config(text: str) -> OffloadConfig | None:
    try:
        return resolve_config(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_offload_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--diffusion-offload-config`` and ``--enable-cpu-offload`` to `parser`; returns it.

        add_offload_arguments(parser)
        args = parser.parse_args(["--enable-cpu-offload"])
        offload_config_from_args(parser, args)   # OffloadConfig(mode='module', ...)

    The parsed values land in ``args.diffusion_offload_config`` (an `OffloadConfig`, or None
    when absent or JSON ``null``) and
    ``args.enable_cpu_offload`` (a bool).  A JSON value that does not parse or validate is an
    argparse error at parse time.
    """
    group = parser.add_argument_group("offloading")
    group.add_argument("--diffusion-offload-config", metavar="JSON", type=_parse_config,
                       default=None, help=_CONFIG_HELP)
    group.add_argument("--enable-cpu-offload", action="store_true", help=_LEGACY_HELP)
    return parser


def offload_config_from_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> OffloadConfig | None:
    """The `OffloadConfig` the parsed flags ask for, or None when offloading is off.

    Both flags together need a module-mode config (which then decides, as in vLLM-Omni 0.30);
    with a layer-mode or auto config ``parser.error`` reports the `ConfigError` message and exits
    with status 2.
    """
    try:
        return resolve_config(
            args.diffusion_offload_config, enable_cpu_offload=args.enable_cpu_offload
        )
    except ConfigError as error:
        parser.error(str(error))
