"""folio: a small, readable LLM inference engine."""

from folio.engine.llm import LLM
from folio.lora.adapter import LoRARequest
from folio.outputs import CompletionOutput, RequestOutput
from folio.sampling_params import SamplingParams
from folio.structured.params import StructuredOutputParams

__version__ = "0.1.0"
__all__ = [
    "LLM", "LoRARequest", "SamplingParams", "StructuredOutputParams", "RequestOutput", "CompletionOutput", "__version__"
]  # fmt: skip
