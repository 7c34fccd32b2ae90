"""Chat templates for sources that carry none, and `--chat-template`.

A GGUF file need not carry `tokenizer.chat_template` (the Gemma-3-270M Q4_K_M file does not), and
llama.cpp then falls back to ChatML, which a Gemma model was never trained on. The turn markers in
the vocabulary tell which format a model was trained on; the few formats below cover the families
that put them there. Each is written for string contents, the only kind `chat` and the API send;
BOS is not rendered (`bos_token` is empty at render time: the runtime adds BOS itself, `add_bos`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from edge_sd.errors import UsageError

# The Gemma format: a system message becomes the start of the first user turn; roles alternate;
# the assistant's role is called "model".
GEMMA = """\
{%- set ns = namespace(prefix="", first=0) -%}
{%- if messages and messages[0]['role'] == 'system' -%}
{%- set ns.prefix = messages[0]['content'] + '\n\n' -%}
{%- set ns.first = 1 -%}
{%- endif -%}
{%- for message in messages[ns.first:] -%}
{%- if (message['role'] == 'user') != (loop.index0 is even) -%}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif -%}
{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}
{{- (ns.prefix if loop.first else '') + (message['content'] | trim) + '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}
"""

# ChatML (Qwen, SmolLM and others): every message in its own block, roles as given.
CHATML = """\
{%- for message in messages -%}
{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}
"""

# Llama 3: a header per message, contents trimmed.
LLAMA3 = """\
{%- for message in messages -%}
{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + (message['content'] | trim) + '<|eot_id|>' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif -%}
"""

# name -> (template, the tokens whose presence in a vocabulary says the model was trained on it)
BUILTIN: dict[str, tuple[str, tuple[str, ...]]] = {
    "gemma": (GEMMA, ("<start_of_turn>", "<end_of_turn>")),
    "chatml": (CHATML, ("<|im_start|>", "<|im_end|>")),
    "llama3": (LLAMA3, ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
}


def check(option: str | None, flag: str = "--chat-template") -> None:
    """Refuse a `--chat-template` that is neither a built-in name nor a readable file."""
    if option is not None and option not in BUILTIN and not Path(option).is_file():
        raise UsageError(f"{flag} {option}: not a file, nor one of {', '.join(BUILTIN)}")


def from_option(option: str) -> str:
    """The template `--chat-template` names: a built-in one, or a file of jinja2 text."""
    check(option)
    if option in BUILTIN:
        return BUILTIN[option][0]
    try:
        return Path(option).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--chat-template {option}: cannot read it ({e})") from None


def guess(has_token: Callable[[str], bool]) -> str | None:
    """The built-in format whose turn markers are all in the vocabulary (`has_token`), if exactly one."""
    found = [name for name, (_, markers) in BUILTIN.items() if all(has_token(t) for t in markers)]
    return found[0] if len(found) == 1 else None
