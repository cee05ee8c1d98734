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


def flux_lora(seed: int, num_layers: int = 1, num_single_layers: int = 1) -> dict:
    """A LoRA for a tiny Flux transformer with these block counts, in diffusers' format, with
    non-zero weights (peft initialises lora_B to zeros, which would make a lost fuse invisible)."""
    import pytest

    peft = pytest.importorskip("peft")
    transformer = tiny_flux_transformer(num_layers, num_single_layers)
    config = peft.LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                             init_lora_weights=False)
    torch.manual_seed(seed)
    transformer.add_adapter(config)
    state = peft.get_peft_model_state_dict(transformer)
    return {f"transformer.{key}": value.clone() for key, value in state.items()}


def lora_flow(pipe) -> list[torch.Tensor]:
    """On a tiny Flux: load two LoRAs (fitting ``pipe.transformer``) -> call -> fuse -> call ->
    unfuse -> call -> set_adapters -> call -> unload -> call; returns the images of the 6 calls
    (the first before loading)."""
    shape = pipe.transformer.config
    first, second = (flux_lora(seed, shape.num_layers, shape.num_single_layers) for seed in (1, 2))
    images = [pipe(**flux_call(seed=0)).images]
    pipe.load_lora_weights(first, adapter_name="first")
    pipe.load_lora_weights(second, adapter_name="second")
    pipe.set_adapters(["first"])
    images.append(pipe(**flux_call(seed=1)).images)
    pipe.fuse_lora(adapter_names=["first"], lora_scale=1.0)
    images.append(pipe(**flux_call(seed=1)).images)
    pipe.unfuse_lora()
    images.append(pipe(**flux_call(seed=1)).images)
    pipe.set_adapters(["first", "second"], adapter_weights=[0.5, 1.5])
    images.append(pipe(**flux_call(seed=2)).images)
    pipe.unload_lora_weights()
    images.append(pipe(**flux_call(seed=0)).images)
    return images


# -- UNet families: SDXL, SD + ControlNet, SD + IP-Adapter, AnimateDiff, Kandinsky 2.2 ----------


def _clip_text(projection: bool = False, hidden: int = 16):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(vocab_size=len(WORDS), hidden_size=hidden, intermediate_size=16,
                            num_attention_heads=2, num_hidden_layers=1, max_position_embeddings=8,
                            projection_dim=hidden, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config).eval()


def _tiny_vae(latent_channels: int = 4):
    from diffusers import AutoencoderKL

    return AutoencoderKL(sample_size=8, in_channels=3, out_channels=3, block_out_channels=(4,),
                         layers_per_block=1, latent_channels=latent_channels,
                         norm_num_groups=1).eval()


def _sd_unet(cross_attention_dim: int = 16, **extra):
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(8, 16),
        layers_per_block=1, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), attention_head_dim=2,
        cross_attention_dim=cross_attention_dim, norm_num_groups=2, **extra,
    ).eval()


def _done(pipe):
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_sdxl(seed: int = 0):
    """SDXL: CLIP text encoder, CLIP text encoder with projection, UNet ("text_time"), VAE."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

    torch.manual_seed(seed)
    unet = _sd_unet(cross_attention_dim=32, addition_embed_type="text_time",
                    addition_time_embed_dim=4, projection_class_embeddings_input_dim=6 * 4 + 16)
    return _done(StableDiffusionXLPipeline(
        vae=_tiny_vae(), text_encoder=_clip_text(), text_encoder_2=_clip_text(projection=True),
        tokenizer=word_tokenizer(), tokenizer_2=word_tokenizer(), unet=unet,
        scheduler=EulerDiscreteScheduler(), add_watermarker=False,
    ))


def _sd_parts():
    from diffusers import DDIMScheduler

    return {"vae": _tiny_vae(), "text_encoder": _clip_text(), "tokenizer": word_tokenizer(),
            "unet": _sd_unet(), "scheduler": DDIMScheduler(), "safety_checker": None,
            "feature_extractor": None, "requires_safety_checker": False}


def tiny_sd_controlnet(seed: int = 0):
    """Stable Diffusion with a ControlNet made from its UNet (runs in every denoising step)."""
    from diffusers import ControlNetModel, StableDiffusionControlNetPipeline

    torch.manual_seed(seed)
    parts = _sd_parts()
    controlnet = ControlNetModel.from_unet(parts["unet"], conditioning_embedding_out_channels=(4,))
    return _done(StableDiffusionControlNetPipeline(controlnet=controlnet.eval(), **parts))


def tiny_sd_ip_adapter(seed: int = 0, *, load: bool = True):
    """Stable Diffusion with an IP-Adapter: a CLIP vision `image_encoder`, and the adapter's
    image projection and attention processors loaded into the UNet by ``load_ip_adapter``
    (from a state dict made here, as a saved adapter would hold it)."""
    from diffusers import StableDiffusionPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(seed)
    parts = _sd_parts()
    parts["image_encoder"] = CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=16, intermediate_size=16, num_attention_heads=2, num_hidden_layers=1,
        image_size=14, patch_size=7, projection_dim=16)).eval()
    parts["feature_extractor"] = CLIPImageProcessor(size=14, crop_size=14)
    pipe = _done(StableDiffusionPipeline(**parts))
    if load:
        pipe.load_ip_adapter(ip_adapter_state_dict(pipe.unet, 16), subfolder="", weight_name="")
    return pipe


def ip_adapter_state_dict(unet, image_embeds: int) -> dict:
    """A random IP-Adapter ("image_proj" + "ip_adapter") laid out as diffusers' loader reads it."""
    cross = unet.config.cross_attention_dim
    image_proj = {"proj.weight": torch.randn(4 * cross, image_embeds),
                  "proj.bias": torch.randn(4 * cross), "norm.weight": torch.ones(cross),
                  "norm.bias": torch.zeros(cross)}
    ip_adapter, key = {}, 1
    for name in unet.attn_processors:
        if name.endswith("attn2.processor"):
            to_k = unet.get_submodule(name.removesuffix(".processor")).to_k.weight
            ip_adapter[f"{key}.to_k_ip.weight"] = torch.randn_like(to_k)
            ip_adapter[f"{key}.to_v_ip.weight"] = torch.randn_like(to_k)
            key += 2  # the loader counts self- and cross-attention, and reads the odd ids
    return {"image_proj": image_proj, "ip_adapter": ip_adapter}


def tiny_animatediff(seed: int = 0):
    """AnimateDiff (video): SD parts and a `motion_adapter` merged into a UNetMotionModel."""
    from diffusers import AnimateDiffPipeline, MotionAdapter

    torch.manual_seed(seed)
    parts = _sd_parts()
    for unused in ("safety_checker", "requires_safety_checker"):
        parts.pop(unused)
    adapter = MotionAdapter(block_out_channels=(8, 16), motion_layers_per_block=1,
                            motion_norm_num_groups=2, motion_num_attention_heads=2,
                            motion_max_seq_length=8)
    return _done(AnimateDiffPipeline(motion_adapter=adapter.eval(), **parts))


def unet_call(seed: int = 0, prompt: str = "a red dog", **extra) -> dict:
    """Arguments for one tiny UNet-pipeline call (2 steps, 8x8 pixels)."""
    return {"prompt": prompt, "height": 8, "width": 8, "num_inference_steps": 2,
            "guidance_scale": 5.0, "generator": torch.Generator().manual_seed(seed),
            "output_type": "pt", **extra}


def tiny_kandinsky22(seed: int = 0):
    """Kandinsky 2.2 combined: a prior (`prior_prior`, CLIP text and image encoders) makes image
    embeddings, then a decoder (`unet`, `movq`) makes the image - two denoisers in one call."""
    from diffusers import (
        DDPMScheduler,
        KandinskyV22CombinedPipeline,
        PriorTransformer,
        UNet2DConditionModel,
        UnCLIPScheduler,
        VQModel,
    )
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(seed)
    prior = PriorTransformer(num_attention_heads=2, attention_head_dim=8, embedding_dim=16,
                             num_layers=1, num_embeddings=8).eval()
    image_encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=16, intermediate_size=16, num_attention_heads=2, num_hidden_layers=1,
        image_size=14, patch_size=7, projection_dim=16)).eval()
    unet = UNet2DConditionModel(
        in_channels=4, out_channels=8, addition_embed_type="image",
        down_block_types=("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
        up_block_types=("SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"),
        mid_block_type="UNetMidBlock2DSimpleCrossAttn", block_out_channels=(8, 16),
        layers_per_block=1, encoder_hid_dim=16, encoder_hid_dim_type="image_proj",
        cross_attention_dim=16, attention_head_dim=4, resnet_time_scale_shift="scale_shift",
        norm_num_groups=2,
    ).eval()
    movq = VQModel(block_out_channels=[32, 32], down_block_types=["DownEncoderBlock2D"] * 2,
                   in_channels=3, latent_channels=4, layers_per_block=1, norm_num_groups=2,
                   norm_type="spatial", num_vq_embeddings=12, out_channels=3,
                   up_block_types=["UpDecoderBlock2D"] * 2, vq_embed_dim=4).eval()
    return _done(KandinskyV22CombinedPipeline(
        unet=unet, scheduler=DDPMScheduler(beta_schedule="linear", clip_sample=False),
        movq=movq, prior_prior=prior, prior_image_encoder=image_encoder,
        prior_text_encoder=_clip_text(projection=True), prior_tokenizer=word_tokenizer(),
        prior_scheduler=UnCLIPScheduler(variance_type="fixed_small_log", prediction_type="sample",
                                        clip_sample=True, clip_sample_range=10.0),
        prior_image_processor=CLIPImageProcessor(size=14, crop_size=14),
    ))


def kandinsky22_call(seed: int = 0, prompt: str = "a red dog") -> dict:
    """Arguments for one tiny Kandinsky 2.2 call (2 prior and 2 decoder steps, 16x16 pixels)."""
    return {"prompt": prompt, "height": 16, "width": 16, "num_inference_steps": 2,
            "prior_num_inference_steps": 2, "guidance_scale": 4.0,
            "prior_guidance_scale": 4.0, "generator": torch.Generator().manual_seed(seed),
            "output_type": "pt"}


# -- layer mode (issue 14): DiTs with several blocks per list ------------------------------------


def tiny_wan_expert(num_layers: int = 2, seed: int = 0, freq_dim: int = 16):
    """A WanTransformer3DModel shaped like `tiny_wan22`'s experts, with `num_layers` blocks (its
    class declares them in diffusers' ``_repeated_blocks``).  With Wan's own ``freq_dim=256`` the
    time embedding outweighs 2 blocks (49% of the parameter bytes)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=freq_dim, ffn_dim=16, num_layers=num_layers,
        rope_max_seq_len=32,
    ).eval()


def tiny_flux_transformer(num_layers: int = 2, num_single_layers: int = 2, seed: int = 0):
    """A FluxTransformer2DModel shaped like `tiny_flux`'s, with `num_layers` double-stream and
    `num_single_layers` single-stream blocks."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    return FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=num_layers, num_single_layers=num_single_layers,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
        pooled_projection_dim=32, axes_dims_rope=[4, 4, 8],
    ).eval()


def tiny_wan22_layered(seed: int = 0, num_layers: int = 2):
    """`tiny_wan22` whose two experts have `num_layers` blocks each."""
    pipe = tiny_wan22(seed)
    pipe.register_modules(transformer=tiny_wan_expert(num_layers, seed=seed + 1),
                          transformer_2=tiny_wan_expert(num_layers, seed=seed + 2))
    return pipe


def tiny_flux_layered(seed: int = 0, num_layers: int = 2, num_single_layers: int = 2):
    """`tiny_flux` whose transformer has `num_layers` double and `num_single_layers` single
    blocks."""
    pipe = tiny_flux(seed)
    pipe.register_modules(
        transformer=tiny_flux_transformer(num_layers, num_single_layers, seed=seed + 1)
    )
    return pipe


# -- diffusers' caches, enabled on ``pipe.transformer`` -----------------------------------------


def first_block_cache(pipe):
    from diffusers import FirstBlockCacheConfig

    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.2))


def pyramid_attention_broadcast(pipe):
    from diffusers import PyramidAttentionBroadcastConfig

    pipe.transformer.enable_cache(PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 1001),
        current_timestep_callback=lambda: pipe.current_timestep))


def faster_cache(pipe):
    """FasterCache for `tiny_wan22` (its blocks are ``blocks``, its latents 5-D)."""
    from diffusers import FasterCacheConfig

    pipe.transformer.enable_cache(FasterCacheConfig(
        spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 901),
        current_timestep_callback=lambda: pipe.current_timestep,
        attention_weight_callback=lambda _: 0.5, spatial_attention_block_identifiers=["blocks"],
        tensor_format="BCFHW", is_guidance_distilled=True,
    ))
