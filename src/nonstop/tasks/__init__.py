"""Built-in tasks, the tiny-model factory and the supervised warm-up.

- data.py    prompt sources: the built-in addition task and JSONL datasets (`load_task`, `TaskData`,
             `Example`, `PromptStream`, `DatasetError`);
- chat.py    chat rows rendered through the model's chat template, with task.system_prompt (`render_chat`);
- long_rollout.py  the long-rollout task: worked solutions of heavy-tailed length (`long_rollout_rows`);
- bpe.py     byte-level BPE tokenizers trained here with the `tokenizers` library (`train_bpe`);
- codec.py   `Codec`: text <-> token ids at the orchestrator; the held-out score by the task's reward (`HeldOut`);
- tiny.py    tiny models and character tokenizers made on the fly (`make_tiny_model`,
             `make_char_tokenizer`);
- warmup.py  the supervised warm-up to a weak (not blank) base policy (`warm_up`, `cached_base`);
- base.py    the base policy a run starts from (`choose_base`, `prepare_base_model`) and the
             shipped bases with their provenance.
"""
