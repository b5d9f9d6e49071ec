"""The orchestrator: the flow of one training run, in the `nonstop train` process (asyncio).

One file per stage of generate -> score -> buffer -> train -> publish, each importing only
those listed before it (no circle; tests/docs/test_layering.py checks it):
- fit.py           the run fitted to the machine before any actor starts: need -> resolved defaults
                   (sizing/defaults.py) -> the memory plan, checked (sizing/memory.py);
- ledger.py        every drawn prompt settled once (by part, with env.policies);
- buffer.py        admission by depth, the max-lag rule, drops counted;
- dispatch.py      several engines (least-loaded pool) or trainer ranks (lockstep) as one client;
- records.py       `StepRecord` (metrics.jsonl), `RunSummary` (summary.json), `Vitals` (what the
                   run doctor reads of the groups scored);
- progress.py      the progress display of a run (`Progress`) and the table printed at its end;
- generate.py      the producer: admitted prompts -> engine groups (`Production`, `produce`), and
                   held-out evaluation;
- episodes.py      one multi-turn, multi-agent episode through the engines, token-exact;
- episode_flow.py  the producer of an environment run: groups of episodes, per-role advantages;
- agents.py        agents over the API: the run's endpoint (`AgentEndpoint`) and the producer its
                   rewarded groups feed;
- split_intake.py  with env.policies, each group split into one part per policy's buffer;
- policies.py      roles with their own policy: `PolicySide`, `PolicyTally`, `Policies`;
- run.py           `Run` (a run's fixed wiring) and `RunState`; evaluation of its policies;
- recovery.py      checkpoint and resume of a run's state; `RunFailed` (`RunInterrupted` is nonstop/errors.py's);
- actors.py        spawn engines and trainer ranks, connect the weight transport, restart engines;
- policy_build.py  the own policies' configs, checks and actors;
- build.py         `build_run()`: the actors and the stages wired into a `Run`;
- grow.py          engines that join mid-run (runtime.max_engines) as nodes with room join;
- step.py          one learner step (take, train, publish, settle), shared by both loops;
- learn.py         the learning loops: the shared policy's `learn()`, each own policy's `learn_policy()`;
- pipeline.py      `train()`: build the run, run the producer beside the learning loop, summarize;
- session.py       one session of a run in this process: the checks before its folder, the base
                   policy, the pipeline under the progress display, summary.json;
- launch.py        `run_training()`: run folder and its lock, data, then session.py (the path
                   shared by `nonstop train` and `nonstop.train()`; light until a run starts);
- verify.py        `nonstop verify`: a run recounted from what its trainer trained and its buffer
                   dropped (observe/consumed.py) against the dataset's own order.
Reward functions are nonstop.scoring's (scoring/rewards.py); text <-> ids is nonstop.tasks.codec.
"""
