"""`nonstop serve`: an engine behind an OpenAI-compatible HTTP server, and its async clients.

- command.py         `serve(cfg, model_path, ...)`, what `nonstop serve` runs: the tokenizer, the engine
                     `cfg.engine.kind` names (built-in or vLLM, in this process) at the policy_version
                     the weights were saved at, served until SIGINT/SIGTERM, then a clean shutdown
                     within about a second (a second Ctrl-C interrupts even that); a vLLM that is
                     missing or cannot load the model raises VllmSetupError before anything binds;
- fields.py          the request field types: strict JSON types with the engine's bounds;
- schema.py          the request shapes as pydantic models: they validate every request and give
                     the JSON schema;
- validation.py      a body against a request model, or `BadRequest` naming the field;
- responses.py       the response shapes as pydantic models, with the `nonstop` extension (token
                     ids, behaviour logprobs, policy versions); every answer is built from them;
- openapi.py         the OpenAPI document of both, served at `GET /openapi.json` and fuzzed against;
- protocol.py        requests as engine calls (`Call`), stop strings on text, the extension of a sample,
                     `ServedEngine` (what the server asks of an engine);
- server.py          `EngineServer`: the aiohttp routes over any `ServedEngine` (built-in or vLLM);
- answers.py         `Answers`: the engine's samples written as OpenAI responses, whole or streamed;
- generate_route.py  vLLM's token-level `POST /inference/v1/generate` (what verifiers' train client calls);
- recorder.py        `EpisodeRecorder`: agents' episodes recorded token by token under the episode id they
                     pass, rewarded, handed to training by group (a training run's agents endpoint);
- episode_record.py  what is recorded of an episode (`Turn`), and a request's episode and group ids;
- client.py          `GenerationClient` and its two implementations: `InProcessClient`, `HttpClient`.
"""
