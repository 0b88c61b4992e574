"""Decode worker: KV receive, continuous-batching decode, token streaming."""
