"""Rollouts of the NeMo-Aligner run through engine servers (``trainer.dapo.rollout_engine``: a served engine of
``nemo_dapo.core.engine_registry``: trtllm | vllm | local).

The servers (``python -m nemo_dapo.engines.server``) are started by the launcher (``containers/dapo.sbatch``) on the
GPUs of the training ranks, colocated; this module connects the trainer to them.

Rank -> server: ``engine_layout.py`` (which rank owns the connection to which server, and its address).

``engine_server.placement: separate`` connects to engines on GPUs of their own instead (``containers/dapo.sbatch``
``ENGINE_NODES``: servers on the last nodes of the job, on TCP; one per data-parallel replica, addressed as
``engine_layout.py`` says). Weights then travel by ``engine_server.weight_transport`` gloo or nccl
(engines/weight_group.py), from the owner to the engine's workers; the engines never share a GPU with training, so
they need not sleep (``sleep_level`` 0).

Generation. The ranks of one model-parallel (TP x PP) group hold the same prompts (one data-parallel replica). The
owners inside the group split its rows in order (owner j of k takes rows [j B / k, (j + 1) B / k)), and each owner in
turn broadcasts its part to the group (tensors of a broadcast size, :func:`broadcast_generation`), so every rank
returns the same ``Generation``. The ranks first meet in a gloo twin of the group (``wait_group``), so that the others
wait out the owners' generation on the CPU, not inside the NCCL broadcast (core/collective.py). Every group needs at
least one owner (the first GPUs, or the match of ``engine_layout.py``); the validator and the builder check it. Partial
rollouts (``trainer.dapo.rollout.on_filler_full: suspend``) go through ``stream_requests`` the same way: the owners
split a round's groups in order, and each round runs to its end (the loop hands finished groups over between rounds, in
prompt order, core/loop_stream.py), so every rank of every data-parallel replica follows the same rounds.

Weights. Every rank runs the HF-named gather (``megatron.refit_hf.hf_weight_buckets``: TP all-gathers, expert
broadcasts, PP broadcasts) to the end; only owners send the buckets. A failure on any owner is finished in step
(the gather is drained so no rank hangs in a collective) and then raised on EVERY rank: the run stops, the server
refuses to generate on partial weights.

Memory phases of a colocated step (trainer and engine on the same GPUs; DAPOLoop.step calls sleep, the updates,
update_weights, then generate):
  1. ``sleep``: the engine frees its KV cache (sleep_level 1; level 2 its weights too) before the trainer trains.
  2. training: old log-probs and optimizer updates (the optimizer states are on the GPU: ActorPolicy.train_step
     onloads them).
  3. ``update_weights``: the optimizer states go to the CPU (NeMo-Aligner's ``offload_adam_states``: apex
     distributed-Adam buckets with ``model.dapo.offload_adam_states``), the training peak is returned to the device
     (:func:`release_training_memory`), then the refit runs WITH THE KV CACHE STILL ASLEEP: weights the sleep
     kept are updated in place, weights it released are woken alone first (``wake {tags: ["weights"]}``,
     :func:`refit_wake`).
  4. the next ``generate`` wakes the KV cache, and generation runs beside the resident training weights and
     gradient buffers only.
With ``model.dapo.offload_training_state`` (aligner/training_offload.py) step 3 also moves the main grads and the
optimizer states of any optimizer to the host before the refit and the weights after it, so generation runs beside
none of the training state; ``sleep`` onloads it all after the engine has freed its KV cache (step 1).
A server that does not say what its sleep releases (hello ``info["sleep_releases"]``) is woken whole before the
refit, as before (logged once): its KV cache then sits beside the refit's buffers.
"""
from __future__ import annotations

import gc
import logging
import os
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from nemo_dapo.aligner.engine_layout import EngineLayout, owners_in_group, separate_address
from nemo_dapo.aligner.training_offload import AFTER_REFIT, BEFORE_REFIT, offload_enabled, training_state_offload
from nemo_dapo.cluster.config_load import required
from nemo_dapo.core.collective import collective_device, cpu_wait_group, every_group
from nemo_dapo.core.loop_data import mix_seed
from nemo_dapo.core.types import Generation

log = logging.getLogger("nemo_dapo")


def split_rows(b: int, k: int) -> list:
    """[(lo, hi)] of ``b`` rows over ``k`` owners, contiguous and in order."""
    return [(j * b // k, (j + 1) * b // k) for j in range(k)]


def broadcast_generation(part: Optional[Generation], src: int, group) -> Generation:
    """``part`` of global rank ``src`` (None on the other ranks) on every rank of ``group``.

    Three broadcasts from ``src``: a header [rows, width, has_logprobs, has_finished] (int64), ids
    [rows, width + 1 + has_finished] (int64, the last columns ``truncated`` and ``finished``) and
    [1 or 2, rows, width] float32 (the mask, the log-probs; left out when width is 0: rows without a response token,
    e.g. samples cut before their first token, still carry their flags). The transient device memory is one part,
    ``rows x (8 (width + 2) + 4 width (1 + has_logprobs))`` bytes at most, where an ``all_gather_object`` held
    world x the largest pickled part."""
    device = collective_device(group)
    header = torch.zeros(4, dtype=torch.long)
    if part is not None:
        header = torch.tensor([part.response_ids.shape[0], part.response_ids.shape[1], part.logprobs is not None,
                               part.finished is not None], dtype=torch.long)
    header = header.to(device)
    dist.broadcast(header, src, group=group)
    rows, width, has_lp, has_fin = (int(x) for x in header.tolist())
    if rows == 0:  # nothing to send (the header says so on every rank)
        return part if part is not None else Generation(
            response_ids=torch.zeros(rows, width, dtype=torch.long), response_mask=torch.zeros(rows, width),
            truncated=torch.zeros(rows, dtype=torch.bool), logprobs=torch.zeros(rows, width) if has_lp else None,
            finished=torch.ones(rows, dtype=torch.bool) if has_fin else None)
    if part is not None:
        flags = [part.truncated] + ([part.finished] if has_fin else [])
        ids = torch.cat([part.response_ids.long()] + [f.long().reshape(-1, 1) for f in flags], dim=1).to(device)
        floats = [part.response_mask.float()] + ([part.logprobs.float()] if has_lp else [])
        floats = torch.stack(floats).to(device)
    else:
        ids = torch.empty(rows, width + 1 + has_fin, dtype=torch.long, device=device)
        floats = torch.empty(1 + has_lp, rows, width, dtype=torch.float32, device=device)
    dist.broadcast(ids, src, group=group)
    if width:
        dist.broadcast(floats, src, group=group)
    if part is not None:
        return part
    ids, floats = ids.cpu(), floats.cpu()
    return Generation(response_ids=ids[:, :width], response_mask=floats[0], truncated=ids[:, width].bool(),
                      logprobs=floats[1] if has_lp else None, finished=ids[:, width + 1].bool() if has_fin else None)


def release_training_memory() -> None:
    """Return what training left in the caching allocator (activations, logits, temporaries of the gather) to the
    device, so that the engine can allocate it: a no-op without CUDA."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def offload_optimizer_states(actor) -> None:
    """NeMo-Aligner's ``offload_adam_states`` on the actor (0.7.0, megatron_gpt_ppo_actor.py): with apex's
    distributed Adam and ``model.dapo.offload_adam_states`` its state buckets (params / remainders / exp_avg /
    exp_avg_sq shards) move to the CPU until ``prepare_for_training`` onloads them before the next update; with
    any other optimizer it changes nothing (the states stay resident: ``nemo-dapo plan`` counts them so)."""
    if getattr(actor, "_optimizer", None) is not None and callable(getattr(actor, "offload_adam_states", None)):
        actor.offload_adam_states()


# What a refit needs from a sleeping engine (refit_wake's answer).
AWAKE, ASLEEP, WEIGHTS_WOKEN, ALL_WOKEN = "awake", "asleep", "weights", "all"
_warned_servers: set = set()


def refit_wake(engine) -> str:
    """Ready ``engine`` (``engines.generator.EngineGenerator``) for a weight update without waking its KV cache.

    The server's hello ``info["sleep_releases"]`` maps a sleep level ("1", "2") to what it frees ("kv_cache",
    "weights"). Returns AWAKE (not asleep), ASLEEP (its sleep kept the weights: update them asleep),
    WEIGHTS_WOKEN (sent ``wake {tags: ["weights"]}``, advertised by ``info["wake_tags"]``), or ALL_WOKEN (a server
    that says neither: woken whole, KV cache included, as before)."""
    if not engine.asleep:
        return AWAKE
    info = engine.client.info or {}
    released = (info.get("sleep_releases") or {}).get(str(engine.sleep_level))
    if released is not None and "weights" not in released:
        return ASLEEP
    if released is not None and "weights" in (info.get("wake_tags") or ()):
        engine.client.wake(tags=["weights"])
        return WEIGHTS_WOKEN
    if engine.client.name not in _warned_servers:
        _warned_servers.add(engine.client.name)
        log.warning("engine %s does not say what its sleep(%d) releases or cannot wake its weights alone: it is "
                    "woken whole before each refit, so its KV cache sits beside the refit's buffers",
                    engine.client.name, engine.sleep_level)
    return ALL_WOKEN


class _ActorWeights:
    """The ``hf_weight_buckets(bucket_bytes)`` face of the NeMo actor's megatron-core model for ``weight_buckets``."""

    def __init__(self, actor, hf_config, dtype: Optional[torch.dtype]):
        self.actor, self.hf_config, self.dtype = actor, hf_config, dtype

    def hf_weight_buckets(self, bucket_bytes: int) -> Iterator[list]:
        from nemo_dapo.megatron.refit_hf import hf_weight_buckets, layer_spec_name

        chunks = self.actor.model if isinstance(self.actor.model, list) else [self.actor.model]
        if len(chunks) != 1:
            raise NotImplementedError("engine refit runs one model chunk per rank (no virtual pipeline stages)")
        return hf_weight_buckets(chunks[0], self.hf_config, bucket_bytes=bucket_bytes,
                                 spec=layer_spec_name(chunks[0]), dtype=self.dtype)


class _DrainedStream:
    """``stream()`` / ``stream_requests()``'s result for a model-parallel group: ``parts`` [(key, Generation)] run to
    their end, yielded in key order. The loop drains a stream under data parallelism and generates partial rollouts
    in rounds, each run to its end (core/loop_stream.py), so nothing is lost by not aborting.

    ``later``: the parts are collected (a collective of the model-parallel group) when first read, so the engines
    run between the submission and the read (overlap: a round generated while the trainer trains)."""

    def __init__(self, parts: list, generated_tokens: int):
        self._parts, self._generated, self._collect = parts, int(generated_tokens), None
        self.aborted_tokens = self.aborted_requests = 0
        self.done = True

    @classmethod
    def later(cls, collect: Callable[[], tuple]) -> "_DrainedStream":
        stream = cls([], 0)
        stream._collect = collect
        return stream

    def _read(self) -> None:
        if self._collect is not None:
            collect, self._collect = self._collect, None
            self._parts, self._generated = collect()

    @property
    def generated_tokens(self) -> int:
        self._read()
        return self._generated

    def __iter__(self):
        self._read()
        yield from self._parts

    def abort(self) -> None:
        pass


def _rows(gen: Generation, lo: int, hi: int) -> Generation:
    return Generation(response_ids=gen.response_ids[lo:hi], response_mask=gen.response_mask[lo:hi],
                      truncated=gen.truncated[lo:hi],
                      logprobs=None if gen.logprobs is None else gen.logprobs[lo:hi],
                      finished=None if gen.finished is None else gen.finished[lo:hi])


_EMPTY = Generation(response_ids=torch.zeros(0, 0, dtype=torch.long), response_mask=torch.zeros(0, 0),
                    truncated=torch.zeros(0, dtype=torch.bool))


class AlignerEngineGenerator:
    """``Generator`` (core/types.py) of one rank of the NeMo-Aligner run over the engine servers (module doc).

    ``engine``: this rank's ``engines.generator.EngineGenerator`` when it owns a connection, else None;
    ``owners``: the owners of this rank's model-parallel group (global ranks); ``mp_group``: that group;
    ``wait_group``: a gloo group of the same ranks (``core.collective.cpu_wait_group``) where the ranks wait for the
    owners' engines before the results exchange, or None (a group of one rank, or tests)."""

    def __init__(self, actor, engine, *, owners: list, mp_group, hf_config, dtype: Optional[torch.dtype] = None,
                 pad_id: int, training_offload=None, wait_group=None):
        if not owners:
            raise ValueError("a model-parallel group without an engine owner cannot generate (see EngineLayout)")
        self.actor, self.engine, self.owners, self.mp_group = actor, engine, list(owners), mp_group
        self.wait_group = wait_group
        self.pad_id = int(pad_id)
        self._weights = _ActorWeights(actor, hf_config, dtype)
        self.last_update: dict = {}
        self.last_refit_wake: Optional[str] = None  # what the last refit woke (refit_wake), for logs and tests
        # megatron.state_offload.StateOffload with model.dapo.offload_training_state, else None
        self.training_offload = training_offload
        if training_offload is not None:
            actor.training_state_offload = training_offload  # ActorPolicy's guard reads it (onload_for_use)
        if engine is not None:  # the loop logs timing/engine_idle_* where this exists: on the owners (rank 0 is one)
            self.idle_seconds = engine.idle_seconds

    @property
    def rank(self) -> int:
        return dist.get_rank()

    # ---- generation ------------------------------------------------------------------------------------------------
    def _wait_for_owners(self) -> None:
        """Every rank of the model-parallel group meets here, on the CPU, once the owners have their engines' results
        (core/collective.py: the others would otherwise wait out the whole generation inside the NCCL exchange)."""
        if self.wait_group is not None:
            dist.barrier(group=self.wait_group)

    def _gather(self, part: Optional[Generation]) -> Generation:
        size = dist.get_world_size(self.mp_group) if self.mp_group is not None else 1
        if size == 1:
            return part
        self._wait_for_owners()
        parts = [broadcast_generation(part if owner == self.rank else None, owner, self.mp_group)
                 for owner in self.owners]
        return Generation.cat(parts, self.pad_id)

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, max_new_tokens,
                 temperature: float = 1.0, top_p: float = 1.0, seed: Optional[int] = None) -> Generation:
        """LEFT-padded [B, P] prompts -> one response per row, identical on every rank of the model-parallel group."""
        part = None
        if self.engine is not None:
            j = self.owners.index(self.rank)
            lo, hi = split_rows(prompt_ids.shape[0], len(self.owners))[j]
            budget = max_new_tokens[lo:hi] if isinstance(max_new_tokens, torch.Tensor) else max_new_tokens
            part = self.engine.generate(prompt_ids[lo:hi], prompt_mask[lo:hi], max_new_tokens=budget,
                                        temperature=temperature, top_p=top_p,
                                        seed=None if seed is None else mix_seed(int(seed), j))
        return self._gather(part)

    def stream(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, n: int, max_new_tokens: int,
               temperature: float = 1.0, top_p: float = 1.0, seed: Optional[int] = None) -> _DrainedStream:
        """n samples of each prompt, as the groups of a drained stream (rows of prompt k: [k n, (k + 1) n))."""
        rep = lambda x: x.repeat_interleave(n, dim=0)  # noqa: E731
        gen = self.generate(rep(prompt_ids), rep(prompt_mask), max_new_tokens=max_new_tokens,
                            temperature=temperature, top_p=top_p, seed=seed)
        parts = [(k, _rows(gen, k * n, (k + 1) * n)) for k in range(prompt_ids.shape[0])]
        return _DrainedStream(parts, int(gen.response_mask.sum()))

    def stream_requests(self, groups: list, *, temperature: float = 1.0, top_p: float = 1.0, into=None,
                        first_key: int = 0) -> _DrainedStream:
        """Explicit requests (``engines.generator.EngineGenerator.stream_requests``: ``groups[k]`` a list of
        ``(prompt token ids, n, max_new_tokens, seed)``), run to their end: the owners of the model-parallel group
        split the groups in order and submit their share now; when the stream is first read, every rank gets every
        group's samples (``finished`` included) and the tokens generated. A stream left running through the update
        in finishing order (``into``) is not built here: the NeMo-Aligner path overlaps in rounds."""
        if into is not None:
            raise NotImplementedError("overlap in finishing order (a stream left running through the update) runs "
                                      "on the CPU path only; the NeMo-Aligner path overlaps one round in prompt order")
        shares = split_rows(len(groups), len(self.owners))
        stream = None
        if self.engine is not None:
            lo, hi = shares[self.owners.index(self.rank)]
            stream = self.engine.stream_requests(groups[lo:hi], temperature=temperature, top_p=top_p)

        def collect() -> tuple:
            mine = None
            if stream is not None:
                lo, hi = shares[self.owners.index(self.rank)]
                outs = dict(stream)
                mine = ([outs.get(k) for k in range(hi - lo)], stream.generated_tokens)
            self._wait_for_owners()
            parts, generated = [], 0
            for j, (lo, hi) in enumerate(shares):
                got, tokens = self._exchange_groups(mine if self.owners[j] == self.rank else None, self.owners[j],
                                                    hi - lo)
                parts += [(first_key + lo + k, gen) for k, gen in enumerate(got) if gen is not None]
                generated += tokens
            return parts, generated

        return _DrainedStream.later(collect)

    def _exchange_groups(self, mine, owner: int, n: int) -> tuple:
        """Owner ``owner``'s ``(n Generations or None, generated tokens)`` on every rank of the model-parallel group:
        its row counts (0 for a group without requests) and tokens in one broadcast, the rows in one Generation."""
        size = dist.get_world_size(self.mp_group) if self.mp_group is not None else 1
        if size == 1:
            return mine
        counts = torch.zeros(n + 1, dtype=torch.long)
        if mine is not None:
            rows_of = [0 if g is None else g.response_ids.shape[0] for g in mine[0]]
            counts = torch.tensor(rows_of + [mine[1]], dtype=torch.long)
        counts = counts.to(collective_device(self.mp_group))
        dist.broadcast(counts, owner, group=self.mp_group)
        counts = counts.cpu().tolist()
        rows = None
        if mine is not None:
            present = [g for g in mine[0] if g is not None]
            rows = Generation.cat(present, self.pad_id) if present else _EMPTY
        rows = broadcast_generation(rows, owner, self.mp_group)
        got, at = [], 0
        for c in counts[:n]:
            got.append(_rows(rows, at, at + c) if c else None)
            at += c
        return got, counts[n]

    # ---- weights and memory ----------------------------------------------------------------------------------------
    def update_weights(self, policy=None) -> None:
        """The refit phase (module doc, step 3): optimizer states to the CPU, the training peak released, then the
        actor's weights gathered in HF names on every rank and sent by the owners, the engine's KV cache still
        asleep. Raises on every rank if any owner's update failed (after the gather has been drained in step)."""
        offload_optimizer_states(self.actor)
        if self.training_offload is not None:  # the gather below reads the weights only
            self.training_offload.offload(BEFORE_REFIT)
        release_training_memory()
        failure = None
        if self.engine is not None:
            try:
                self.last_refit_wake = refit_wake(self.engine)
            except Exception as e:  # noqa: BLE001 - the other ranks are about to gather: finish in step
                failure = e
        buckets = self._weights.hf_weight_buckets(self.engine.bucket_bytes if self.engine else 64 << 20)
        if self.engine is not None:
            counted = _Counting(buckets)
            try:
                if failure is None:
                    self.engine.update_weights(counted, wake=self.last_refit_wake == ALL_WOKEN)
                    self.last_update = u = dict(self.engine.last_update)
                    log.info("refit of engine %s: %s buckets, %.1f MB over %s in %.2f s", self.engine.client.name,
                             u.get("buckets"), u.get("bytes", 0) / 2 ** 20, u.get("transport", "?"),
                             u.get("seconds", 0.0))
            except Exception as e:  # noqa: BLE001 - finished in step below, then raised on every rank
                failure = e
            for _ in counted.rest():  # the other ranks are still in the gather's collectives
                pass
        else:
            for bucket in buckets:
                del bucket
        if self.training_offload is not None:  # before the all-reduce: every rank has freed when an owner generates
            self.training_offload.offload(AFTER_REFIT)
            release_training_memory()
        flag = torch.tensor([0.0 if failure is None else 1.0], device=collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if failure is not None:
            raise failure
        if float(flag.item()) > 0:
            raise RuntimeError("an engine weight update failed on another rank (its log names the engine); the run "
                               "stops rather than generate on partial weights")

    def push_initial_weights(self) -> None:
        """The first refit (the engines start from the trainer's, possibly resumed, weights), with the KV cache
        asleep like every later one: the engine sleeps first (its sleep_level), the next generate wakes it."""
        self.sleep()
        self.update_weights()

    def sleep(self) -> None:
        """The engine frees its KV cache (its sleep_level); an offloaded training state then comes back (after a
        barrier: the owner's sleep also frees the GPUs of the other ranks of its engine). The others wait for the
        owners' sleeps on the CPU (``wait_group``), not in the training's first NCCL collective."""
        if self.engine is not None:
            self.engine.sleep()
        self._wait_for_owners()
        if self.training_offload is not None and self.training_offload.offloaded_parts:
            dist.barrier()
            self.training_offload.onload()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.client.close()


class _Counting:
    """A bucket iterator whose unconsumed rest can still be drained after its consumer stopped on an error."""

    def __init__(self, buckets):
        self._it = iter(buckets)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._it)

    def rest(self):
        yield from self._it

    # weight_buckets() looks for hf_weight_buckets on the policy it is given; this object is that policy
    def hf_weight_buckets(self, bucket_bytes: int):
        return self


# ---- configuration -----------------------------------------------------------------------------------------------
# the keys of trainer.dapo.engine_server this module reads (the engine options are the servers')
SERVER_KEYS = ("hf_model_dir", "tensor_parallel_size", "pipeline_parallel_size", "address", "address_env",
               "base_port", "authkey_env", "connect_timeout_s", "request_timeout_s", "weight_timeout_s", "bucket_mb",
               "dtype", "sleep_level", "placement", "weight_transport")


def server_settings(cfg) -> dict:
    """``trainer.dapo.engine_server``'s :data:`SERVER_KEYS`, read strictly (the defaults live in
    conf/gpt_dapo_actor.yaml), plus ``gpus_per_node`` = trainer.devices. ``cfg``: the whole run config."""
    srv = {k: required(cfg, f"trainer.dapo.engine_server.{k}", "") for k in SERVER_KEYS}
    srv["gpus_per_node"] = int(required(cfg, "trainer.devices", ""))
    return srv


def build_engine_generator(actor, cfg, *, hf_config=None, world: Optional[int] = None,
                           rank: Optional[int] = None) -> AlignerEngineGenerator:
    """Connect this rank (when it owns a server) and return the generator; pushes the actor's weights once, so the
    engines start from the trainer's (possibly resumed) weights. ``cfg``: the whole run config."""
    from megatron.core import parallel_state as mcore_ps

    srv = server_settings(cfg)
    engine_name = cfg.trainer.dapo.rollout_engine
    world = dist.get_world_size() if world is None else world
    rank = dist.get_rank() if rank is None else rank
    layout = EngineLayout(world=world, gpus_per_node=srv["gpus_per_node"],
                          engine_gpus=int(srv["tensor_parallel_size"]) * int(srv["pipeline_parallel_size"]))
    mp_group = mcore_ps.get_model_parallel_group()
    separate = srv["placement"] == "separate"
    groups = every_group(mp_group)  # the world's model-parallel groups: the owners' match and the wait groups
    owners = _engine_owners(layout, mp_group, separate, groups)
    hf_config = _engine_hf_config(srv) if hf_config is None else hf_config
    actor.valid_vocab = int(hf_config.vocab_size)  # the HF-shaped engine has no vocabulary-padding rows
    owns = rank in owners
    engine = _connect_engine(actor, srv, engine_name, layout, rank, separate) if owns else None
    dtype = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[srv["dtype"]]
    offload = training_state_offload(actor) if offload_enabled(actor.cfg) else None
    wait_group = cpu_wait_group(mp_group, groups=groups) if dist.get_world_size(mp_group) > 1 else None
    gen = AlignerEngineGenerator(actor, engine, owners=owners, mp_group=mp_group, hf_config=hf_config, dtype=dtype,
                                 pad_id=actor.tokenizer.eos_id, training_offload=offload, wait_group=wait_group)
    gen.push_initial_weights()
    if offload is not None:  # the first push's offload is not a rollout step's
        offload.pop_stats()
    return gen


def _engine_owners(layout: EngineLayout, mp_group, separate: bool, groups: list) -> list:
    """The global ranks of this model-parallel group that own an engine. Colocated: from every group of the world
    (``groups``, the same on every rank), so every rank computes the same assignment, and raises the same error where
    a group gets none."""
    mine = sorted(dist.get_process_group_ranks(mp_group))
    if separate:  # one engine per data-parallel replica, on GPUs of its own; the replica's first rank owns it
        return [mine[0]]
    return owners_in_group(layout, mine, groups=groups)


def _engine_hf_config(srv: dict):
    """The Hugging Face config of the directory the engines load (it names the weights the trainer sends)."""
    from transformers import AutoConfig

    if not srv["hf_model_dir"]:
        raise ValueError("trainer.dapo.engine_server.hf_model_dir is not set: give the Hugging Face directory the "
                         "engines load (its config.json names the weights the trainer sends)")
    return AutoConfig.from_pretrained(srv["hf_model_dir"])


def _connect_engine(actor, srv: dict, engine_name: str, layout: EngineLayout, rank: int, separate: bool):
    """This owner rank's EngineGenerator, connected to its server (address from the layout, key from the env)."""
    from megatron.core import parallel_state as mcore_ps

    from nemo_dapo.engines.client import EngineClient
    from nemo_dapo.engines.generator import EngineGenerator

    template = os.environ.get(srv["address_env"]) or srv["address"]
    if separate:
        address = separate_address(template, mcore_ps.get_data_parallel_rank(),
                                   mcore_ps.get_data_parallel_world_size(), layout.engines_per_node,
                                   int(srv["base_port"]), rank)
    else:
        address = layout.address(rank, template, int(srv["base_port"]), owner=rank)
    authkey = os.environ.get(srv["authkey_env"], "").encode() or None
    client = EngineClient(address, authkey=authkey, name=f"{engine_name}@{address}",
                          connect_timeout_s=float(srv["connect_timeout_s"]),
                          request_timeout_s=float(srv["request_timeout_s"]),
                          weight_timeout_s=float(srv["weight_timeout_s"]),
                          check_shared_memory=srv["weight_transport"] == "shm")  # another node's /dev/shm is not ours
    log.info("rank %d owns engine %s at %s (%s)", rank, engine_name, address, client.info)
    tok = actor.tokenizer
    top_k = int(required(actor.cfg, "dapo.sampling_params.top_k", "model"))
    return EngineGenerator(client, eos_id=tok.eos_id, pad_id=tok.eos_id, top_k=top_k,
                           bucket_bytes=int(srv["bucket_mb"]) << 20, sleep_level=int(srv["sleep_level"]),
                           weight_transport=srv["weight_transport"])
