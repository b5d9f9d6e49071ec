"""Scoring as a stage of its own, concurrent with generation and training.

- base.py          the `Scorer` seam (what the orchestrator calls), `ScoreComponent`, `Contribution`;
- stage.py         `ScoringStage`: components at once, concurrency cap, retries, backpressure,
                   latency and error accounting; `FunctionComponent` (task.reward, scoring.group_reward);
- runners.py       where reward functions run (`scoring.pool`): the `Runner` seam, `LoopRunner`,
                   `ThreadRunner`, `ProcessRunner`, `AutoRunner`, `make_runner`;
- threads.py       `DaemonThreads`: a fixed pool of daemon threads, one loop wake-up per batch of calls;
- rewards.py       reward functions by name: the built-ins, `resolve_reward`, `RewardFn`, `RewardError`;
- calls.py         how a reward function is called (sync/async, which arguments) and checked;
- pool.py          `ActorPool` (replaceable actor processes; typed: `RewardModelPool`, `TeacherPool`,
                   `RewardWorkerPool`) and the `RewardWorker` actor;
- compose.py       the stage of a config;
- process.py       process rewards (steps -> per-token rewards);
- reward_model.py  a sequence-classification reward model in its own actor;
- judge.py         a generative judge over an OpenAI-compatible HTTP endpoint;
- teacher.py       the on-policy distillation teacher (logprobs of the student's tokens);
- math.py          `math_verify` (optional extra).
"""
