"""Chat: a conversation continues on its generator, each turn prefilling only what is new; `edge-sd chat`
as piped input and under a real terminal (tmux)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from edge_sd import GenerationConfig, Pipeline
from edge_sd.tools.cli import app

from conftest import PROVIDER

TURNS = ["hi there", "and what about cats?", "tell me more"]


def finish(gen) -> None:
    while not gen.is_done:
        gen.generate_next_tokens()


@pytest.mark.parametrize("pair", ["gemma_qwen", "llama_qwen"])
def test_each_turn_prefills_only_what_is_new(tiny_root: Path, pair: str) -> None:
    """Turn after turn, the target's prefill feeds the template's rendering of the new turn (and the
    reply's last token) alone, and the reply is what a fresh generator gives from the same ids."""
    model = Pipeline.from_folder(tiny_root / "pairs" / pair, provider=PROVIDER, threads=2)
    cfg = GenerationConfig(max_new_tokens=12)
    gen = model.generator(cfg)
    before = 0
    for i, turn in enumerate(TURNS):
        gen.append_chat(turn)
        new = len(gen.ids) - before
        finish(gen)
        s = gen.stats
        assert s.prompt_tokens == len(gen.ids) - len(gen.result().token_ids)
        if i:
            assert s.prefilled_tokens == new + 1, (turn, s.prefilled_tokens, new)  # new ids and the reply's last
        fresh = model.generator(cfg)
        fresh.append_tokens(gen.ids[: gen.reply_start])
        finish(fresh)
        assert fresh.result().token_ids == gen.result().token_ids, turn
        before = len(gen.ids)
    assert [m["role"] for m in gen.messages] == ["user", "assistant"] * len(TURNS)


def test_chat_command_piped(tiny_root: Path) -> None:
    folder = str(tiny_root / "pairs" / "gemma_qwen")
    r = CliRunner().invoke(app, ["chat", folder, "-n", "10", "--threads", "2"],
                           input="hi there\nand what about cats?\n/reset\ncats\n")
    assert r.exit_code == 0, r.output
    stats = [ln for ln in r.stderr.splitlines() if "prefilled" in ln]
    assert len(stats) == 3 and "(new conversation)" in r.stderr
    prefilled = [int(ln.split("prefilled ")[1].split(" of ")[0]) for ln in stats]
    totals = [int(ln.split(" of ")[-1]) for ln in stats]
    assert prefilled[1] < totals[1] and prefilled[2] == totals[2]  # continued, then anew (the whole of it)


def test_chat_command_without_a_template(tiny_root: Path, tmp_path: Path) -> None:
    import json

    folder = tmp_path / "engine"
    shutil.copytree(tiny_root / "engines" / "bl_llama", folder)
    manifest = json.loads((folder / "engine.json").read_text())
    manifest["chat_template"] = None
    (folder / "engine.json").write_text(json.dumps(manifest))
    r = CliRunner().invoke(app, ["chat", str(folder)], input="hi\n")
    assert r.exit_code == 2 and "no chat template" in r.stderr


@pytest.mark.real
def test_chat_under_a_real_terminal(tmp_path: Path) -> None:
    """tmux: a reply streams and ends with its statistics; Ctrl-C ends a long reply, not the session;
    /reset starts anew; Ctrl-D ends the session. The real pair: a reply long enough to interrupt."""
    from test_real_pair import PAIR

    if shutil.which("tmux") is None:
        pytest.fail("tmux is missing: scripts/setup.sh installs it (apt-get install tmux)")

    session = f"edge-sd-chat-{os.getpid()}"
    exe = Path(sys.executable).with_name("edge-sd")
    log = tmp_path / "exit"
    cmd = f"{exe} chat {PAIR} -n 3000 --threads 2; echo exited $? > {log}"

    # A server of the test's own, keeping every line: a reply that repeats itself is drafted by prompt
    # lookup at hundreds of tokens a second, and the prompts counted below must not scroll away.
    conf = tmp_path / "tmux.conf"
    conf.write_text("set -g history-limit 100000\n")

    def tmux(*args: str) -> str:
        return subprocess.run(["tmux", "-L", session, "-f", str(conf), *args], capture_output=True, text=True,
                              check=True).stdout

    def screen() -> str:
        return tmux("capture-pane", "-p", "-J", "-t", session, "-S", "-")

    def prompts(shown: str) -> int:  # capture-pane drops trailing spaces: a bare prompt is ">"
        return sum(line.startswith(">") for line in shown.splitlines())

    def wait_for(text: str, timeout: float = 120.0, count: int = 1) -> str:
        end = time.time() + timeout
        while time.time() < end:
            shown = screen()
            if (prompts(shown) if text == ">" else shown.count(text)) >= count:
                return shown
            time.sleep(0.2)
        raise AssertionError(f"{text!r} did not appear:\n{screen()}")

    tmux("new-session", "-d", "-s", session, "-x", "200", "-y", "50", cmd)
    try:
        wait_for("Ctrl-D ends the session")
        wait_for(">")
        for i, turn in enumerate(["Name three colors.", "/reset", "Write a long story about the sea."]):
            tmux("send-keys", "-t", session, turn, "Enter")
            if turn == "/reset":
                wait_for("(new conversation)")
            else:
                time.sleep(3.0)  # the reply streams by now; 3000 tokens would take minutes
                tmux("send-keys", "-t", session, "C-c")
                shown = wait_for("[stopped]", count=i // 2 + 1)
                assert shown.count("stop: stopped") == i // 2 + 1, shown  # the reply's statistics
            wait_for(">", count=i + 2)  # a new prompt: the session goes on
        # A line longer than a terminal's 4,095-character limit arrives whole (readline): 6,089
        # characters, 4,891 Gemma tokens (its first 4,095 characters: 3,256), prefilled in full.
        long_line = " ".join(f"w{j}" for j in range(1200))
        tmux("send-keys", "-t", session, "-l", long_line)
        tmux("send-keys", "-t", session, "Enter")
        time.sleep(8.0)  # past the prefill, into the reply
        tmux("send-keys", "-t", session, "C-c")
        shown = wait_for("[stopped]", count=3)
        prefilled = [int(ln.split("prefilled ")[1].split(" of ")[0]) for ln in shown.splitlines() if "prefilled " in ln]
        assert prefilled[-1] > 4800, prefilled
        tmux("send-keys", "-t", session, "C-d")
        end = time.time() + 30
        while not log.exists() and time.time() < end:
            time.sleep(0.2)
        assert log.read_text().strip() == "exited 0"
    finally:
        subprocess.run(["tmux", "-L", session, "kill-server"], capture_output=True)


def test_a_refused_turn_leaves_the_conversation_as_it_was(tiny_root: Path) -> None:
    """A turn beyond the context, or not text, is refused and changes nothing: the next turn's reply
    is the one a conversation that never had the bad turn gives (ids and messages alike)."""
    from edge_sd.errors import ContextLimitError, UsageError

    model = Pipeline.from_folder(tiny_root / "pairs" / "gemma_qwen", provider=PROVIDER, threads=2)
    cfg = GenerationConfig(max_new_tokens=8)
    gen, clean = model.generator(cfg), model.generator(cfg)
    for g in (gen, clean):
        g.append_chat(TURNS[0])
        finish(g)
    before = (list(gen.ids), list(gen.messages))
    too_long = " ".join(["cat"] * model.target.manifest.max_context)
    with pytest.raises(ContextLimitError):
        gen.append_chat(too_long)
    with pytest.raises(UsageError, match="not UTF-8"):
        gen.append_chat("bad \udcff bytes")
    assert (gen.ids, gen.messages) == before
    for g in (gen, clean):
        g.append_chat(TURNS[1])
        finish(g)
    assert gen.ids == clean.ids and gen.messages == clean.messages
    # negative control: had the refused turn stayed in the messages, the template would refuse the
    # next turn (roles must alternate) or render another conversation
    assert clean.messages[-2]["content"] == TURNS[1]


def test_chat_command_survives_bad_lines(tiny_root: Path) -> None:
    """Piped: a line that is not UTF-8 and a line beyond the context are each one error line; the
    lines after them are answered and the exit code is 0."""
    folder = tiny_root / "pairs" / "gemma_qwen"
    model = Pipeline.from_folder(folder, provider=PROVIDER, threads=2)
    too_long = " ".join(["cat"] * model.target.manifest.max_context).encode()
    lines = b"hi there\nbad \xff bytes\n" + too_long + b"\nand what about cats?\n"
    r = CliRunner().invoke(app, ["chat", str(folder), "-n", "6", "--threads", "2"], input=lines)
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 2 and "not UTF-8 text: byte 0xff at offset 4" in errors[0], r.stderr
    assert "takes at most" in errors[1]
    assert len([ln for ln in r.stderr.splitlines() if "prefilled" in ln]) == 2  # both good lines answered
