"""Modules the vLLM server imports from this directory (on its `PYTHONPATH`), not or1_trl: the worker extension
(`or1_vllm_worker.py`) and the API-key middleware (`or1_vllm_auth.py`). Both need only vLLM's environment."""
