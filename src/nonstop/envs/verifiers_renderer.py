"""A `renderers` renderer for tokenizers without a chat template (nonstop's tiny models).

verifiers' `TrainClient` renders every model call's messages to token ids with a renderer. This
one makes each message its text's ids: the first as `Codec.encode` makes them (special tokens
included), later ones without special tokens; an assistant turn's ids are what the engine sampled,
ending with the stop token. `bridge_to_next_turn` keeps the previous prompt and completion ids
verbatim and appends only the new messages' ids, so a multi-turn episode's ids are exactly those
`orchestrator/episodes.py` would make. Needs the verifiers extra (it brings `renderers`).
"""

from __future__ import annotations

from typing import Any

from renderers.base import ParsedResponse, RenderedTokens
from renderers.configs import BaseRendererConfig, CustomRendererConfig


class TokenRendererConfig(BaseRendererConfig):
    """TokenRenderer has no options (its config only names it)."""


class TokenRenderer:
    """A `renderers.Renderer` for a tokenizer without a chat template: messages are plain text."""

    config_class = TokenRendererConfig
    is_prefix_stable = True
    supports_tools = False

    def __init__(self, tokenizer: Any, config: TokenRendererConfig | None = None) -> None:
        self.tokenizer, self.config = tokenizer, config or TokenRendererConfig()

    def _ids(self, message: dict, first: bool) -> list[int]:
        """A wire message's ids: the first as `Codec.encode` makes them, later ones without special
        tokens; an assistant turn ends with the stop token the engine sampled."""
        content = message.get("content") or ""
        text = (
            content
            if isinstance(content, str)
            else "\n".join(p.get("text", "") for p in content if p.get("type") == "text")
        )
        if message.get("role") == "assistant":
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + self.get_stop_token_ids()
        if not text:
            return []
        ids = (
            self.tokenizer(text)["input_ids"] if first else self.tokenizer(text, add_special_tokens=False)["input_ids"]
        )
        return list(ids)

    def render(
        self, messages: list[dict], *, tools: list | None = None, add_generation_prompt: bool = False, **_: Any
    ) -> RenderedTokens:
        ids: list[int] = []
        indices: list[int] = []
        sampled: list[bool] = []
        for i, m in enumerate(messages):
            piece = self._ids(m, first=i == 0)
            ids += piece
            indices += [i] * len(piece)
            sampled += [m.get("role") == "assistant"] * len(piece)
        return RenderedTokens(
            token_ids=ids,
            message_indices=indices,
            sampled_mask=sampled,
            is_content=[True] * len(ids),
            message_roles=[m.get("role") or "" for m in messages],
            message_tool_names=[None] * len(messages),
        )

    def render_ids(
        self, messages: list[dict], *, tools: list | None = None, add_generation_prompt: bool = False, **_: Any
    ) -> list[int]:
        return self.render(messages).token_ids

    def bridge_to_next_turn(
        self,
        previous_prompt_ids: list[int],
        previous_completion_ids: list[int],
        new_messages: list[dict],
        *,
        tools: list | None = None,
        **_: Any,
    ) -> RenderedTokens | None:
        """The previous ids verbatim, then the new messages' ids (none of them an assistant turn)."""
        if any(m.get("role") == "assistant" for m in new_messages):
            return None
        prior = list(previous_prompt_ids) + list(previous_completion_ids)
        ids, indices = list(prior), [-1] * len(prior)
        for i, m in enumerate(new_messages):
            piece = self._ids(m, first=False)
            ids += piece
            indices += [i] * len(piece)
        new = len(ids) - len(prior)
        return RenderedTokens(
            token_ids=ids,
            message_indices=indices,
            sampled_mask=[False] * len(ids),
            is_content=[False] * len(prior) + [True] * new,
            message_roles=[m.get("role") or "" for m in new_messages],
            message_tool_names=[None] * len(new_messages),
        )

    def parse_response(
        self, token_ids: list[int], *, tools: list | None = None, prompt_ids: list[int] | None = None
    ) -> ParsedResponse:
        return ParsedResponse(content=self.tokenizer.decode(token_ids, skip_special_tokens=True), tool_calls=[])

    def get_stop_token_ids(self) -> list[int]:
        return [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []


def renderer_config() -> CustomRendererConfig:
    return CustomRendererConfig(import_path=f"{__name__}.TokenRenderer")
