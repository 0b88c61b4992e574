"""The Conductor: the front door (gRPC, OpenAI HTTP), backends, and (issue 6) routing."""
