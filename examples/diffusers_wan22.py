"""Wan2.2 text-to-video with model-level offloading: one call turns it on, the frames do not change.

    python examples/diffusers_wan22.py

The pipeline is a real diffusers `WanPipeline` (a UMT5 text encoder, the high-noise expert
`transformer`, the low-noise expert `transformer_2`, the Wan VAE) built tiny in code so that it runs
anywhere in seconds.  With a real checkpoint, only the first line changes:

    pipe = WanPipeline.from_pretrained("Wan-AI/Wan2.2-T2V-A14B-Diffusers",
                                       torch_dtype=torch.bfloat16)
    scheduler = enable_offload(pipe, {"mode": "module", "components": ["dit", "text_encoder"]})

The two experts and the text encoder then take turns on the device (the VAE stays there), and each
call moves only the weights its next phase needs.
"""

import torch
from diffusers import (
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    WanPipeline,
    WanTransformer3DModel,
)
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

from residency.adapters.diffusers import disable_offload, enable_offload

WORDS = ["<pad>", "</s>", "<unk>", "a", "cat", "dog", "on", "the", "moon", "red", "blue", "sky"]


def tiny_wan22() -> WanPipeline:
    """A Wan2.2 T2V pipeline with tiny weights (seeded, so two builds are identical)."""
    torch.manual_seed(0)
    vocab = {word: index for index, word in enumerate(WORDS)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>",
                                        unk_token="<unk>", eos_token="</s>")
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(WORDS), d_model=16, d_kv=4, d_ff=32,
                                               num_layers=1, num_heads=2))
    experts = [
        WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                              in_channels=4, out_channels=4, text_dim=16, freq_dim=16, ffn_dim=16,
                              num_layers=1, rope_max_seq_len=32)
        for _ in range(2)
    ]
    vae = AutoencoderKLWan(base_dim=3, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder.eval(), vae=vae.eval(),
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
                       transformer=experts[0].eval(), transformer_2=experts[1].eval(),
                       boundary_ratio=0.5)  # steps above half the noise: `transformer`
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe: WanPipeline, prompt: str, seed: int) -> torch.Tensor:
    return pipe(prompt, height=16, width=16, num_frames=5, num_inference_steps=4,
                max_sequence_length=8, generator=torch.Generator().manual_seed(seed),
                output_type="pt").frames


def main() -> None:
    device = torch.accelerator.current_accelerator() or torch.device("cpu")
    plain = tiny_wan22().to(device)  # the reference: everything on the device, never offloaded
    pipe = tiny_wan22()              # the same weights, left on the host

    scheduler = enable_offload(pipe, {"mode": "module", "components": ["dit", "text_encoder"]},
                               device=device)
    print(f"groups: {', '.join(f'{n} ({scheduler[n].policy.value})' for n in scheduler)}")
    for prompt, seed in (("a cat on the moon", 0), ("a red dog", 1)):
        video = generate(pipe, prompt, seed)
        assert torch.equal(video.cpu(), generate(plain, prompt, seed).cpu()), prompt
        print(f"{prompt!r}: frames {tuple(video.shape)}, bit-identical to the plain pipeline")
    for record in scheduler.transitions:
        print(f"  {record.from_group or '-'} -> {record.to_group}: {record.nbytes} bytes "
              f"in {record.seconds * 1e3:.2f} ms")

    disable_offload(pipe)  # no wrapper left; every weight back on the host
    assert "forward" not in vars(pipe.transformer)
    print("offloading disabled: the pipeline is plain again")


if __name__ == "__main__":
    main()
