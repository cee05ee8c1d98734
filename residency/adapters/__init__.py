"""Third-party integrations, installed as ``residency.adapters``.

* `residency.adapters.cli` — argparse flags (``--diffusion-offload-config``, ``--enable-cpu-offload``).
* `residency.adapters.diffusers` — ``enable_offload`` / ``disable_offload`` for diffusers pipelines.
"""
