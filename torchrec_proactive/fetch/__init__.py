"""Asynchronous row movement between the host tier and the device cache."""

from .engine import (
    EmulatedLinkTransport,
    EngineStats,
    FetchEngine,
    FetchFailedError,
    InlineTransport,
    LinkModel,
    Ticket,
    Transport,
)

__all__ = [
    "EmulatedLinkTransport", "EngineStats", "FetchEngine", "FetchFailedError", "InlineTransport", "LinkModel",
    "Ticket", "Transport", "make_transport",
]


def make_transport(device: "str | object", link: "LinkModel | None" = None) -> Transport:
    """The natural transport for ``device``: CUDA copy stream, emulated link, or inline copy."""
    import torch

    dev = torch.device(device)  # type: ignore[arg-type]
    if dev.type == "cuda":
        from .cuda import CudaStreamTransport

        return CudaStreamTransport(dev)
    if link is not None:
        return EmulatedLinkTransport(link)
    return InlineTransport()
