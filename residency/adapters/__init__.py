"""Third-party integrations, installed as ``residency.adapters``: they translate a pipeline into
groups and phases and hold no offloading logic of their own.

* `residency.adapters.diffusers` - ``enable_offload`` / ``disable_offload`` for diffusers
  pipelines, and what it knows of diffusers' components (`diffusers_roles`), of a folder's
  weight files (`weight_files`: safetensors headers and sharded indexes, checked before anything
  loads them) and of where a pipeline call begins and ends (`pipeline_calls`).
* `residency.adapters.vllm_omni` - vLLM-Omni's model-level offload protocol, `OmniOffloadMixin`.
* `residency.adapters.cli` - argparse flags (``--diffusion-offload-config`` and the rest).
"""
