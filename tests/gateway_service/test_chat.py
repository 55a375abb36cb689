"""Chat templates: the checkpoint's own Jinja template renders as Hugging Face renders it."""

import json
import shutil

import pytest

from gateway_service.chat import PLAIN_TEMPLATE, ChatTemplate, ChatTemplateError
from shared.model.registry import resolve_model

CHATML = (  # the shape of Qwen's template: ChatML turns, a default system turn, raise_exception
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Write fibonacci."}, {"role": "assistant", "content": "def fib(n):"},
            {"role": "user", "content": "Now iteratively."}]


@pytest.fixture
def checkpoint(tmp_path):
    source = resolve_model(None)
    shutil.copy(source / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = CHATML
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_checkpoint_template_renders_as_transformers_renders_it(checkpoint):
    from transformers import AutoTokenizer

    expected = AutoTokenizer.from_pretrained(checkpoint).apply_chat_template(MESSAGES, tokenize=False,
                                                                              add_generation_prompt=True)
    assert ChatTemplate.for_checkpoint(checkpoint).render(MESSAGES) == expected
    assert expected.startswith("<|im_start|>system\nYou are helpful.") and expected.endswith("<|im_start|>assistant\n")


def test_without_a_template_the_plain_one_is_used_and_bad_messages_are_refused(checkpoint):
    plain = ChatTemplate.for_checkpoint(resolve_model(None))
    assert plain.source == PLAIN_TEMPLATE
    assert plain.render(MESSAGES[:1]) == "user: Write fibonacci.\nassistant:"
    with pytest.raises(ChatTemplateError, match=r"messages\[0\].role 'robot'"):
        plain.render([{"role": "robot", "content": "hi"}])
    with pytest.raises(ChatTemplateError, match="bad role"):  # the template's own raise_exception
        ChatTemplate.for_checkpoint(checkpoint).render([{"role": "tool", "content": "42"}])
