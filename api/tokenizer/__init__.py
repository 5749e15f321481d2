"""Token counting from the model's own tokenizer: ``/tokenize``, ``/detokenize`` and
``/tokenizer_info`` in llama.cpp's server's and vLLM's shapes, answered by a runner of the
model (``asking.py``); Anthropic's ``count_tokens`` asks the same way."""
