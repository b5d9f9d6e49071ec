"""Chat rows: checked, rendered through the model's real chat template, stopped at its end of turn,
and held-out completions scored by the task's reward (SmolLM2-135M-Instruct's tokenizer)."""

from __future__ import annotations

import asyncio
import json

import pytest
from transformers import AutoTokenizer

from nonstop.api import read_rows
from nonstop.hf import stop_token_ids
from nonstop.models.tiny import make_char_tokenizer
from nonstop.scoring.rewards import exact_match, last_number, resolve_reward
from nonstop.tasks.chat import render_chat
from nonstop.tasks.codec import Codec, HeldOut
from nonstop.tasks.data import DatasetError, DatasetReport, check_row, read_jsonl, split_examples
from nonstop.types import Sample

QUESTION = [{"role": "user", "content": "What is 7 * 8?"}]


@pytest.fixture(scope="module")
def smol_tok(smollm2_dir):
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def test_rows_take_messages_or_a_conversational_prompt_and_keep_their_other_columns():
    prompt, answer, extra = check_row({"messages": QUESTION, "answer": "56", "op": "*"})
    assert prompt == tuple(QUESTION) and answer == "56" and extra == {"op": "*"}
    prompt, answer = check_row({"prompt": QUESTION, "answer": "56"})
    assert prompt == tuple(QUESTION)
    assert check_row({"messages": [{"role": "user"}], "answer": "1"}) == (
        "'messages': message 0 must be an object with string 'role' and 'content', got \"{'role': 'user'}\""
    )
    assert check_row({"messages": [], "answer": "1"}).startswith("'messages': chat messages must be a non-empty list")
    assert check_row({"prompt": 3, "answer": "1"}) == (
        "'prompt' and 'answer' must be strings (or 'prompt' a list of chat messages)"
    )
    assert check_row({"messages": QUESTION}) == "missing field(s) answer"


def test_rendered_prompts_encode_to_the_templates_own_ids(smol_tok, tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [
        {"messages": QUESTION, "answer": "56"},
        {"prompt": [{"role": "system", "content": "Be brief."}, *QUESTION], "answer": "56"},
        {"prompt": "2+2=", "answer": "4"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs, report = read_jsonl(path)
    data = split_examples(pairs, 1, 0, report)
    assert render_chat(data, smol_tok, "Answer with a number.", False, "skip") == []
    by_answer = {ex.index: ex for ex in data.train + data.eval}
    chat, own_system, plain = by_answer[0], by_answer[1], by_answer[2]
    assert chat.prompt.startswith("<|im_start|>system\nAnswer with a number.<|im_end|>")
    assert chat.prompt.endswith("<|im_start|>user\nWhat is 7 * 8?<|im_end|>\n<|im_start|>assistant\n")
    assert "Be brief." in own_system.prompt and "Answer with a number." not in own_system.prompt
    assert plain.prompt == "2+2="  # a string prompt reaches the model as it is unless task.chat_strings
    want = smol_tok.apply_chat_template(
        [{"role": "system", "content": "Answer with a number."}, *QUESTION], add_generation_prompt=True
    )
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert Codec(smol_tok).encode(chat.prompt) == list(want)


def test_chat_strings_and_system_prompt_rules(smol_tok):
    pairs = [("What is 1 + 1?", "2"), ("What is 2 + 2?", "4")]
    data = split_examples(list(pairs), 1, 0, DatasetReport())
    with pytest.raises(DatasetError, match="task.system_prompt is set but no row is a chat row"):
        render_chat(data, smol_tok, "sys", False, "skip")
    render_chat(data, smol_tok, None, True, "skip")
    assert all(ex.prompt.endswith("<|im_start|>assistant\n") for ex in data.train + data.eval)


def test_a_tokenizer_without_a_template_is_an_error_naming_the_row():
    data = split_examples([(tuple(QUESTION), "56"), (tuple(QUESTION), "56")], 1, 0, DatasetReport())
    with pytest.raises(
        DatasetError, match=r"row #\d gives chat messages, but the model's tokenizer has no chat template"
    ):
        render_chat(data, make_char_tokenizer(), None, False, "skip")


def test_a_role_the_template_refuses_is_a_bad_row_named_by_index(smol_tok):
    tok = make_char_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant', 'system'] %}"
        "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}A:{% endif %}"
    )
    rows = [(tuple(QUESTION), "56"), (({"role": "robot", "content": "beep"},), "1"), (tuple(QUESTION), "56")]
    data = split_examples(rows, 1, 0, DatasetReport())
    problems = render_chat(data, tok, None, False, "skip")
    assert len(problems) == 1 and problems[0].startswith("row #1: the chat template refused its messages")
    assert "unknown role robot" in problems[0] and data.report.rows_skipped == 1
    data = split_examples(rows, 1, 0, DatasetReport())
    with pytest.raises(DatasetError, match=r"1 chat row\(s\) refused \(task.on_bad_row=error\):\n  row #1"):
        render_chat(data, tok, None, False, "error")


def test_python_rows_keep_messages_and_every_column():
    pairs, _ = read_rows(
        [{"messages": QUESTION, "answer": "56", "op": "*"}], {"prompt": "prompt", "answer": "answer"}, "dataset"
    )
    assert pairs == [(tuple(QUESTION), "56", {"op": "*"})]
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([{"prompt": QUESTION, "solution": "56", "level": 2}])
    pairs, _ = read_rows(ds, {"prompt": "prompt", "answer": "solution"}, "dataset")
    # the column mapped to answer stays under its own name too (a TRL reward may read it)
    assert pairs == [(tuple(QUESTION), "56", {"solution": "56", "level": 2})]


def test_the_engine_stops_at_the_templates_end_of_turn(smol_tok, smollm2_dir):
    assert smol_tok.convert_ids_to_tokens(stop_token_ids(smol_tok, smollm2_dir)) == ["<|im_end|>"]
    assert stop_token_ids(make_char_tokenizer()) == [make_char_tokenizer().eos_token_id]  # no template: EOS only


def test_last_number_reads_the_answer_as_users_do():
    assert last_number("7 * 8 = 56.", "56") == 1.0
    assert last_number("2 * 9 = 18\n\nThis is a classic example", "18") == 1.0
    assert last_number("The answer is 1,024", "1024") == 1.0
    assert last_number("56 is wrong, it is 54", "56") == 0.0
    assert last_number("no number here", "3") == 0.0
    assert last_number("-5", "-5") == 1.0 and last_number("3.0", "3") == 1.0
    assert last_number("so #### 12", "worked... #### 12") == 1.0
    assert resolve_reward("last_number") is last_number


def test_held_out_completions_are_scored_by_the_tasks_reward(smol_tok):
    codec = Codec(smol_tok)
    data = split_examples([(tuple(QUESTION), "56"), (tuple(QUESTION), "56")], 1, 0, DatasetReport())
    examples = data.train + data.eval

    def sample(text: str) -> Sample:
        ids = codec.encode(text)
        return Sample([1], ids, [0.0] * len(ids), [0] * len(ids), "stop")

    results = [[sample("7 * 8 = 56.")], [sample("I think it is 54.")]]
    assert asyncio.run(HeldOut(last_number, "last_number").score(results, examples, codec)) == 0.5
    assert asyncio.run(HeldOut(exact_match, "exact_match").score(results, examples, codec)) == 0.0
    k2 = [[sample("56"), sample("54")], [sample("56"), sample("56")]]  # mean@2: 3 of 4 completions right
    assert asyncio.run(HeldOut(last_number, "last_number", samples=2).score(k2, examples, codec)) == 0.75

    def broken(completion: str, answer: str) -> float:
        raise RuntimeError("judge down")

    failing = HeldOut(broken, "broken")
    assert asyncio.run(failing.score(results, examples, codec)) == 0.0 and failing.failures == 2
