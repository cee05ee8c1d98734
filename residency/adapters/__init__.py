"""Third-party integrations, installed as ``residency.adapters``.

* `residency.adapters.cli` — argparse flags (``--diffusion-offload-config``, ``--enable-cpu-offload``).
* `residency.adapters.diffusers` — ``enable_offload`` / ``disable_offload`` for diffusers pipelines.
* `residency.adapters.weight_files` — ``check_weight_files``: a diffusers folder's safetensors
  headers and sharded indexes, checked before anything loads them.
"""
