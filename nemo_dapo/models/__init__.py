"""Small Hugging Face decoders and their in-place KV cache (torch + transformers only): the layer below both the
CPU backend (``nemo_dapo.local``: policy, sampler, warm-up) and the local engine (``nemo_dapo.engines.local``).
``decoder.py`` builds / loads the Llama / Qwen2 models, ``kv_cache.py`` is the cache their decode loops write in
place."""
