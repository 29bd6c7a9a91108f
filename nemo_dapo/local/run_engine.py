"""The CPU job's rollouts through an engine server (``rollout.engine: local | vllm``), not the in-process sampler.

The trainer writes its current model once as a Hugging Face directory (``run_dir/engine_model``, what the engine
loads at start), starts ``python -m nemo_dapo.engines.server`` with the configured interpreter (the vLLM engine
lives in a venv of its own), connects, and pushes its weights in memory after every update. The socket lives in a
short private directory (Unix socket paths are limited to ~100 characters).
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile

from nemo_dapo.core import engine_registry
from nemo_dapo.engines.client import EngineClient, EngineProcess
from nemo_dapo.engines.generator import EngineGenerator
from nemo_dapo.engines.protocol import parse_address
from nemo_dapo.local.config import Config, ConfigError

log = logging.getLogger("nemo_dapo")


class EngineRollouts:
    """Owns the engine process (when the trainer starts it) and the client; ``generator`` is the loop's.

    A trainer-started server gets a fresh random key through its environment (``EngineProcess``); a server of
    ``rollout.server.address`` is reached with ``$NEMO_DAPO_ENGINE_AUTHKEY`` / ``$NEMO_DAPO_ENGINE_AUTHKEY_FILE``. A
    start that fails leaves no process and no socket directory behind."""

    def __init__(self, cfg: Config, model, tokenizer, policy):
        srv, engine = cfg.rollout.server, cfg.rollout.engine
        self.proc, self.client, self._sock_dir = None, None, None
        address = srv.address
        if address is not None:
            try:
                parse_address(address)
            except ValueError as e:
                raise ConfigError(f"rollout.server.address: {e} (or null: the trainer starts the engine)") from None
        try:
            if address is None:
                model_dir = os.path.join(os.path.abspath(cfg.run_dir), "engine_model")
                _save_hf(model, tokenizer, model_dir)
                address = self._start(cfg, model_dir)
            self.client = EngineClient(address, name=engine, connect_timeout_s=srv.connect_timeout_s,
                                       request_timeout_s=srv.request_timeout_s,
                                       weight_timeout_s=srv.weight_timeout_s, process=self.proc,
                                       check_shared_memory=srv.weight_transport == "shm")
            log.info("rollouts through engine %s at %s (%s)", engine, address, self.client.info)
            self.generator = EngineGenerator(self.client, eos_id=tokenizer.eos_token_id,
                                             pad_id=tokenizer.pad_token_id, bucket_bytes=srv.bucket_mb << 20,
                                             sleep_level=srv.sleep_level, weight_transport=srv.weight_transport)
            self.generator.update_weights(policy)  # resumed or not, the engine starts from the trainer's weights
        except BaseException:
            self.close()
            raise

    def _start(self, cfg: Config, model_dir: str) -> str:
        srv, engine = cfg.rollout.server, cfg.rollout.engine
        self._sock_dir = tempfile.mkdtemp(prefix="nemo-dapo-")  # mode 0700: only this user can reach the socket
        address = f"unix:{self._sock_dir}/engine.sock"
        options = {"max_batch_size": srv.max_batch_size}
        if engine_registry.ENGINES[engine].engine_seed:
            options["seed"] = cfg.seed
        self.proc = EngineProcess(engine=engine, model_dir=model_dir, address=address, python=srv.python,
                                  options=options, threads=srv.threads,
                                  cpus=None if srv.cpus is None else list(srv.cpus),
                                  log_path=os.path.join(cfg.run_dir, f"engine-{engine}.log"))
        return address

    def close(self) -> None:
        try:
            if self.proc is not None:
                self.proc.stop(self.client if self.client is not None and self.client.alive else None)
            elif self.client is not None:
                self.client.close()
        finally:
            if self._sock_dir:
                shutil.rmtree(self._sock_dir, ignore_errors=True)


def _save_hf(model, tokenizer, directory: str) -> None:
    from nemo_dapo.core.checkpoint import atomic_directory

    with atomic_directory(directory) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
