"""argparse flags: --diffusion-offload-config and --enable-cpu-offload (and in the main job)."""

import argparse
import json
import os
import re

import pytest

from residency import Scheduler
from residency.adapters.cli import add_offload_arguments, offload_config_from_args
from residency.app.main import build_parser
from residency.app.main import main as main_job
from residency.app.synthetic import SyntheticWan22
from residency.options.budget import AutoOptions
from residency.options.vllm_omni import OffloadConfig

from _forkserver import run_python


def _parse(argv):
    parser = add_offload_arguments(argparse.ArgumentParser(prog="generate"))
    return offload_config_from_args(parser, parser.parse_args(argv))


@pytest.mark.fast
def test_no_flags_means_offloading_off():
    assert _parse([]) is None


@pytest.mark.fast
def test_json_flag_gives_the_config():
    config = _parse(["--diffusion-offload-config",
                     '{"mode": "module", "components": ["dit", "vae"], "pin_memory": false}'])
    assert config == OffloadConfig(mode="module", components=("dit", "vae"), pin_memory=False)


@pytest.mark.fast
def test_legacy_flag_means_module_mode_with_dit_and_text_encoder():
    assert _parse(["--enable-cpu-offload"]) == OffloadConfig(
        mode="module", components=("dit", "text_encoder")
    )


@pytest.mark.fast
@pytest.mark.parametrize("components", [["dit", "text_encoder", "vae"], ["dit"]])
def test_legacy_flag_with_a_module_mode_config_lets_the_config_decide(components):
    config = _parse(["--enable-cpu-offload", "--diffusion-offload-config",
                     '{"mode": "module", "components": %s}' % json.dumps(components)])
    assert config.components == tuple(components)


@pytest.mark.fast
def test_json_null_means_offloading_off():
    assert _parse(["--diffusion-offload-config", "null"]) is None


@pytest.mark.fast
def test_layer_mode_parses():
    config = _parse(["--diffusion-offload-config", '{"mode": "layer", "components": ["dit"]}'])
    assert config.mode == "layer"


@pytest.mark.fast
def test_auto_mode_parses_with_its_options():
    config = _parse(["--diffusion-offload-config",
                     '{"mode": "auto", "auto_options": {"device_budget": "20GiB", '
                     '"phase_order": ["text_encoder", "transformer"]}}'])
    assert (config.mode, config.components) == ("auto", ("dit", "text_encoder"))
    assert config.auto_options == AutoOptions(device_budget="20GiB",
                                              phase_order=("text_encoder", "transformer"))


@pytest.mark.fast
def test_flags_join_an_existing_parser_and_its_help():
    parser = argparse.ArgumentParser(prog="generate")
    parser.add_argument("--steps", type=int, default=4)
    assert add_offload_arguments(parser) is parser
    args = parser.parse_args(["--steps", "2", "--enable-cpu-offload"])
    assert (args.steps, args.enable_cpu_offload, args.diffusion_offload_config) == (2, True, None)
    text = parser.format_help()
    assert "--diffusion-offload-config JSON" in text and "--enable-cpu-offload" in text


FLAG = "--diffusion-offload-config"
#: Auto configs each flag refuses, with the message it must say.
AUTO_REFUSALS = [
    ('{"mode": "auto", "auto_options": {"device_budget": 2.0}}',
     r"offload config field 'auto_options': device_budget=2\.0; give bytes \(a whole number "
     r">= 1, or a size such as '38GiB'"),
    ('{"mode": "auto", "auto_options": {"device_budget": "12 parsecs"}}',
     r"offload config field 'auto_options': device_budget='12 parsecs'; give bytes"),
    ('{"mode": "auto", "auto_options": {"headroom": -1}}',
     r"offload config field 'auto_options': headroom=-1; give bytes: a whole number >= 0"),
    ('{"mode": "auto", "auto_options": {"budget": 1}}',
     r"offload config field 'auto_options': auto_options has unknown keys \['budget'\]"),
    ('{"mode": "auto", "auto_options": {"phase_order": []}}',
     r"offload config field 'auto_options': phase_order=\[\]; give the group names"),
    ('{"mode": "module", "components": ["dit"], "auto_options": {"device_budget": "1GiB"}}',
     r"offload config field 'auto_options' is \{'device_budget': '1GiB'\}, but mode 'module' "
     r"takes no auto options .*; set \"mode\": \"auto\", or drop 'auto_options'"),
    ('{"mode": "auto", "layer_options": {"dit": {"resident_layers": 2}}}',
     r"offload config field 'layer_options' is .*, but mode 'auto' chooses itself which blocks "
     r"stream .*, or set \"mode\": \"layer\" to fix weight_transfer and resident_layers by "
     r"hand"),
]


@pytest.mark.fast
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
        (["--enable-cpu-offload", "--diffusion-offload-config", '{"mode": "auto"}'],
         r"generate: error: enable_cpu_offload=True asks for module mode, but the offload config "
         r"given with it is \{'mode': 'auto', .*\(mode 'auto'\); drop enable_cpu_offload"),
        *[([FLAG, config], rf"argument --diffusion-offload-config: {message}")
          for config, message in AUTO_REFUSALS],
    ],
)
def test_bad_values_are_argparse_errors_with_exit_status_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parse(argv)
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("usage: generate")
    assert re.search(message, stderr.replace("\n", " ")), stderr


# -- the main job (python -m residency) ---------------------------------------------------------


@pytest.mark.fast
def test_the_main_job_takes_an_auto_config_to_its_scheduler():
    """Parsing only: the flag gives the config, and the synthetic pipeline's scheduler gets its
    options (a run under auto waits for the engine)."""
    config = OffloadConfig.from_dict({"mode": "auto", "auto_options": {"device_budget": "1GiB"}})
    args = build_parser().parse_args(["--size", "tiny", FLAG, config.to_json()])
    assert args.diffusion_offload_config == config
    scheduler = Scheduler.from_pipeline(SyntheticWan22.build("tiny"), config, device="cpu")
    assert scheduler.auto_options == AutoOptions(device_budget="1GiB")
    scheduler.close()


@pytest.mark.fast
@pytest.mark.parametrize(("config", "message"), AUTO_REFUSALS)
def test_the_main_job_refuses_a_bad_auto_config_with_exit_status_2(config, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main_job(["--size", "tiny", FLAG, config])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no work began
    error = captured.err.splitlines()[-1]
    assert error.startswith("python -m residency: error: argument --diffusion-offload-config: ")
    assert re.search(message, error), error


@pytest.mark.fast
def test_the_main_job_refuses_the_legacy_flag_with_an_auto_config(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main_job(["--size", "tiny", "--enable-cpu-offload", FLAG, '{"mode": "auto"}'])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert re.search(r"^python -m residency: error: enable_cpu_offload=True asks for module "
                     r"mode, .*\(mode 'auto'\)", captured.err.splitlines()[-1])


def test_python_m_residency_ends_a_bad_auto_config_with_one_line_and_exit_status_2():
    done = run_python(["-m", "residency", "--size", "tiny", FLAG,
                       '{"mode": "auto", "auto_options": {"device_budget": 0}}'],
                      env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert lines[0].startswith("usage: python -m residency") and "Traceback" not in done.stderr
    assert lines[-1].startswith(
        "python -m residency: error: argument --diffusion-offload-config: offload config field "
        "'auto_options': device_budget=0; give bytes (a whole number >= 1, or a size such as "
        "'38GiB'")
