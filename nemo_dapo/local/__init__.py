"""The small-scale backend (CPU or one GPU): ``transformers`` decoders (model.py), the ``Policy`` (policy.py), the
KV-cached ``Generator`` (sampler.py) and the supervised warm-up that makes the CPU job's base model (warmup.py).
The CPU job's runner (run*.py) wires them into the core step loop. Import the submodules directly."""
