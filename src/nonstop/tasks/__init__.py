"""Tasks: where a run's prompts come from, and how its answers are scored on held-out prompts.

The models a run starts from (the tiny-model factory, tokenizers, the warm-up, the base policy)
are nonstop/models/.
- data.py    prompt sources: the built-in addition task and JSONL datasets (`load_task`, `TaskData`,
             `Example`, `PromptStream`, `DatasetError`);
- chat.py    chat rows rendered through the model's chat template, with task.system_prompt (`render_chat`);
- long_rollout.py  the long-rollout task: worked solutions of heavy-tailed length (`long_rollout_rows`);
- codec.py   `Codec`: text <-> token ids at the orchestrator; the held-out score by the task's reward (`HeldOut`).
"""
