"""A generative judge: an OpenAI-compatible /v1/completions endpoint reads each sample and answers.

For every sample the judge gets `template` filled with {prompt}, {completion} and {answer}
(greedy decoding, at most `max_tokens`); the first match of `pattern` in its text is the score
(the pattern's group 1 if it has one). All samples of a group are asked at once. A verdict
that does not match is 'unparsed' (or scores `missing_score` when that is set); a server error
is 'http_error' and an unreachable or slow server 'unreachable' / 'timeout', both retried by
the stage. Any server speaking the OpenAI completions API works, `nonstop serve` included.
"""

from __future__ import annotations

import asyncio
import re

import aiohttp

from nonstop.config.scoring import JudgeConfig
from nonstop.scoring.base import Contribution
from nonstop.scoring.pool import CallFailed
from nonstop.types import Group


def parse_verdict(text: str, pattern: re.Pattern[str]) -> float | None:
    m = pattern.search(text)
    if m is None:
        return None
    try:
        return float(m.group(1) if pattern.groups else m.group(0))
    except ValueError:
        return None


class JudgeComponent:
    name = "judge"
    retryable = frozenset({"timeout", "http_error", "unreachable"})

    def __init__(self, cfg: JudgeConfig, timeout_s: float) -> None:
        self.cfg, self.timeout_s = cfg, timeout_s
        self.pattern = re.compile(cfg.pattern)
        self.url = cfg.url.rstrip("/") + "/v1/completions"
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))

    async def _ask(self, prompt: str) -> str:
        assert self.session is not None, "JudgeComponent.start() was not called"
        body = {"model": self.cfg.model, "prompt": prompt, "max_tokens": self.cfg.max_tokens, "temperature": 0.0}
        try:
            async with self.session.post(self.url, json=body) as r:
                reply = await r.json(content_type=None)
                if r.status != 200:
                    raise CallFailed("http_error", f"judge {self.url}: HTTP {r.status}: {reply}")
        except (TimeoutError, asyncio.TimeoutError):
            raise CallFailed("timeout", f"judge {self.url} did not answer within {self.timeout_s:g} s") from None
        except aiohttp.ClientError as e:
            raise CallFailed("unreachable", f"judge {self.url}: {type(e).__name__}: {e}") from None
        return str(reply["choices"][0]["text"])

    async def contribute(self, group: Group) -> Contribution:
        prompts = [
            self.cfg.template.format(prompt=group.prompt, completion=s.text, answer=group.answer) for s in group.samples
        ]
        texts = await asyncio.gather(*(self._ask(p) for p in prompts))
        scores = []
        for text in texts:
            score = parse_verdict(text, self.pattern)
            if score is None:
                if self.cfg.missing_score is None:
                    raise CallFailed("unparsed", f"judge verdict {text!r} does not match {self.cfg.pattern!r}")
                score = self.cfg.missing_score
            scores.append(self.cfg.weight * score)
        return Contribution(rewards=scores)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
