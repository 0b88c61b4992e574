"""Generated protobuf/gRPC stubs of the public API `halfmoon.v1` (`make proto`; do not edit)."""
