"""A `renderers` renderer for tokenizers without a chat template (nonstop's tiny models).

verifiers' `TrainClient` renders every model call's messages to token ids with a renderer. This
one makes each message its text's ids: the first as `Codec.encode` makes them (special tokens
included), later ones without special tokens; an assistant turn's ids are what the engine sampled,
ending with the stop token. `bridge_to_next_turn` keeps the previous prompt and completion ids
verbatim and appends only the new messages' ids, so a multi-turn episode's ids are exactly those
`orchestrator/episodes.py` would make. Needs the verifiers extra (it brings `renderers`).

Tools: the tools a request offers are not written into the prompt (a tiny model learns its tools
from its warm-up, not from a description). A reply is parsed for a tool call in the plain-text
syntax of envs/tool_calls.py (`@calc 23*7`), and an assistant message with tool calls renders
as that text; a tool result renders as its text in square brackets (`[161]`), so the model can
tell it from the user's text.
"""

from __future__ import annotations

from typing import Any

from renderers.base import ParsedResponse, ParsedToolCall, RenderedTokens, ToolCallParseStatus
from renderers.configs import BaseRendererConfig, CustomRendererConfig

from nonstop.envs.tool_calls import format_call, parse_reply

TOOL_OPEN, TOOL_CLOSE = "[", "]"
"""How a tool result is written into the sequence: its text between these."""


class TokenRendererConfig(BaseRendererConfig):
    """TokenRenderer has no options (its config only names it)."""


class TokenRenderer:
    """A `renderers.Renderer` for a tokenizer without a chat template: messages are plain text."""

    config_class = TokenRendererConfig
    is_prefix_stable = True
    supports_tools = True

    def __init__(self, tokenizer: Any, config: TokenRendererConfig | None = None) -> None:
        self.tokenizer, self.config = tokenizer, config or TokenRendererConfig()

    def _ids(self, message: dict, first: bool, tools: list | None = None) -> list[int]:
        """A wire message's ids: the first as `Codec.encode` makes them, later ones without special
        tokens; an assistant turn ends with the stop token the engine sampled."""
        content = message.get("content") or ""
        text = (
            content
            if isinstance(content, str)
            else "\n".join(p.get("text", "") for p in content if p.get("type") == "text")
        )
        if message.get("role") == "assistant":
            calls = [
                format_call(c["function"]["name"], c["function"].get("arguments") or {}, tools)
                for c in message.get("tool_calls") or []
            ]
            text = "\n".join([text, *calls] if text else calls) if calls else text
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + self.get_stop_token_ids()
        if message.get("role") == "tool":
            text = f"{TOOL_OPEN}{text}{TOOL_CLOSE}"
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
            piece = self._ids(m, first=i == 0, tools=tools)
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
        return self.render(messages, tools=tools).token_ids

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
            piece = self._ids(m, first=False, tools=tools)
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
        """The reply's text, and its tool call when it is one (envs/tool_calls.py; only with `tools`)."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        if not tools:
            return ParsedResponse(content=text, tool_calls=[])
        reply = parse_reply(text, tools)
        return ParsedResponse(
            content=reply.content,
            tool_calls=[
                ParsedToolCall(raw=c.raw, name=c.name, arguments=c.arguments, status=ToolCallParseStatus(c.status))
                for c in reply.calls
            ],
        )

    def get_stop_token_ids(self) -> list[int]:
        return [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []


def renderer_config() -> CustomRendererConfig:
    return CustomRendererConfig(import_path=f"{__name__}.TokenRenderer")
