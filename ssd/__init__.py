"""ssd: lossless speculative decoding and speculative speculative decoding (Saguaro)."""

from ssd.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "Output", "Client"]


def __getattr__(name: str):
    # Lazy: `import ssd` stays light for workers and the CLI's --help.
    if name == "LLM":
        from ssd.llm import LLM

        return LLM
    if name == "Output":
        from ssd.outputs import Output

        return Output
    if name == "Client":
        from ssd.client import Client

        return Client
    raise AttributeError(name)
