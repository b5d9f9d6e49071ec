"""The built-in character tokenizer encodes the same in memory, after a round trip through a
model folder (config.json beside it, as `serve` and users load it), and in the shipped bases."""

import string

import pytest

from nonstop.config import load_config
from nonstop.hf import load_tokenizer
from nonstop.models.shipped import shipped_dir
from nonstop.models.tiny import make_char_tokenizer
from nonstop.serve.server import DEFAULT_CHAT_TEMPLATE
from nonstop.tasks.data import load_task

CHAR_ID = {c: 3 + i for i, c in enumerate(c for c in string.printable if c.isprintable())} | {"\n": 98, "\t": 99}
"""The layout the shipped bases were trained with: <pad>, <bos>, <eos>, then printable ASCII."""


def test_spaces_and_newlines_survive_a_round_trip_through_a_model_folder(tiny_dir):
    text = "07 + 45 =\nx\ty"
    memory, folder = make_char_tokenizer(), load_tokenizer(str(tiny_dir))
    assert (tiny_dir / "config.json").exists()  # the case that used to rebuild the tokenizer without spaces
    assert memory(text)["input_ids"] == folder(text)["input_ids"] == [CHAR_ID[c] for c in text]
    assert folder.decode(folder(text)["input_ids"], skip_special_tokens=True) == text
    assert folder("07 + 45 =")["input_ids"] != folder("07+45=")["input_ids"]
    ids = folder.apply_chat_template(
        [{"role": "user", "content": "07 + 45 ="}],
        add_generation_prompt=True,
        tokenize=True,
        chat_template=DEFAULT_CHAT_TEMPLATE,
    )
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert folder.decode(ids) == "user: 07 + 45 =\nassistant: "
    assert (folder.pad_token_id, folder.bos_token_id, folder.eos_token_id, len(folder)) == (0, 1, 2, 128)


@pytest.mark.parametrize("kind", ["builtin", "builtin_weak"])
def test_shipped_bases_encode_the_default_job_as_the_character_map_they_were_trained_on(kind):
    tok = load_tokenizer(str(shipped_dir(kind)))
    data = load_task(load_config(None, ()).task)
    for ex in data.train[:2000] + data.eval:
        assert tok(ex.prompt)["input_ids"] == [CHAR_ID[c] for c in ex.prompt], ex.prompt
        assert tok(ex.answer)["input_ids"] == [CHAR_ID[c] for c in ex.answer], ex.answer
