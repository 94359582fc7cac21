"""DeepInfer: an LLM inference engine. `from deepinfer import LLM, SamplingParams`."""
from deepinfer.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch; keep `import deepinfer` (and the pure core) light.
    if name == "LLM":
        from deepinfer.llm import LLM
        return LLM
    raise AttributeError(name)
