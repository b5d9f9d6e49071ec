"""A run's modes: where its groups come from, each one implementation of `RunMode` (run.py).

build.py's `build_mode` chooses one from the config, once, where the run is built; the core of
the run (pipeline.py, learn.py, recovery.py) then calls the mode and names none of them. Each
mode is a sub-package holding its mode class (`mode.py`) and the blocks it is built from:
- single_turn.py  `TaskMode`: groups of completions of a task's prompts, scored by the run's
                  scorer; the defaults the other modes build on. A module, not a package: its
                  producer and evaluation (generate.py) are every mode's, so they stay in the core;
- environment/    `EnvMode`: groups of an environment's episodes, every role on the shared
                  policy; the episode runner (episodes.py) and the episode producer
                  (episode_flow.py), which the other two modes build on as well;
- own_policies/   `OwnPoliciesMode`: an environment's episodes with roles on policies of their
                  own (env.policies), each with its learner loop; what a run keeps of them
                  (policies.py), how they are built (policy_build.py), the split intake
                  (split_intake.py);
- api_agents/     `AgentsMode`: groups of agents' episodes over the API (agents.py: the endpoint
                  and its producer), evaluated as the mode it wraps (the task's, or an
                  environment's).
Dependencies run one way: own_policies/ and api_agents/ import environment/, which imports
neither; build.py and session.py import the modes, the core (run.py, step.py, ...) none.
"""
