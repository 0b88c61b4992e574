"""The request surface: what clients send and receive. The OpenAI-compatible HTTP API and the
gRPC API (their shapes, schemas and error bodies), one validation path from either into the
backend's `GenerationInput`, the front door both share (auth, stream limits, metrics, the live
window), and the servers. The Conductor's scheduling (routing, admission, the backends) sits
below it, in `halfmoon.conductor`."""
