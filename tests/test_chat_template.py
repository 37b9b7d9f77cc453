"""prep --chat-template: a model whose GGUF has no chat template (Gemma 3 270M has none) gets
one by name (llama.cpp's built-in templates, as llama-server takes them) or from a Jinja file;
without it, a chat request says which option is missing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from prep_service.chat import (
    BuiltinTemplate,
    ChatTemplate,
    TemplateMessage,
    builtin_template_names,
)
from prep_service.preparer import Message, Preparer, UnsupportedError
from slotwise_core.tiny_models import CHAT_TEMPLATE, TinyPair

CHAT = [Message("system", ["Be brief."]), Message("user", ["hi"]), Message("assistant", ["yo"]),
        Message("user", ["and?"])]  # fmt: skip


@pytest.fixture(scope="module")
def untemplated(tiny: dict[str, TinyPair], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The rope pair's text model with its chat template removed."""
    out = tmp_path_factory.mktemp("untemplated") / "model.gguf"
    subprocess.run(
        [sys.executable, "-m", "gguf.scripts.gguf_new_metadata", "--remove-metadata",
         "tokenizer.chat_template", "--force", str(tiny["rope"].model), str(out)],
        check=True, capture_output=True,
    )  # fmt: skip
    return out


def test_a_model_without_a_template_names_the_option(untemplated: Path) -> None:
    p = Preparer(untemplated)
    try:
        assert not p.info.has_chat_template
        with pytest.raises(UnsupportedError, match="--chat-template"):
            p.prepare(CHAT)
    finally:
        p.close()


def test_a_builtin_name_renders_as_llama_cpp_does(tiny: dict[str, TinyPair], untemplated) -> None:
    own = Preparer(tiny["rope"].model)  # its own template is ChatML
    named = Preparer(untemplated, chat_template="chatml")
    try:
        (a, text_a), (b, text_b) = own.prepare(CHAT), named.prepare(CHAT)
        assert text_b == text_a
        assert [c.token_ids for c in b.chunks] == [c.token_ids for c in a.chunks]
        assert [c.message_index for c in b.chunks] == [c.message_index for c in a.chunks]
    finally:
        own.close()
        named.close()
    gemma = BuiltinTemplate("gemma").pieces([TemplateMessage("user", "hi")])
    assert gemma == (["<start_of_turn>user\nhi<end_of_turn>\n", "<start_of_turn>model\n"], [0])


def test_a_jinja_file_and_an_unknown_name(untemplated: Path, tmp_path: Path) -> None:
    path = tmp_path / "chatml.jinja"
    path.write_text(CHAT_TEMPLATE)
    p = Preparer(untemplated, chat_template=str(path))
    try:
        _, text = p.prepare(CHAT)
        assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    finally:
        p.close()
    assert {"chatml", "gemma", "llama3"} <= set(builtin_template_names())
    with pytest.raises(ValueError, match="unknown chat template 'no-such'"):
        Preparer(untemplated, chat_template="no-such")


def test_a_system_message_folded_into_the_first_turn_is_its_own_piece() -> None:
    """Gemma renders the system message inside the first user turn: it is still a piece of
    its own (so `keep` can pin it and the pool share it), and the turns read as before."""
    gemma = BuiltinTemplate("gemma")
    turns = [TemplateMessage("system", "Be brief."), TemplateMessage("user", "hi")]
    pieces, holders = gemma.pieces(turns)
    assert pieces == [
        "<start_of_turn>user\nBe brief.\n\n", "hi<end_of_turn>\n", "<start_of_turn>model\n"
    ]  # fmt: skip
    assert holders == [0, 1]
    assert "".join(pieces) == gemma.render(turns, add_generation_prompt=True)
    # the fold is checked, not guessed: a user turn that repeats the system text, a system
    # text the template trims, a system message it drops (no user turn to fold it into)
    for system, user, first in (
        ("hi", "hi", "<start_of_turn>user\nhi\n\n"),
        ("  Be brief. ", "Be brief. please", "<start_of_turn>user\nBe brief.\n\n"),
    ):
        folded = [TemplateMessage("system", system), TemplateMessage("user", user)]
        pieces, _ = gemma.pieces(folded)
        assert pieces[0] == first and pieces[1].startswith(user)
        assert "".join(pieces) == gemma.render(folded, add_generation_prompt=True)
    dropped = [TemplateMessage("system", "OK"), TemplateMessage("assistant", "OK, sure")]
    assert gemma.pieces(dropped)[0][0] == ""
    # a template that gives the system message a turn of its own is left as it was
    chatml = BuiltinTemplate("chatml").pieces(turns)[0]
    assert chatml[:2] == [
        "<|im_start|>system\nBe brief.<|im_end|>\n",
        "<|im_start|>user\nhi<|im_end|>\n",
    ]


# Gemma 3's own template (its GGUF's), in short: BOS first, the system text trimmed into the
# first user turn
GEMMA3 = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] | trim + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<start_of_turn>model\n{%- endif -%}"
)


def test_gemma_3_s_own_template_gives_the_system_message_its_text_after_bos() -> None:
    t = ChatTemplate(GEMMA3, bos_token="<bos>", eos_token="<eos>")
    turns = [TemplateMessage("system", "Be brief."), TemplateMessage("user", "hi")]
    pieces, _ = t.pieces(turns)
    assert pieces[:2] == ["<bos><start_of_turn>user\nBe brief.\n\n", "hi<end_of_turn>\n"]
    assert "".join(pieces) == t.render(turns, add_generation_prompt=True)


def test_a_folded_system_message_is_pinned_alike_whatever_follows(untemplated: Path) -> None:
    p = Preparer(untemplated, chat_template="gemma")
    try:
        chats = [p.prepare([Message("system", ["Be brief."]), Message("user", [q])])[0]
                 for q in ("hi", "what is this?")]  # fmt: skip
        system = [[c for c in chat.chunks if c.message_index == 0] for chat in chats]
        assert system[0] and system[0] == system[1]
    finally:
        p.close()
