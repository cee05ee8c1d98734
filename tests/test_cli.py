"""argparse flags: --diffusion-offload-config and --enable-cpu-offload."""

import argparse
import re

import pytest

from residency.adapters.cli import add_offload_arguments, offload_config_from_args
from residency.config import OffloadConfig


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


def test_both_flags_that_agree():
    config = _parse(["--enable-cpu-offload", "--diffusion-offload-config",
                     '{"mode": "module", "components": ["dit", "text_encoder", "vae"]}'])
    assert config.components == ("dit", "text_encoder", "vae")


def test_layer_mode_parses():
    assert _parse(["--diffusion-offload-config", '{"mode": "layer"}']).mode == "layer"


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
        (["--diffusion-offload-config", '{"mode": "modul"}'],
         r"argument --diffusion-offload-config: offload config field 'mode' is 'modul'; "
         r"accepted modes are 'module', 'layer'"),
        (["--diffusion-offload-config", '{"mode": "module", "components": ["unet"]}'],
         r"argument --diffusion-offload-config: offload config field 'components' contains "
         r"'unet'; accepted components are 'dit', 'text_encoder', 'vae'"),
        (["--diffusion-offload-config", "{'mode': 'module'}"],
         r"argument --diffusion-offload-config: offload config .* is not valid JSON: Expecting "
         r"property name enclosed in double quotes at line 1, column 2"),
        (["--enable-cpu-offload", "--diffusion-offload-config",
          '{"mode": "module", "components": ["dit"]}'],
         r"generate: error: enable_cpu_offload=True means mode 'module' with components "
         r"\['dit', 'text_encoder'\], but the offload config given with it is"),
    ],
)
def test_bad_values_are_argparse_errors_with_exit_status_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parse(argv)
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("usage: generate")
    assert re.search(message, stderr.replace("\n", " ")), stderr
