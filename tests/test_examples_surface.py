"""The surface examples run, print what they show, and refuse bad flags with exit status 2."""

import pathlib
import runpy
import sys

import pytest

from _forkserver import run_python

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
CONFIG = '{"mode": "module", "components": ["dit", "text_encoder"]}'


def _run(script: str, argv: list[str], monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", [script, *argv])
    runpy.run_path(str(EXAMPLES / script), run_name="__main__")


@pytest.mark.fast
@pytest.mark.parametrize(
    ("script", "argv", "printed"),
    [
        ("discovery_pipeline.py", [], "after transformer_2 resident: ['transformer_2', 'vae', "
                                      "'time_embed']"),
        ("split_model.py", [], "step 2: resident ['generator', 'transformer', 'vae']"),
        ("layer_mode.py", [], "first moves: prefetch transformer.blocks.1, prefetch "
                              "transformer.blocks.2, compute transformer.blocks.1"),
        ("cli_flag.py", ["--diffusion-offload-config", CONFIG], "<Scheduler on cpu: 3 group(s)"),
        ("cli_flag.py", ["--enable-cpu-offload"], "3 transitions; outputs bit-identical"),
        ("cli_flag.py", [], "scheduler: <NoOffload: 3 group(s)>"),
    ],
)
def test_example_runs_and_asserts_bit_identity(script, argv, printed, monkeypatch, capsys):
    _run(script, argv, monkeypatch)
    out = capsys.readouterr().out
    assert printed in out
    assert "bit-identical" in out


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ('{"mode": "modul", "components": ["dit"]}', "offload config field 'mode' is 'modul'"),
        ('{"mode": "module"}', "offload config field 'components' is missing"),
        ('{"mode": "layer", "components": ["dit"]}', "transformer: Linear has no list of repeated "
                                                     "blocks to stream"),
    ],
)
def test_cli_example_refuses_bad_flags_with_status_2(flag, message):
    # python examples/cli_flag.py ... in a process of its own, forked from an interpreter that
    # has imported torch (tests/_forkserver.py): the real exit status and stderr.
    result = run_python([str(EXAMPLES / "cli_flag.py"), "--diffusion-offload-config", flag],
                        timeout=120)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
