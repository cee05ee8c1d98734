"""argparse flags: --diffusion-offload-config and --enable-cpu-offload."""

import argparse
import json
import re

import pytest

from residency.adapters.cli import add_offload_arguments, offload_config_from_args
from residency.vllm_omni.config import OffloadConfig


def _parse(argv):
    parser = add_offload_arguments(argparse.ArgumentParser(prog="generate"))
    return offload_config_from_args(parser, parser.parse_args(argv))


def test_no_flags_means_offloading_off():
    assert _parse([]) is None


def test_json_flag_gives_the_config():
    config = _parse(["--diffusion-offload-config",
                     '{"mode": "module", "components": ["dit", "vae"], "pin_memory": false}'])
    assert config == OffloadConfig(mode="module", components=("dit", "vae"), pin_memory=False)


def test_legacy_flag_means_module_mode_with_dit_and_text_encoder():
    assert _parse(["--enable-cpu-offload"]) == OffloadConfig(
        mode="module", components=("dit", "text_encoder")
    )


@pytest.mark.parametrize("components", [["dit", "text_encoder", "vae"], ["dit"]])
def test_legacy_flag_with_a_module_mode_config_lets_the_config_decide(components):
    config = _parse(["--enable-cpu-offload", "--diffusion-offload-config",
                     '{"mode": "module", "components": %s}' % json.dumps(components)])
    assert config.components == tuple(components)


def test_json_null_means_offloading_off():
    assert _parse(["--diffusion-offload-config", "null"]) is None


def test_layer_mode_parses():
    config = _parse(["--diffusion-offload-config", '{"mode": "layer", "components": ["dit"]}'])
    assert config.mode == "layer"


def test_flags_join_an_existing_parser_and_its_help():
    parser = argparse.ArgumentParser(prog="generate")
    parser.add_argument("--steps", type=int, default=4)
    assert add_offload_arguments(parser) is parser
    args = parser.parse_args(["--steps", "2", "--enable-cpu-offload"])
    assert (args.steps, args.enable_cpu_offload, args.diffusion_offload_config) == (2, True, None)
    text = parser.format_help()
    assert "--diffusion-offload-config JSON" in text and "--enable-cpu-offload" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--diffusion-offload-config", '{"mode": "module"}'],
         r"argument --diffusion-offload-config: offload config field 'components' is missing "
         r"from \{'mode': 'module'\}; it is required"),
        (["--diffusion-offload-config", '{"mode": "modul", "components": ["dit"]}'],
         r"argument --diffusion-offload-config: offload config field 'mode' is 'modul'; "
         r"accepted modes are 'module', 'layer'"),
        (["--diffusion-offload-config", '{"mode": "module", "components": ["unet"]}'],
         r"argument --diffusion-offload-config: offload config field 'components' contains "
         r"'unet'; accepted components are 'dit', 'text_encoder', 'vae'"),
        (["--diffusion-offload-config", "{'mode': 'module'}"],
         r"argument --diffusion-offload-config: offload config .* is not valid JSON: Expecting "
         r"property name enclosed in double quotes at line 1, column 2"),
        (["--enable-cpu-offload", "--diffusion-offload-config",
          '{"mode": "layer", "components": ["dit"]}'],
         r"generate: error: enable_cpu_offload=True asks for module mode, but the offload config "
         r"given with it is"),
    ],
)
def test_bad_values_are_argparse_errors_with_exit_status_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parse(argv)
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("usage: generate")
    assert re.search(message, stderr.replace("\n", " ")), stderr
