"""Rollout engines as servers: the protocol (protocol.py; its shared-memory buckets: shm.py), the server (server.py),
the trainer-side client and ``Generator`` (client.py, generator.py), the engine adapters (local.py, vllm.py, trtllm.py;
which engine has which adapter: ``nemo_dapo.core.engine_registry``), the TensorRT-LLM API record and its checker
(trtllm_api_snapshot.json, trtllm_check.py), and the health probe (health.py). See docs in protocol.py."""
