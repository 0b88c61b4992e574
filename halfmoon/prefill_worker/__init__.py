"""Prefill worker: prefix reuse, chunked prefill, layer-wise KV push to a decode worker."""
