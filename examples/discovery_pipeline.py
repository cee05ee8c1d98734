"""Component discovery: a pipeline lists its parts by dotted path; `from_pipeline` groups them.

    python examples/discovery_pipeline.py

A Wan2.2-shaped pipeline: two experts (`transformer` for high noise, `transformer_2` for low
noise), two encoders (one reached by a dotted path), a VAE and a small resident module.  With
``{"mode": "module", "components": ["dit", "text_encoder"]}`` the experts and the encoder group take
turns on the device; the VAE and the time embedding stay there.
"""

import copy

import torch
from torch import nn

from residency import NoOffload, Scheduler, SupportsComponentDiscovery

WIDTH = 64


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH))


class PromptAdapter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = mlp()


class TinyWan(SupportsComponentDiscovery, nn.Module):
    _dit_modules = ("transformer", "transformer_2")
    _encoder_modules = ("text_encoder", "prompt_adapter.encoder")
    _vae_modules = ("vae",)
    _resident_modules = ("time_embed",)

    def __init__(self) -> None:
        super().__init__()
        self.text_encoder, self.prompt_adapter = mlp(), PromptAdapter()
        self.transformer, self.transformer_2 = mlp(), mlp()
        self.vae, self.time_embed = mlp(), nn.Embedding(8, WIDTH)

    def generate(self, prompt: torch.Tensor, scheduler, steps: int = 6, trace=None) -> torch.Tensor:
        """Encode, denoise (high-noise expert first, then low-noise), decode; one phase per part."""
        with scheduler.resident("text_encoder"):
            context = self.text_encoder(prompt) + self.prompt_adapter.encoder(prompt)
        _note(trace, scheduler, "text_encoder")
        latents = torch.zeros_like(prompt)
        for step in range(steps):
            expert = "transformer" if step < steps // 2 else "transformer_2"
            with scheduler.resident(expert):
                t = self.time_embed(torch.tensor([step]))
                latents = latents + getattr(self, expert)(latents + context + t)
            _note(trace, scheduler, expert)
        return self.vae(latents)  # the VAE is resident: no phase needed


def _note(trace, scheduler, phase: str) -> None:
    if trace is not None:
        trace.append((phase, scheduler.resident_groups()))


def main() -> None:
    torch.manual_seed(0)
    pipe = TinyWan().eval()
    plain = copy.deepcopy(pipe)  # the same pipeline, never offloaded
    config = {"mode": "module", "components": ["dit", "text_encoder"]}
    scheduler = Scheduler.from_pipeline(pipe, config, device="cpu")  # "cpu": a real swap
    print("groups:", {name: scheduler[name].policy.value for name in scheduler})

    prompt = torch.randn(4, WIDTH)
    trace: list = []
    with torch.no_grad():
        video = pipe.generate(prompt, scheduler, trace=trace)
        expected = plain.generate(prompt, NoOffload())
    for phase, resident in trace[:3] + trace[-1:]:
        print(f"after {phase:<13} resident: {resident}")
    assert torch.equal(video, expected), "offloaded output differs from the plain pipeline"
    print(f"{scheduler.transitions.count} transitions, {scheduler.transitions.nbytes} bytes loaded")
    print("outputs bit-identical to the pipeline never offloaded")
    scheduler.close()


if __name__ == "__main__":
    main()
