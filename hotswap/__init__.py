"""hotswap: an LLM inference engine that takes new weights live."""

from hotswap.config import EngineConfig, current_config, use_config
from hotswap.engine.client import EngineStatus, LLMClient
from hotswap.entrypoints.llm import LLM
from hotswap.lora.request import LoRARequest
from hotswap.outputs import CompletionOutput, Logprob, RequestOutput
from hotswap.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineStatus",
    "LLMClient",
    "LoRARequest",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "current_config",
    "use_config",
]
