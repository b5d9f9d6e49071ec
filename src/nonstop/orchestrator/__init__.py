"""The orchestrator: the flow of one training run, in the `nonstop train` process (asyncio).

One file per stage of generate -> score -> buffer -> train -> publish, each importing only
those listed before it (no circle; tests/docs/test_layering.py checks it):
- fit.py                  the run fitted to the machine before any actor starts: need -> resolved defaults
                          (sizing/defaults.py) -> the memory plan, checked (sizing/memory.py);
- ledger.py               every drawn prompt settled once (by part, with env.policies);
- buffer.py               admission by depth, the max-lag rule, drops counted;
- dispatch.py             several engines (least-loaded pool) or trainer ranks (lockstep) as one client;
- records.py              `StepRecord` (metrics.jsonl), `RunSummary` (summary.json), `Vitals` (what the
                          run doctor reads of the groups scored);
- progress.py             the progress display of a run (`Progress`) and the table printed at its end;
- generate.py             the producer: admitted prompts -> engine groups (`Production`, `produce`), and
                          held-out evaluation;
- run.py                  `Run` (a run's fixed wiring), `RunState`, and `RunMode`, the seam of the run's
                          mode (where its groups come from); `Run.eval()` asks the mode;
- recovery.py             checkpoint and resume of a run's state; `RunFailed` (`RunInterrupted` is nonstop/errors.py's);
- step.py                 one learner step (take, train, publish, settle), shared by every learning loop;
- actors.py               spawn engines and trainer ranks, connect the weight transport, restart engines;
- modes/__init__.py       the run modes, each a `RunMode`, each with the blocks it is built from:
- modes/single_turn.py    `TaskMode`: groups of completions of a task's prompts (the default);
- modes/environment/__init__.py   an environment's episodes:
- modes/environment/episodes.py   one multi-turn, multi-agent episode through the engines, token-exact;
- modes/environment/episode_flow.py   the producer of an environment run: groups of episodes,
                          per-role advantages;
- modes/environment/mode.py   `EnvMode`: an environment's episodes on the shared policy;
- modes/own_policies/__init__.py   roles on policies of their own (env.policies):
- modes/own_policies/split_intake.py   each group split into one part per policy's buffer;
- modes/own_policies/policies.py   `PolicySide`, `PolicyTally`, `Policies`;
- modes/own_policies/policy_build.py   the own policies' configs, checks and actors;
- modes/own_policies/mode.py   `OwnPoliciesMode`: the own policies' learner loops beside the shared one;
- modes/api_agents/__init__.py   agents over the API:
- modes/api_agents/agents.py   the run's endpoint (`AgentEndpoint`) and the producer its rewarded
                          groups feed;
- modes/api_agents/mode.py   `AgentsMode`: agents' episodes over the API, evaluated as the mode it wraps;
- build.py                `build_run()`: the actors and the stages wired into a `Run`; `build_mode()`, the
                          one choice of the run's mode;
- grow.py                 engines that join mid-run (runtime.max_engines) as nodes with room join;
- step_observers.py       what hangs off each step of the learning loop: spans, FLOPs, records, the
                          doctor, evaluation, checkpoints (`StepObserver`);
- learn.py                the shared policy's learning loop, `learn()`;
- pipeline.py             `train()`: build the run, run the producer beside the learning loop, summarize;
- session.py              one session of a run in this process: the checks before its folder, the base
                          policy, the pipeline under the progress display, summary.json;
- launch.py               `run_training()`: run folder and its lock, data, then session.py (the path
                          shared by `nonstop train` and `nonstop.train()`; light until a run starts);
- verify.py               `nonstop verify`: a run recounted from what its trainer trained and its buffer
                          dropped (observe/consumed.py) against the dataset's own order.
Reward functions are nonstop.scoring's (scoring/rewards.py); text <-> ids is nonstop.tasks.codec.
"""
