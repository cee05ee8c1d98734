"""What users configure, parsed and checked once: byte counts and an auto plan's device budget
(`budget`), where host masters live (`host_options`), the order of turns (`order`), and
vLLM-Omni's offload config (`vllm_omni`: ``{"mode": "module", "components": [...]}`` and its
extensions).

No imports here: importing one module of the folder imports only what it needs."""
