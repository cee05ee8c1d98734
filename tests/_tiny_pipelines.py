"""Real diffusers pipelines built tiny from configs in code: no downloads, a few seconds per call.

    pipe = tiny_wan22()                     # WanPipeline: UMT5 encoder, two experts, Wan VAE
    video = pipe(**wan22_call(seed=0)).frames

Every builder seeds torch before creating its models, so two builds are identical; tokenizers are
`tokenizers` WordLevel models wrapped in transformers' fast tokenizer class.
"""

from __future__ import annotations

import torch

#: The words every tiny tokenizer knows; anything else maps to <unk>.
WORDS = ["<pad>", "</s>", "<unk>", "a", "cat", "dog", "on", "the", "moon", "red", "blue", "sky"]


def word_tokenizer(*, eos: bool = False, model_max_length: int = 8):
    """A `PreTrainedTokenizerFast` around a `tokenizers` WordLevel model over `WORDS`.

    ``eos=True`` appends </s> like T5's tokenizer.  It survives ``save_pretrained`` /
    ``from_pretrained`` (everything lives in tokenizer.json).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {word: index for index, word in enumerate(WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    if eos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="$A </s>", special_tokens=[("</s>", vocab["</s>"])]
        )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>",
                                   unk_token="<unk>", eos_token="</s>",
                                   model_max_length=model_max_length)


def tiny_wan22(seed: int = 0):
    """Wan2.2 T2V: UMT5 encoder, high-noise `transformer`, low-noise `transformer_2`, Wan VAE."""
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    text_encoder = UMT5EncoderModel(
        UMT5Config(vocab_size=len(WORDS), d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2,
                   relative_attention_num_buckets=8)
    ).eval()
    experts = [
        WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
            out_channels=4, text_dim=16, freq_dim=16, ffn_dim=16, num_layers=1, rope_max_seq_len=32,
        ).eval()
        for _ in range(2)
    ]
    vae = AutoencoderKLWan(
        base_dim=3, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.0, 0.3],
        latents_std=[1.0, 1.5, 0.5, 2.0],
    ).eval()
    pipe = WanPipeline(
        tokenizer=word_tokenizer(eos=True),
        text_encoder=text_encoder,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        transformer=experts[0],
        transformer_2=experts[1],
        boundary_ratio=0.5,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def wan22_call(seed: int = 0, prompt: str = "a cat on the moon") -> dict:
    """Arguments for one tiny Wan2.2 call that runs both experts (4 steps, boundary at half)."""
    return {
        "prompt": prompt,
        "negative_prompt": "blue sky",
        "height": 16,
        "width": 16,
        "num_frames": 5,
        "num_inference_steps": 4,
        "guidance_scale": 3.0,
        "max_sequence_length": 8,
        "generator": torch.Generator().manual_seed(seed),
        "output_type": "pt",
    }


def tiny_flux(seed: int = 0):
    """Flux: CLIP and T5 text encoders, FluxTransformer2DModel, AutoencoderKL."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    clip = CLIPTextModel(
        CLIPTextConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=37,
                       num_attention_heads=4, num_hidden_layers=1, max_position_embeddings=8,
                       projection_dim=32, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    ).eval()
    t5 = T5EncoderModel(
        T5Config(vocab_size=len(WORDS), d_model=32, d_kv=8, d_ff=37, num_layers=1, num_heads=4,
                 relative_attention_num_buckets=8)
    ).eval()
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8],
    ).eval()
    vae = AutoencoderKL(
        sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
        latent_channels=1, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
        shift_factor=0.0609, scaling_factor=1.5035,
    ).eval()
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=clip,
        tokenizer=word_tokenizer(model_max_length=8),
        text_encoder_2=t5,
        tokenizer_2=word_tokenizer(eos=True),
        transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def flux_call(seed: int = 0, prompt: str = "a red dog") -> dict:
    """Arguments for one tiny Flux call (2 steps, 8x8 pixels)."""
    return {
        "prompt": prompt,
        "height": 8,
        "width": 8,
        "num_inference_steps": 2,
        "guidance_scale": 5.0,
        "max_sequence_length": 8,
        "generator": torch.Generator().manual_seed(seed),
        "output_type": "pt",
    }
