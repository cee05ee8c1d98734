"""The vLLM-Omni command-line flags on an ordinary argparse script.

    python examples/cli_flag.py --diffusion-offload-config '{"mode": "module", "components": ["dit", "text_encoder"]}'
    python examples/cli_flag.py --enable-cpu-offload   # the DiT and the encoder take turns
    python examples/cli_flag.py                        # offloading off
    python examples/cli_flag.py --diffusion-offload-config '{"mode": "module"}'  # exit status 2
    python examples/cli_flag.py --diffusion-offload-config '{"mode": "layer", "components": ["dit"]}'  # exit status 2
"""

import argparse
import copy

import torch
from torch import nn

from residency import ConfigError, NoOffload, Scheduler
from residency.adapters.cli import add_offload_arguments, offload_config_from_args
from residency import SupportsComponentDiscovery


class TinyPipeline(SupportsComponentDiscovery, nn.Module):
    _dit_modules = ("transformer",)
    _encoder_modules = ("text_encoder",)
    _vae_modules = ("vae",)

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.text_encoder, self.transformer, self.vae = (nn.Linear(width, width) for _ in range(3))

    def generate(self, prompt: torch.Tensor, scheduler, steps: int = 4) -> torch.Tensor:
        with scheduler.resident("text_encoder"):
            context = self.text_encoder(prompt)
        latents = torch.zeros_like(prompt)
        for _ in range(steps):
            with scheduler.resident("transformer"):
                latents = torch.tanh(self.transformer(latents + context))
        return self.vae(latents)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_offload_arguments(parser)
    args = parser.parse_args(argv)
    config = offload_config_from_args(parser, args)  # None: offloading off
    print("offload config:", None if config is None else config.to_json())

    torch.manual_seed(0)
    pipe = TinyPipeline().eval()
    plain = copy.deepcopy(pipe)
    try:
        scheduler = Scheduler.from_pipeline(pipe, config, device="cpu")
    except ConfigError as error:  # e.g. layer mode here: these Linears have no blocks to stream
        parser.error(str(error))
    print("scheduler:", scheduler)
    prompt = torch.randn(2, 32)
    with torch.no_grad():
        image = pipe.generate(prompt, scheduler)
        assert torch.equal(image, plain.generate(prompt, NoOffload())), "outputs differ"
    print(f"{scheduler.transitions.count} transitions; outputs bit-identical")


if __name__ == "__main__":
    main()
