"""The HF engine: decode modes, the forwards they run, static caches, stored KV states, CPU and GPU kernels."""
