"""Serving in vLLM: its environment (install_vllm.sh), the engine driver, the serving check (issue 41)."""
