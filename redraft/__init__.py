"""redraft: a serving engine for LLaDA2.x block-diffusion language models."""

__version__ = "0.1.0"

__all__ = ["Engine", "__version__"]


def __getattr__(name: str):
    # Lazy so that `import redraft.scheduler` (torch-free) never pulls in torch.
    if name == "Engine":
        from redraft.engine.runtime.engine import Engine

        return Engine
    raise AttributeError(name)
