"""mmserve: a gRPC serving engine for Gemma-4-style video+text models."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy so `import mmserve` stays cheap for the CLI and the client.
    if name == "LLM":
        from mmserve.engine.llm import LLM

        return LLM
    raise AttributeError(name)
