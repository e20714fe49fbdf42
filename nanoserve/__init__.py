"""nanoserve: a small, readable LLM inference engine that teaches continuous batching."""

from nanoserve.engine.llm_engine import LLM
from nanoserve.engine.outputs import RequestOutput
from nanoserve.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
