"""The old import path of `residency.vllm_omni.protocol`, kept for code written against the
flat layout (issue 21):

    from residency.omni import OmniOffloadMixin

New code imports from `residency.vllm_omni.protocol`."""

from residency.vllm_omni.protocol import OmniOffloadMixin

__all__ = ["OmniOffloadMixin"]
