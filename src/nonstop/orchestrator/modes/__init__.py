"""A run's modes: where its groups come from, each one implementation of `RunMode` (run.py).

build.py's `build_mode` chooses one from the config, once, where the run is built; the core of
the run (pipeline.py, learn.py, recovery.py) then calls the mode and names none of them.
- single_turn.py   `TaskMode`: groups of completions of a task's prompts, scored by the run's
                   scorer (generate.py); the defaults the other modes build on;
- environment.py   `EnvMode`: groups of an environment's episodes, every role on the shared
                   policy (episode_flow.py);
- own_policies.py  `OwnPoliciesMode`: an environment's episodes with roles on policies of their
                   own (env.policies; policies.py), each with its learner loop;
- api_agents.py    `AgentsMode`: groups of agents' episodes over the API (agents.py), evaluated
                   as the mode it wraps (the task's, or an environment's).
"""
