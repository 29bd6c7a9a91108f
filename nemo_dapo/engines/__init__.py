"""Rollout engines as servers: the protocol (protocol.py), the server (server.py), the trainer-side client and
``Generator`` (client.py, generator.py), and the engine adapters (local.py, vllm.py). See docs in protocol.py."""
