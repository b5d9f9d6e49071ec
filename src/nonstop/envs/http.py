"""Episodes over HTTP: any served engine (`nonstop serve`) as the engine of an episode's turns.

`ClientEngine(client)` makes a `serve.client.GenerationClient` (`HttpClient` against
`nonstop serve`, or `InProcessClient`) a `TurnEngine`: each turn goes out as an OpenAI-style
`/v1/completions` request whose prompt is the role's token ids, and comes back with the server's
`nonstop` extension: the sampled token ids, behaviour logprobs and policy versions (serve/protocol.py).
So an agent loop running against the server yields trainable episodes (`run_episode`) with the
same per-token metadata as one running against the engines directly, and nothing is retokenised:
the ids the server sampled are the ids the episode keeps.
"""

from __future__ import annotations

import asyncio

from nonstop.serve.client import GenerationClient
from nonstop.types import GenerationRequest, Sample


class ClientEngine:
    def __init__(self, client: GenerationClient) -> None:
        self.client = client

    async def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        return list(await asyncio.gather(*(self.client.complete(r.prompt_ids, r.params, r.n) for r in requests)))
