"""Environments: the worlds of multi-turn, multi-agent episodes, and their lookup by name.

The episode runner lives in orchestrator/episodes.py; an environment's warm-up (its base policy) in
models/env_warmup.py.
- base.py                the seam: `Environment`, `MultiAgentEnvironment` (and `SingleAgent` between
                         them), `Step`, `EnvLimits`, `EpisodeResult`, `TurnEngine`, tool calls;
- registry.py            environments by name (built-ins and 'package.module:factory'): `env_factory`,
                         `builtin_task`, `limits`;
- guess.py               guess-the-number, a multi-turn game with feedback (`GuessNumber`);
- calculator.py          a tool task: multiplication through the `calc` tool (`Calculator`);
- nim.py                 Nim: self-play with two roles (`Nim`) and against a scripted mover (`NimVsScripted`);
- http.py                `ClientEngine`: a served engine (`nonstop serve`) as the engine of an episode;
- reasoning_gym.py       `reasoning_gym/<dataset>`: reasoning-gym generators and scorers (optional extra);
- textarena_env.py       `textarena/<game id>`: a textarena game, one role per player (optional extra);
- verifiers/env.py       `verifiers/<module:factory>`: a verifiers.v1 Taskset played through verifiers'
                         train client on nonstop's engines (`VerifiersPlayer`);
- verifiers/client.py    verifiers' train client answered by nonstop's engines, in process (`EngineTransport`);
- verifiers/agent.py     `env.verifiers_rollout: agent`: verifiers' own `Agent.run` per episode, its
                         interception and MCP tool servers, on nonstop's engines (`AgentPlayer`);
- verifiers/harness.py   verifiers' `null` harness chat program run in process (`InProcessChatHarness`);
- verifiers/renderer.py  `TokenRenderer`: a renderer for tokenizers without a chat template, tool calls included;
- verifiers/tasks.py     example verifiers.v1 tasksets for the tiny model: addition, products with a calculator tool;
- tool_calls.py          the plain-text tool-call syntax of the tiny models (`@calc 23*7`) and its parser.
"""
