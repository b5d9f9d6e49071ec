import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nonstop.config import TaskConfig
from nonstop.models.tiny import VOCAB_SIZE, make_char_tokenizer
from nonstop.tasks.data import DatasetError, PromptStream, addition_examples, load_task, read_jsonl, screen_prompts


def test_char_tokenizer_round_trips_text_with_spaces():
    tok = make_char_tokenizer()
    text = "Q: 07 + 45 = ?"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text) and len(tok) == VOCAB_SIZE
    assert tok.decode(ids) == text
    assert tok.decode([*ids, tok.eos_token_id], skip_special_tokens=True) == text


def test_saved_tiny_model_loads_through_the_auto_classes(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert model.config.model_type == "qwen2" and model.config.vocab_size == VOCAB_SIZE
    assert (tiny_dir / "model.safetensors").is_file()
    assert tok("07+45=")["input_ids"] == make_char_tokenizer()("07+45=")["input_ids"]
    out = model(torch.tensor([tok("1+1=")["input_ids"]]))
    assert out.logits.shape == (1, 4, VOCAB_SIZE)


def test_addition_splits_are_disjoint_and_zero_padded():
    data = load_task(TaskConfig(max_operand=99, eval_size=500), seed=0)
    assert len(data.eval) == 500 and len(data.train) == 100 * 100 - 500
    assert not {e.prompt for e in data.eval} & {e.prompt for e in data.train}
    assert all(len(e.prompt) == 6 for e in data.train)
    assert ("07+45=", "52") in addition_examples(99)
    assert ("07+45=", "052") in addition_examples(99, pad_answer=True)
    assert {len(a) for _, a in addition_examples(99, pad_answer=True)} == {3}


def test_jsonl_rows_without_answer_are_reported_and_skipped(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2="}, "not an object", {"prompt": "3+3=", "answer": 6}]
    path.write_text(
        "\n".join(json.dumps(r) for r in rows) + "\n{broken\n" + json.dumps({"prompt": "4+4=", "answer": "8"})
    )
    pairs, report = read_jsonl(path)
    assert pairs == [("1+1=", "2"), ("4+4=", "8")]
    assert report.rows_read == 6 and report.rows_skipped == 4
    assert any(":2: missing field(s) answer" in p for p in report.problems)
    assert any(":5: not valid JSON" in p for p in report.problems)


def test_jsonl_without_valid_rows_is_an_error(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(DatasetError, match="no valid row"):
        read_jsonl(path)
    with pytest.raises(DatasetError, match="not found"):
        read_jsonl(tmp_path / "missing.jsonl")


def test_prompt_stream_visits_each_prompt_once_per_epoch():
    data = load_task(TaskConfig(max_operand=9, eval_size=10), seed=1)
    stream = PromptStream(data.train, seed=3)
    first = [stream.next().example.index for _ in range(len(data.train))]
    second = [stream.next() for _ in range(len(data.train))]
    assert sorted(first) == sorted(d.example.index for d in second) == sorted(e.index for e in data.train)
    assert first != [d.example.index for d in second] and stream.epoch == 1
    assert {d.epoch for d in second} == {1}


def test_prompt_stream_state_continues_the_same_order_and_requeues_first():
    data = load_task(TaskConfig(max_operand=9, eval_size=10), seed=1)
    reference = PromptStream(data.train, seed=5)
    expected = [(d.epoch, d.example.index) for d in (reference.next() for _ in range(200))]

    stream = PromptStream(data.train, seed=5)
    head = [stream.next() for _ in range(77)]
    state = json.loads(json.dumps(stream.state_dict()))  # checkpoints hold it as JSON
    resumed = PromptStream(data.train, seed=5)
    resumed.load_state_dict(state)
    resumed.requeue(head[70:])  # in flight at the checkpoint: drawn again first, in draw order
    tail = [resumed.next() for _ in range(200 - 70)]
    assert [(d.epoch, d.example.index) for d in head[:70] + tail] == expected


def test_prompt_stream_stops_after_max_epochs():
    data = load_task(TaskConfig(max_operand=9, eval_size=10), seed=1)
    stream = PromptStream(data.train, seed=0, max_epochs=2)
    draws = [stream.next() for _ in range(2 * len(data.train))]
    assert all(d is not None for d in draws)
    assert stream.next() is None and stream.next() is None


def test_over_long_prompts_are_reported_by_index_and_skipped_or_rejected(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"prompt": "1+1=", "answer": "2"}] * 6 + [{"prompt": "9" * 40 + "+1=", "answer": "x"}] * 2
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = TaskConfig(name="jsonl", dataset_path=str(path), eval_size=1)
    data = load_task(cfg, seed=0)
    long_ids = sorted(ex.index for ex in data.train + data.eval if len(ex.prompt) > 10)
    problems = screen_prompts(data, list, 16, "skip")  # one token per character
    assert len(problems) == 2 and all("over the limit of 16" in p for p in problems)
    assert [f"#{i} " in " ".join(problems) for i in long_ids] == [True, True]
    assert all(len(ex.prompt) <= 16 for ex in data.train + data.eval)
    assert data.report.rows_skipped == 2
    with pytest.raises(DatasetError, match=r"2 over-long prompt\(s\) \(task.on_bad_row=error\)"):
        screen_prompts(load_task(cfg, seed=0), list, 16, "error")


def test_bad_rows_can_stop_the_run_before_training(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n{"prompt": "3+3=", "answer": "6"}\n')
    cfg = TaskConfig(name="jsonl", dataset_path=str(path), eval_size=1, on_bad_row="error")
    with pytest.raises(DatasetError, match=r"1 bad row\(s\)(.|\n)*d.jsonl:2: missing field\(s\) answer"):
        load_task(cfg, seed=0)
