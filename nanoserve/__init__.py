"""nanoserve: a small, readable LLM inference engine that teaches continuous batching."""

from nanoserve.entrypoints.llm import LLM
from nanoserve.entrypoints.outputs import RequestOutput
from nanoserve.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
