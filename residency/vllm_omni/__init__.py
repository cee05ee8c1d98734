"""The vLLM-Omni-compatible surface: the offload config (`config`), plans from a pipeline's
declarations (`discovery`), split models (`split`), and vLLM-Omni's model-level offload
protocol (`protocol`, the `OmniOffloadMixin`; also importable as `residency.vllm_omni.protocol`).

No imports here: importing one module of the folder imports only what it needs."""
