"""Environments: the worlds of multi-turn, multi-agent episodes, and their lookup by name.

The episode runner lives in orchestrator/episodes.py.
- base.py                the seam: `Environment`, `MultiAgentEnvironment` (and `SingleAgent` between
                         them), `Step`, `EnvLimits`, `EpisodeResult`, `TurnEngine`, tool calls;
- registry.py            environments by name (built-ins and 'package.module:factory'): `env_factory`,
                         `builtin_task`, `limits`;
- guess.py               guess-the-number, a multi-turn game with feedback (`GuessNumber`);
- calculator.py          a tool task: multiplication through the `calc` tool (`Calculator`);
- nim.py                 Nim: self-play with two roles (`Nim`) and against a scripted mover (`NimVsScripted`);
- warmup.py              the warm-up of a built-in environment (`env_base`): imitate a weak player;
- http.py                `ClientEngine`: a served engine (`nonstop serve`) as the engine of an episode;
- reasoning_gym.py       `reasoning_gym/<dataset>`: reasoning-gym generators and scorers (optional extra);
- textarena_env.py       `textarena/<game id>`: a textarena game, one role per player (optional extra);
- verifiers_env.py       `verifiers/<module:factory>`: a verifiers.v1 Taskset played through verifiers'
                         train client on nonstop's engines (`VerifiersPlayer`, `EngineTransport`);
- verifiers_renderer.py  `TokenRenderer`: a renderer for tokenizers without a chat template;
- verifiers_tasks.py     an example verifiers.v1 taskset: two-operand addition for the tiny model.
"""
