"""The export stage: Hugging Face / GGUF models -> ONNX engines with KV cache, tokenizers, manifests.

Needs the `export` extra (torch, transformers, optimum-onnx). The runtime never imports this package.
"""
