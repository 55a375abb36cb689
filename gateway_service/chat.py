"""Chat messages → one prompt string, with the checkpoint's own chat template.

The template is the Jinja `chat_template` of the checkpoint's `tokenizer_config.json`, as
Hugging Face tokenizers apply it (`messages`, `add_generation_prompt`, the special tokens,
`raise_exception`), rendered in Jinja's sandbox. A checkpoint without one (the embedded
demo model) gets PLAIN_TEMPLATE: "role: content" lines and an open assistant turn.
"""

from __future__ import annotations

import json
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

PLAIN_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
ROLES = ("system", "user", "assistant", "tool", "developer")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (the template refused them, or a message is malformed)."""


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _special_token(config: dict, name: str) -> str:
    token = config.get(name)
    if isinstance(token, dict):  # {"content": "<s>", ...}
        token = token.get("content")
    return token or ""


class ChatTemplate:
    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = _raise_exception
        self.source = source
        self._template = environment.from_string(source)
        self._tokens = {"bos_token": bos_token, "eos_token": eos_token}

    @classmethod
    def for_checkpoint(cls, model_dir: str | Path) -> ChatTemplate:
        path = Path(model_dir) / "tokenizer_config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: take "default"
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        return cls(source or PLAIN_TEMPLATE, bos_token=_special_token(config, "bos_token"),
                   eos_token=_special_token(config, "eos_token"))

    def render(self, messages: list[dict]) -> str:
        """The prompt for `messages` (each {"role", "content"}), ending in an open assistant turn."""
        for index, message in enumerate(messages):
            if message.get("role") not in ROLES:
                raise ChatTemplateError(f"messages[{index}].role {message.get('role')!r} must be one of {', '.join(ROLES)}")
            if not isinstance(message.get("content"), str):
                raise ChatTemplateError(f"messages[{index}].content must be a string (text parts are joined)")
        try:
            return self._template.render(messages=messages, add_generation_prompt=True, **self._tokens)
        except ChatTemplateError:
            raise
        except TemplateError as error:
            raise ChatTemplateError(f"the chat template failed: {error}") from None
