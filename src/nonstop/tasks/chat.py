"""Chat rows through the model's chat template, and the tokens that end an assistant turn.

A row that gives chat messages (`messages`, or TRL's conversational `prompt` list; tasks/data.py)
is rendered here, once the run's tokenizer is known and before any prompt is encoded: the
tokenizer's own chat template with the generation prompt, so the model sees exactly the text it
was tuned on and answers as the assistant. `task.system_prompt` is put first as a system message
in every chat row that does not start with one of its own; `task.chat_strings` renders plain
string prompts too, as one user message.

Encoding the rendered text must give the template's own token ids. A tokenizer that adds a BOS
token itself (Llama 3's) would double the one the template writes, so that leading BOS text is
taken off the rendered prompt and left to the tokenizer.

The engine stops at the template's end-of-turn token as at the generation config's EOS ids
(hf.stop_token_ids).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from nonstop.hf import has_template
from nonstop.tasks.data import DatasetError, Messages, TaskData


def with_system(messages: Messages, system_prompt: str | None) -> list[dict[str, str]]:
    out = [dict(m) for m in messages]
    if system_prompt is not None and (not out or out[0]["role"] != "system"):
        out.insert(0, {"role": "system", "content": system_prompt})
    return out


def _leading_bos(tokenizer: Any) -> str | None:
    """The BOS text the tokenizer adds by itself when encoding, or None when it adds none."""
    bos = getattr(tokenizer, "bos_token", None)
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if bos is None or bos_id is None:
        return None
    ids = tokenizer("x")["input_ids"]
    return bos if ids and ids[0] == bos_id else None


def renderer(tokenizer: Any, system_prompt: str | None) -> Callable[[Messages], str]:
    """Messages -> the prompt text the tokenizer encodes to the template's ids (generation prompt on)."""
    bos = _leading_bos(tokenizer)

    def render(messages: Messages) -> str:
        text = tokenizer.apply_chat_template(
            with_system(messages, system_prompt), tokenize=False, add_generation_prompt=True
        )
        if not isinstance(text, str):
            raise TypeError(f"the chat template returned {type(text).__name__}, not text")
        return text[len(bos) :] if bos is not None and text.startswith(bos) else text

    return render


def render_chat(
    data: TaskData, tokenizer: Any, system_prompt: str | None, chat_strings: bool, on_bad_row: str
) -> list[str]:
    """Render every chat row of `data` in place (and every string prompt with `chat_strings`);
    returns the problems of rows the template refused (skipped, or DatasetError with on_bad_row
    'error'). A tokenizer without a chat template and a chat row is a DatasetError naming the row."""
    examples = [ex for split in (data.train, data.eval) for ex in split]
    chat = [ex for ex in examples if ex.messages is not None or chat_strings]
    if not chat:
        if system_prompt is not None:
            raise DatasetError(
                "task.system_prompt is set but no row is a chat row: give rows as `messages` (or a `prompt` list "
                "of messages), or set task.chat_strings=true to render string prompts through the chat template"
            )
        return []
    if not has_template(tokenizer):
        first = chat[0]
        what = "gives chat messages" if first.messages is not None else "is rendered as chat (task.chat_strings)"
        raise DatasetError(
            f"row #{first.index} {what}, but the model's tokenizer has no chat template "
            "(tokenizer_config.json / chat_template.jinja); give plain string prompts for this model"
        )
    render = renderer(tokenizer, system_prompt)
    problems: list[str] = []
    for split in (data.train, data.eval):
        kept = []
        for ex in split:
            if ex.messages is None and not chat_strings:
                kept.append(ex)
                continue
            messages = ex.messages if ex.messages is not None else ({"role": "user", "content": ex.prompt},)
            try:
                kept.append(dataclasses.replace(ex, prompt=render(messages), messages=messages))
            except Exception as e:  # jinja's TemplateError (a role the template refuses) and the like
                problems.append(f"row #{ex.index}: the chat template refused its messages ({type(e).__name__}: {e})")
        split[:] = kept
    if problems and on_bad_row == "error":
        raise DatasetError(f"{len(problems)} chat row(s) refused (task.on_bad_row=error):\n  " + "\n  ".join(problems))
    if not data.train:
        raise DatasetError("no train row could be rendered through the chat template:\n  " + "\n  ".join(problems[:5]))
    data.report.rows_skipped += len(problems)
    data.report.problems.extend(problems)
    return problems
