"""The in-place KV cache of the local decode loops (``LocalSampler``, ``LocalEngine``) for transformers 4.x and 5.x.

Each model layer has two buffers ``keys`` / ``values`` [batch, kv_heads, capacity, head_dim], allocated once
(``DynamicCache`` concatenates every step, which made cache copies the largest cost of CPU decoding). A forward
writes its new K/V in place at column ``end`` and attends to the view ``[:rows, :, start:end]``; ``rows`` (None:
all) and ``start`` / ``end`` are set by the caller between forwards (``set_window``) or simply advance (the sampler).
The attention mask passed to the model, not the buffer size, sets the key length.

transformers changed the ``Cache`` interface at 5.0 (feature-detected here, no version strings):

* 4.x (4.47): ``Cache`` is an ``nn.Module`` whose subclasses implement ``update(k, v, layer_idx, cache_kwargs)``,
  ``get_seq_length(layer_idx)`` and ``get_max_cache_shape()`` (None: the mask's width is the key length);
* 5.x: ``Cache.__init__`` takes ``layers`` or ``layer_class_to_replicate`` and delegates to per-layer
  ``CacheLayerMixin`` objects; ``masking_utils.create_causal_mask`` sizes the mask from ``get_query_offset`` /
  ``get_mask_sizes(query_length, layer_idx)`` and reads ``is_sliding`` / ``is_compileable`` of the layers.

Here the per-layer state is always an ``InPlaceLayer`` (a ``CacheLayerMixin`` under 5.x); ``InPlaceCache`` is the
``Cache`` holding them, with the 4.x methods added where the base class does not delegate to layers.
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch
from transformers import Cache

try:
    from transformers.cache_utils import CacheLayerMixin
except ImportError:  # transformers < 4.54: no per-layer cache objects
    CacheLayerMixin = None

#: True where ``Cache`` is a container of per-layer ``CacheLayerMixin`` objects (``Cache(layers=...)``, as in 5.x).
LAYERED = CacheLayerMixin is not None and "layers" in inspect.signature(Cache.__init__).parameters


class InPlaceLayer(CacheLayerMixin if LAYERED else object):
    """One layer's K/V buffers and the view the next forward writes into and attends to (see the module docstring)."""

    is_compileable = False  # shapes change every step; also keeps the mask builders' is_causal shortcut
    is_sliding = False
    is_croppable = False

    def __init__(self, capacity: int = 0):
        if LAYERED:
            super().__init__()
        else:
            self.keys = self.values = None
            self.is_initialized = False
        self.capacity = int(capacity)
        self.rows: Optional[int] = None
        self.start = self.end = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.allocate(key_states.shape[0], key_states.shape[1], self.capacity, key_states.shape[-1],
                      value_states.shape[-1], key_states.dtype, key_states.device)

    def allocate(self, batch, heads, capacity, k_dim, v_dim, dtype, device) -> None:
        self.dtype, self.device = dtype, device
        # zeros: masked columns still enter q.k and p.v, and 0 * a NaN from uninitialised memory is NaN
        self.keys = torch.zeros(batch, heads, capacity, k_dim, dtype=dtype, device=device)
        self.values = torch.zeros(batch, heads, capacity, v_dim, dtype=dtype, device=device)
        self.capacity, self.is_initialized = capacity, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, stop, rows = self.end, self.end + key_states.shape[-2], self.rows
        if stop > self.keys.shape[-2]:
            raise RuntimeError(f"KV cache overflow: {stop} > capacity {self.keys.shape[-2]}")
        self.keys[:rows, :, start:stop] = key_states
        self.values[:rows, :, start:stop] = value_states
        self.end = stop
        return self.keys[:rows, :, self.start:stop], self.values[:rows, :, self.start:stop]

    def get_seq_length(self, *args) -> int:
        return self.end - self.start

    def get_mask_sizes(self, query_length, *args) -> tuple:
        """(kv_length, kv_offset) of the next forward: the view plus the new tokens, offset 0 (the 2-D attention mask
        passed to the model covers exactly the view's columns plus the new ones). Takes the query length (5.x) or the
        cache positions (the 4.5x layer API)."""
        q = query_length if isinstance(query_length, int) else int(query_length.shape[0])
        return self.get_seq_length() + q, 0

    def get_max_length(self) -> int:
        return -1  # no maximum the mask builders should pad to

    def get_max_cache_shape(self) -> int:
        return -1

    def select_rows(self, idx: torch.Tensor) -> None:
        if self.is_initialized:
            self.keys, self.values = self.keys.index_select(0, idx), self.values.index_select(0, idx)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select_rows(beam_idx.to(self.keys.device) if self.is_initialized else beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select_rows(indices)


class InPlaceCache(Cache):
    """The ``Cache`` over ``InPlaceLayer`` s. ``InPlaceCache(capacity)`` allocates each layer on its first ``update``
    (batch, heads and dtype of the K/V written); ``InPlaceCache.like`` preallocates from another cache's layers."""

    def __init__(self, capacity: int = 0):
        if LAYERED:
            super().__init__(layers=[])
        else:
            super().__init__()
            self.layers = []
        self.capacity = int(capacity)

    @classmethod
    def like(cls, other: "InPlaceCache", batch: int, capacity: int) -> "InPlaceCache":
        """Empty buffers [batch, heads, capacity, head_dim] per layer of ``other`` (same heads, dtype, device)."""
        cache = cls(capacity)
        for src in other.layers:
            layer = InPlaceLayer(capacity)
            layer.allocate(batch, src.keys.shape[1], capacity, src.keys.shape[-1], src.values.shape[-1],
                           src.keys.dtype, src.keys.device)
            cache.layers.append(layer)
        return cache

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        layers = self.layers
        if layer_idx >= len(layers):  # the first forward creates the layers, in order
            layers.extend(InPlaceLayer(self.capacity) for _ in range(layer_idx + 1 - len(layers)))
        return layers[layer_idx].update(key_states, value_states)

    def get_seq_length(self, layer_idx: Optional[int] = 0) -> int:
        layer_idx = layer_idx or 0
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0

    if not LAYERED:
        def get_max_cache_shape(self):
            return None  # 4.x: the attention mask, not the buffer size, sets the key length

    # ---- ours -------------------------------------------------------------------------------------------------
    @property
    def keys(self) -> list:
        """The per-layer key buffers [batch, heads, capacity, head_dim] (write into them, do not rebind)."""
        return [layer.keys for layer in self.layers]

    @property
    def values(self) -> list:
        return [layer.values for layer in self.layers]

    def set_window(self, rows: Optional[int], start: int, end: int) -> None:
        """The next forward writes at column ``end`` of rows [0, rows) and attends to columns [start, end + new)."""
        for layer in self.layers:
            layer.rows, layer.start, layer.end = rows, int(start), int(end)

    def select_rows(self, idx: torch.Tensor) -> None:
        """Keep the rows ``idx`` of every buffer (a copy of the whole cache)."""
        for layer in self.layers:
            layer.select_rows(idx)
