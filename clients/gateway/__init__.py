"""An OpenAI-compatible HTTP edge over the client library: `slotwise gateway`, or
`slotwise serve --http-port N`. It imports no llama.cpp: it speaks gRPC to prep and infer."""

from clients.gateway.app import create_app
from clients.gateway.config import GatewayConfig

__all__ = ["GatewayConfig", "create_app"]
