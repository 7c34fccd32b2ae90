"""Chat templates for sources that carry none (export/chat_templates.py): each built-in format renders
as the template its model family ships, it is chosen by the turn markers in the vocabulary, and
`--chat-template` replaces whatever the source has."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jinja2
import pytest
from tokenizers import Tokenizer
from typer.testing import CliRunner

from edge_sd.errors import UsageError
from edge_sd.export import chat_templates
from edge_sd.export.hf import chat_template
from edge_sd.tools.cli import app
from edge_sd.tools.paths import cache_dir

# the npm tokenizer packages scripts/setup.sh installs, each with its family's own template
FAMILIES = {"gemma": "gemma3", "chatml": "qwen3", "llama3": "llama3"}

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there "}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Name three colors.\n"},
     {"role": "assistant", "content": "Red, green, blue."}, {"role": "user", "content": "And three animals?"}],
    [{"role": "user", "content": "a\n\nb"}, {"role": "assistant", "content": " c "}, {"role": "user", "content": "d"}],
]  # each ends with a user turn: Qwen3's template marks a last assistant turn as reasoning


def render(template: str, messages: list[dict], add_generation_prompt: bool) -> str:
    """As edge_sd.chat renders at run time (BOS is not rendered: the runtime adds it)."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(msg: str) -> None:
        raise ValueError(msg)

    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                            bos_token="", eos_token="")


def family(package: str) -> Path:
    folder = cache_dir() / "tokenizers" / package
    # Installed by scripts/setup.sh, which the test command runs first: missing means a broken set-up.
    assert (folder / "tokenizer_config.json").is_file(), f"{folder} missing: run scripts/setup.sh"
    return folder


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_builtin_formats_render_as_the_familys_own_template(name: str) -> None:
    own = json.loads((family(FAMILIES[name]) / "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"]
    builtin = chat_templates.BUILTIN[name][0]
    # the llama3 package's template adds the assistant's header even when not asked to
    for messages in CONVERSATIONS:
        for add in (True,) if name == "llama3" else (True, False):
            assert render(builtin, messages, add) == render(own, messages, add), (messages, add)


def test_the_comparison_sees_whitespace() -> None:
    """Negative control: Gemma's format without trimming the contents parts from Gemma's template on
    these conversations, so the comparison above can fail."""
    own = json.loads((family("gemma3") / "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"]
    untrimmed = chat_templates.GEMMA.replace("(message['content'] | trim)", "message['content']")
    assert untrimmed != chat_templates.GEMMA
    assert any(render(untrimmed, m, True) != render(own, m, True) for m in CONVERSATIONS)


def test_gemma_roles_must_alternate() -> None:
    with pytest.raises(ValueError, match="alternate"):
        render(chat_templates.GEMMA, [{"role": "assistant", "content": "x"}], True)


@pytest.mark.parametrize("package, expected", [("gemma3", "gemma"), ("qwen3", "chatml"), ("llama3", "llama3"),
                                               ("gpt4o", None)])
def test_a_source_without_a_template_gets_the_format_of_its_markers(package: str, expected: str | None) -> None:
    tj = json.loads((family(package) / "tokenizer.json").read_text(encoding="utf-8"))
    template, origin = chat_template(None, None, tj, None)
    if expected is None:  # GPT-4o's vocabulary has no turn markers of these formats
        assert template is None and origin.startswith("none")
    else:
        assert template == chat_templates.BUILTIN[expected][0] and origin.startswith(f"built-in {expected}")
    template, origin = chat_template(None, None, tj, "chatml")  # the option wins
    assert template == chat_templates.CHATML and origin == "--chat-template chatml"


def test_a_template_file_is_read(tmp_path: Path) -> None:
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}", encoding="utf-8")
    tj = json.loads(Tokenizer.from_file(str(family("gpt4o") / "tokenizer.json")).to_str())
    assert chat_template(None, None, tj, str(f)) == (f.read_text(), f"--chat-template {f}")
    with pytest.raises(UsageError, match="--chat-template nope"):
        chat_templates.check("nope")


@pytest.mark.parametrize("args, words", [
    (["--chat-template", "nope"], "--chat-template nope"),
    (["--drafter-chat-template", "chatml"], "--drafter-chat-template"),
    (["-d", "d.gguf", "--drafter-chat-template", "x"], "--drafter-chat-template x")])
def test_export_refuses_a_bad_template_option_before_any_work(args: list[str], words: str, tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["export", "-t", "m.gguf", "-o", str(tmp_path / "out"), *args])
    assert r.exit_code == 2 and words in r.stderr and r.stdout == "", r.output
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_chatting_with_a_built_in_template_says_so(tiny_root: Path, tmp_path: Path) -> None:
    """A source without a template of its own is often a pretrained model: `generate --chat` and `chat`
    say which format renders its turns, on stderr; plain generation and the model's own template say
    nothing of it."""
    folder = tmp_path / "engine"
    shutil.copytree(tiny_root / "engines" / "sp_gemma", folder, ignore=shutil.ignore_patterns("runtime_cache"))
    runner = CliRunner()

    def note(*args: str, input: str | None = None) -> bool:
        r = runner.invoke(app, [*args, "-n", "2", "-t", "1"], input=input)
        assert r.exit_code == 0, r.output
        assert "source has no chat template" not in r.stdout
        return "source has no chat template; its turns use the built-in gemma format" in r.stderr

    manifest = json.loads((folder / "engine.json").read_text())
    assert manifest["exporter"]["chat_template"] == "the model's tokenizer"
    assert not note("generate", str(folder), "-p", "hi", "--chat")
    manifest["exporter"]["chat_template"] = "built-in gemma (the source has none; its vocabulary has its markers)"
    (folder / "engine.json").write_text(json.dumps(manifest))
    assert note("generate", str(folder), "-p", "hi", "--chat")
    assert note("chat", str(folder), input="hi\n")
    assert not note("generate", str(folder), "-p", "hi")
