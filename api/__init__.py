"""The serving protocols: OpenAI-compatible HTTP (schemas, serving logic, FastAPI app) and gRPC.
Engine-agnostic: everything here talks to an ``EngineClient``; nothing here imports ray."""
