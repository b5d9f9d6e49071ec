"""The memory model: a run sized to its model and its machine before any actor starts (docs/memory.md).

config/ holds what the user set; this package works out what follows from it and refuses a run
that would not fit, naming the field to change. orchestrator/fit.py runs it once per run.
- shape.py     `ModelShape`: a model's shape from its config.json: parameter counts, KV bytes per token;
- machine.py   the machine's (or cgroup's) memory (`machine_memory`) and OOM-kill count (`oom_kills`);
- defaults.py  defaults that follow from the run and the model (`size_run`): engine limits,
               micro-batches, `trainer.lr`; the engine sizes its own limits by them;
- plan.py      the plan's data: items per process kind (`MemoryPlan`), refused over its limit with the
               field to change;
- memory.py    `plan_memory`: what each process of the run will hold, item by item.
"""
