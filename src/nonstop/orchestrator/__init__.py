"""The orchestrator: the flow of one training run, in the `nonstop train` process (asyncio).

One file per stage of generate -> score -> buffer -> train -> publish:
- launch.py    `run_training()`: run folder, data, base policy, pipeline, summary.json (the path
               shared by `nonstop train` and `nonstop.train()`);
- pipeline.py  `train()`: build the run, run the producer beside the learning loop, summarize;
- build.py     spawn the actors, connect the weight transport, wire the stages (`Run`);
- generate.py  the producer: admitted prompts -> engine groups (and held-out evaluation);
- score.py     rewards for each sample;
- buffer.py    admission by depth, the max-lag rule, drops counted;
- learn.py     the learning loop: take, train, publish, record, checkpoint;
- ledger.py    every drawn prompt settled once; recovery.py checkpoint and resume;
- dispatch.py  several engines (least-loaded pool) or trainer ranks (lockstep) as one client;
- records.py   `StepRecord` (metrics.jsonl) and `RunSummary` (summary.json).
"""
