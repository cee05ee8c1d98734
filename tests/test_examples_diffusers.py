"""examples/diffusers_wan22.py runs: bit-identical frames, both experts taking turns."""

import pathlib
import runpy

import pytest
import torch

pytest.importorskip("diffusers")

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "diffusers_wan22.py"


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops on a shared 2-core machine: OpenMP waits dominate
    yield
    torch.set_num_threads(threads)


def test_the_wan22_example_runs(capsys):
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    out = capsys.readouterr().out
    assert ("groups: text_encoder (exclusive), transformer (exclusive), "
            "transformer_2 (exclusive), vae (resident)") in out  # in the order a call uses them
    assert out.count("bit-identical to the plain pipeline") == 2
    assert "  transformer -> transformer_2:" in out
    assert "  transformer_2 -> text_encoder:" in out  # the second call starts with the encoder
    assert "offloading disabled: the pipeline is plain again" in out
