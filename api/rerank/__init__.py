"""Reranking (``POST /v1/rerank``, ``POST /rerank``), in the shape llama.cpp's server, vLLM,
Jina and Cohere share."""
