"""The command line, including bad input: one line on stderr, a non-zero exit code, no traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from edge_sd.engines import lm_head
from edge_sd.tools.cli import app
from edge_sd.vocab import Vocab


def run(*args: str, input: str | None = None):
    return CliRunner().invoke(app, list(args), input=input)


def assert_clean_error(r, *fragments: str) -> None:
    assert r.exit_code != 0
    assert "Traceback" not in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
    for f in fragments:
        assert f in r.output, r.output


def test_generate_json(tiny_root: Path) -> None:
    r = run("generate", str(tiny_root / "pairs" / "gemma_qwen"), "-p", "The cat", "-n", "12", "--json",
            "-a", "tli", "--draft-max", "3")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(obj["token_ids"]) == 12 and obj["text"]
    for key in ("algorithm", "lookahead", "new_tokens", "target_forwards", "drafter_forwards", "proposed",
                "accepted", "acceptance_rate", "tokens_per_target_forward", "time_target_s",
                "time_drafter_s", "time_other_s", "wall_s", "tokens_per_second"):
        assert key in obj["stats"], key
    assert obj["stats"]["algorithm"] == "tli" and obj["stats"]["new_tokens"] == 12


def test_generate_stdin_and_stream(tiny_root: Path) -> None:
    r = run("generate", str(tiny_root / "engines" / "bl_llama"), "-n", "10", input="The cat")
    assert r.exit_code == 0, r.output
    assert "tok/s" in r.output  # the statistics line


def test_generate_chat_and_stop(tiny_root: Path) -> None:
    r = run("generate", str(tiny_root / "pairs" / "llama_qwen"), "-p", "hi", "--chat", "-n", "30",
            "--stop", ".", "--json")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout.strip().splitlines()[-1])
    # The ids end with the token that completes the stop string; the text ends before the stop string.
    full = Vocab.from_file(tiny_root / "pairs" / "llama_qwen" / "target" / "tokenizer.json").ids_bytes(obj["token_ids"])
    assert obj["stats"]["stop_reason"] == "stop" and full.count(b".") == 1
    assert obj["text"] == full[: full.index(b".")].decode("utf-8", "replace")


def test_same_seed_same_output(tiny_root: Path) -> None:
    args = ["generate", str(tiny_root / "engines" / "sp_gemma"), "-p", "The", "-n", "20",
            "--temperature", "1.0", "--top-p", "0.9", "--json"]
    a = json.loads(run(*args, "--seed", "7").stdout.strip().splitlines()[-1])
    b = json.loads(run(*args, "--seed", "7").stdout.strip().splitlines()[-1])
    c = json.loads(run(*args, "--seed", "8").stdout.strip().splitlines()[-1])
    assert a["token_ids"] == b["token_ids"]
    assert a["token_ids"] != c["token_ids"]


def test_inspect(tiny_root: Path) -> None:
    r = run("inspect", str(tiny_root / "pairs" / "gemma_qwen"))
    assert r.exit_code == 0, r.output
    assert "intersection" in r.output and "gemma3_text" in r.output


@pytest.mark.parametrize(("row", "env", "other"), [("LM head on this CPU", "EDGE_SD_LM_HEAD", "the graph's"),
                                                  ("attention on this CPU", "EDGE_SD_ATTENTION", "ONNX Runtime's")])
def test_inspect_says_who_computes_the_lm_head_and_the_attention(gguf_root: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 row: str, env: str, other: str) -> None:
    """A gguf target's recorded head and its attention nodes: edge-sd's kernel where it runs, else the
    graph's (ONNX Runtime's) and why; the drafter's always the graph's."""
    from edge_sd.engines import attention

    pair = str(gguf_root / "pair")
    monkeypatch.setenv(env, "0")
    line = next(x for x in run("inspect", pair).output.splitlines() if row in x)
    assert f"{other} ({env}=0)" in line and "kernel" not in line, line
    built = (lm_head.library() if env == "EDGE_SD_LM_HEAD" else attention.library())[0] is not None
    if built:
        monkeypatch.setenv(env, "1")
        line = next(x for x in run("inspect", pair).output.splitlines() if row in x)
        assert "edge-sd's kernel" in line and line.rstrip(" |").endswith(other), line  # target, drafter


def test_missing_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every command that reads an export refuses a folder that is none with the same one line and
    exit code (3), before it fetches anything (no prompt set is downloaded into the cache)."""
    monkeypatch.setenv("EDGE_SD_CACHE", str(tmp_path / "cache"))
    (tmp_path / "empty").mkdir()
    for folder, why in ((tmp_path / "nope", "not a folder"), (tmp_path / "empty", "not an edge-sd export")):
        for command in (["generate", str(folder), "-p", "x"], ["chat", str(folder)], ["inspect", str(folder)],
                        ["calibrate", str(folder)], ["bench", str(folder)], ["bench", str(folder), "--engines"]):
            r = run(*command, input="hi\n")
            assert_clean_error(r, why)
            assert r.exit_code == 3 and len(r.stderr.strip().splitlines()) == 1, (command, r.output)
    assert not (tmp_path / "cache").exists()


def test_llama_cpp_spellings(tiny_root: Path, tmp_path: Path) -> None:
    """-t for threads and -f for a prompt file, as llama.cpp's users type them."""
    pair = str(tiny_root / "pairs" / "gemma_qwen")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The cat", encoding="utf-8")
    a = run("generate", pair, "-f", str(prompt), "-n", "5", "-t", "1", "--temp", "0", "--json")
    b = run("generate", pair, "--prompt-file", str(prompt), "-n", "5", "--threads", "1", "--json")
    assert a.exit_code == 0 and b.exit_code == 0, a.output + b.output
    assert json.loads(a.stdout)["token_ids"] == json.loads(b.stdout)["token_ids"]
    assert run("chat", pair, "-n", "3", "-t", "1", input="Hi\n").exit_code == 0
    assert_clean_error(run("generate", pair, "-p", "x", "-t", "0"), "--threads")


@pytest.fixture()
def engine_copy(tiny_root: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "engine"
    shutil.copytree(tiny_root / "engines" / "bl_llama", dest)
    return dest


def test_missing_model_file(engine_copy: Path) -> None:
    (engine_copy / "model.onnx").unlink()
    assert_clean_error(run("generate", str(engine_copy), "-p", "x"), "model.onnx is missing")


def test_corrupted_model_file(engine_copy: Path) -> None:
    data = (engine_copy / "model.onnx").read_bytes()
    (engine_copy / "model.onnx").write_bytes(data[: len(data) // 2])
    assert_clean_error(run("generate", str(engine_copy), "-p", "x"), "corrupted")
    # Same size, garbage content: caught by --verify (checksums) and by ONNX Runtime itself.
    (engine_copy / "model.onnx").write_bytes(b"\0" * len(data))
    assert_clean_error(run("generate", str(engine_copy), "-p", "x", "--verify"), "sha256")
    assert_clean_error(run("generate", str(engine_copy), "-p", "x"), "could not load")


def test_unknown_manifest_version(engine_copy: Path) -> None:
    m = json.loads((engine_copy / "engine.json").read_text())
    m["format_version"] = 99
    (engine_copy / "engine.json").write_text(json.dumps(m))
    assert_clean_error(run("generate", str(engine_copy), "-p", "x"), "format_version 99")


def test_bad_prompts(tiny_root: Path, engine_copy: Path) -> None:
    assert_clean_error(run("generate", str(engine_copy), "-p", ""), "empty")
    long = "The cat runs. " * 200
    assert_clean_error(run("generate", str(engine_copy), "-p", long), "at most 256")
    assert_clean_error(run("generate", str(engine_copy), "--prompt-file", "/nonexistent"), "cannot read")


def test_bad_options(tiny_root: Path) -> None:
    pair = str(tiny_root / "pairs" / "gemma_qwen")
    assert_clean_error(run("generate", pair, "-p", "x", "--provider", "gpu9"), "unknown provider")
    assert_clean_error(run("generate", pair, "-p", "x", "--provider", "tensorrt"), "not available")
    assert_clean_error(run("generate", pair, "-p", "x", "-a", "magic"), "unknown algorithm")
    assert_clean_error(run("generate", pair, "-p", "x", "-a", "standard"), "one vocabulary")
    assert_clean_error(run("generate", pair, "-p", "x", "-a", "rdk"), "--drafter-vocab-keep")


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("args,message", [
    (("--top-p", "0"), "--top-p must be in (0, 1], got 0.0"),
    (("--top-p", "1.5"), "--top-p must be in (0, 1]"),
    (("--top-k", "-1"), "--top-k must be >= 0"),
    (("--temp", "-0.5"), "--temperature must be >= 0"),
    (("--temperature", "nan"), "--temperature must be >= 0"),
    (("--min-p", "1.2"), "--min-p must be in [0, 1]"),
    (("--repeat-penalty", "0"), "--repeat-penalty must be > 0"),
    (("--repetition-penalty", "-1"), "--repeat-penalty must be > 0"),
    (("--repeat-last-n", "-2"), "--repeat-last-n must be >= -1"),
    (("--presence-penalty", "3"), "--presence-penalty must be in [-2, 2]"),
    (("--frequency-penalty", "-2.5"), "--frequency-penalty must be in [-2, 2]"),
])
def test_bad_sampling_options_name_the_option(tiny_root: Path, command: str, args: tuple, message: str) -> None:
    """One line naming the option as typed on the command line, exit code 2 (bad usage), stdout empty;
    checked before any model is loaded."""
    argv = [command, str(tiny_root / "pairs" / "gemma_qwen"), *args]
    r = CliRunner().invoke(app, argv + (["-p", "x"] if command == "generate" else []), input="hi\n")
    assert_clean_error(r, message)
    assert r.exit_code == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.output


@pytest.mark.parametrize("how", ["prompt", "file", "stdin"])
def test_prompts_that_are_not_utf8_are_one_line(tiny_root: Path, tmp_path: Path, how: str) -> None:
    """Bytes that are not UTF-8, in -p (which Python hands on escaped), a prompt file or stdin: one
    line naming the input and the byte, exit code 2, nothing on stdout."""
    pair = str(tiny_root / "pairs" / "gemma_qwen")
    bad = tmp_path / "p.txt"
    bad.write_bytes(b"abc\xff")
    args = {"prompt": ["-p", "abc\udcff"], "file": ["--prompt-file", str(bad)], "stdin": []}[how]
    r = CliRunner().invoke(app, ["generate", pair, *args], input=b"abc\xff" if how == "stdin" else None)
    name = {"prompt": "--prompt", "file": f"the prompt file {bad}", "stdin": "the prompt on stdin"}[how]
    assert_clean_error(r, f"{name} is not UTF-8 text: byte 0xff at offset 3")
    assert r.exit_code == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("as_json", [True, False])
def test_ctrl_c_prints_what_was_generated(tiny_root: Path, monkeypatch: pytest.MonkeyPatch, as_json: bool) -> None:
    """Ctrl-C (a KeyboardInterrupt in the third round) ends the generation: what it generated is
    printed all the same (as JSON with stop_reason "interrupted", or as text), and the exit code is 130."""
    from edge_sd.generator import Generator

    real = Generator.generate_next_tokens
    rounds = [0]

    def interrupted(self):
        rounds[0] += 1
        if rounds[0] == 3:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(Generator, "generate_next_tokens", interrupted)
    pair = str(tiny_root / "pairs" / "gemma_qwen")
    r = run("generate", pair, "-p", "The cat", "-n", "40", "-a", "plain", *(["--json"] if as_json else ["--no-stream"]))
    assert r.exit_code == 130 and "interrupted" in r.stderr, r.output
    if as_json:
        obj = json.loads(r.stdout.strip().splitlines()[-1])
        assert len(obj["token_ids"]) == 2 and obj["stats"]["stop_reason"] == "interrupted"
    else:
        assert r.stdout.strip() and "stop: interrupted" in r.stderr


def test_the_commands_parser_errors_are_one_line(tiny_root: Path) -> None:
    """The installed command (`edge-sd`, cli.main): a value the option parser refuses, an unknown
    option, a missing argument: one line, exit code 2, stdout empty; help and a bare command as before."""
    import subprocess
    import sys

    exe = str(Path(sys.executable).with_name("edge-sd"))
    pair = str(tiny_root / "pairs" / "gemma_qwen")
    for args, fragment in ((["generate", pair, "-p", "x", "-n", "1e9"], "Invalid value for '--max-new-tokens'"),
                           (["generate", pair, "-p", "x", "--bogus"], "No such option: --bogus"),
                           (["generate"], "Missing argument")):
        r = subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and r.stdout == "", (args, r)
        assert r.stderr.startswith("error:") and fragment in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    helped = subprocess.run([exe, "generate", "--help"], capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "--top-p" in helped.stdout
    bare = subprocess.run([exe], capture_output=True, text=True, timeout=120)
    assert "generate" in bare.stdout + bare.stderr and "Traceback" not in bare.stderr


def test_impossible_thread_counts_are_refused(tiny_root: Path) -> None:
    r = run("generate", str(tiny_root / "pairs" / "gemma_qwen"), "-p", "x", "--threads", "-2")
    assert_clean_error(r, "--threads must be at least 1, got -2")
    assert r.exit_code == 2


def test_the_sampler_chain_from_the_command_line(tiny_root: Path) -> None:
    """llama.cpp's spellings and the full chain reach the generation: the same seed gives the same ids,
    a strong repetition penalty changes greedy output (it applies at temperature 0 too)."""
    pair = str(tiny_root / "pairs" / "gemma_qwen")
    chat_args = ("--temp", "0.8", "--top-k", "40", "--top-p", "0.95", "--min-p", "0.05", "--seed", "3")

    def ids(*args: str) -> list[int]:
        r = run("generate", pair, "-p", "The cat sat on the mat. The cat", "-n", "16", "--json", *args)
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout.strip().splitlines()[-1])["token_ids"]

    assert ids(*chat_args) == ids(*chat_args)
    assert ids("--repeat-penalty", "3", "--repeat-last-n", "-1") != ids()
    assert_clean_error(run("generate", str(tiny_root / "engines" / "bl_llama"), "-p", "x", "-a", "tli"),
                       "pair folder")


def test_export_bad_inputs(tmp_path: Path) -> None:
    assert_clean_error(run("export", "-t", str(tmp_path / "missing.gguf"), "-o", str(tmp_path / "o")),
                       "not found")
    assert_clean_error(run("export", "-t", "./nowhere/model", "-o", str(tmp_path / "o")), "not found")
    assert_clean_error(run("export", "-t", "x", "--precision", "fp8", "-o", str(tmp_path / "o")),
                       "unknown precision")
    assert_clean_error(run("export", "-t", "x", "--drafter-vocab-keep", "0.5", "-o", str(tmp_path / "o")),
                       "give one with --drafter")
    assert not (tmp_path / "o").exists()


def test_export_pruned_pair_from_the_cli(tiny_root: Path, tmp_path: Path) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("The cat reads a long story.\ndef add(a, b):\n    return a + b\n", encoding="utf-8")
    hf = tiny_root / "hf"
    out = tmp_path / "pair"
    args = ("export", "-t", str(hf / "bl_llama"), "-d", str(hf / "bl2_qwen"), "-o", str(out), "--no-validate")
    assert_clean_error(run(*args, "--drafter-vocab-keep", "1.5", "--vocab-corpus", str(corpus)), "(0, 1]")
    assert_clean_error(run(*args, "--drafter-vocab-keep", "0.5", "--vocab-corpus", str(tmp_path / "no.txt")),
                       "not found")
    assert not out.exists()  # nothing half-written
    r = run(*args, "--drafter-vocab-keep", "0.5", "--vocab-corpus", str(corpus))
    assert r.exit_code == 0, r.output
    r = run("generate", str(out), "-p", "The cat", "-n", "8", "-a", "rdk", "--draft-max", "2", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout.strip().splitlines()[-1])["stats"]["algorithm"] == "rdk"


def test_help_shows_the_defaults_in_brackets() -> None:
    """Help texts write defaults in square brackets, which rich markup would take for tags and drop."""
    r = CliRunner().invoke(app, ["export", "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "[engines/<names>]" in r.output and "[same as --precision]" in r.output
    r = CliRunner().invoke(app, ["generate", "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "[2 greedy, 1 sampling]" in r.output


def test_version_and_conventions(tiny_root: Path) -> None:
    """--version; `plain` for plain decoding; -s is the seed (as in llama.cpp); --draft-max the draft
    length (as in llama.cpp); the maintainer's --readme is not in the user's help."""
    from edge_sd import __version__

    r = run("--version")
    assert r.exit_code == 0 and r.stdout.strip() == f"edge-sd {__version__}"
    pair = str(tiny_root / "pairs" / "gemma_qwen")
    plain = json.loads(run("generate", pair, "-p", "The", "-n", "6", "-a", "plain", "--json").stdout)
    assert plain["stats"]["algorithm"] == "plain" and plain["stats"]["proposed"] == 0
    a = json.loads(run("generate", pair, "-p", "The", "-n", "12", "--temperature", "1", "-s", "3", "--json").stdout)
    b = json.loads(run("generate", pair, "-p", "The", "-n", "12", "--temperature", "1", "--seed", "3",
                       "--json").stdout)
    assert a["token_ids"] == b["token_ids"]
    r = run("generate", pair, "-p", "The", "-n", "6", "-a", "slem", "--draft-max", "4", "--json")
    assert json.loads(r.stdout)["stats"]["lookahead"] == 4
    assert "--readme" not in run("bench", "--help").stdout
    assert "--draft-lengths" in run("bench", "--help").stdout


def test_tables_are_whole_when_piped(tiny_root: Path) -> None:
    """Not on a terminal, a table is printed as markdown with every cell whole (rich would cut cells
    to fit 80 columns), and --json gives the same facts to programs."""
    pair = tiny_root / "pairs" / "gemma_qwen"
    r = run("inspect", str(pair))
    assert r.exit_code == 0
    assert "| source | " in r.stdout and "…" not in r.stdout
    assert "| name | sp_gemma | bl2_qwen |" in r.stdout
    assert "| previous_row_attention | False | False |" in r.stdout  # fp32 engines: steps as exported
    data = json.loads(run("inspect", str(pair), "--json").stdout)
    assert data["target"]["name"] == "sp_gemma" and data["pair"]["same_vocabulary"] is False
    # The KV memory a cache takes: a key and a value of num_kv_heads x head_dim per layer and position
    per_position = {}
    for role in ("target", "drafter"):
        m = data[role]
        per_position[role] = 2 * m["num_layers"] * m["num_kv_heads"] * m["head_dim"] * {"float32": 4, "float16": 2}[
            m["kv_dtype"]]
        assert m["kv_bytes_per_position"] == per_position[role]
    assert f"| KV cache per position | {per_position['target']:,} B | {per_position['drafter']:,} B |" in r.stdout
    at_max = [f"{per_position[role] * data[role]['max_context'] / 1e6:,.1f} MB" for role in ("target", "drafter")]
    assert f"| KV cache at max_context | {at_max[0]} | {at_max[1]} |" in r.stdout


# A bounded fuzz of each command's options: odd values (negative, zero, huge, not numbers, not UTF-8)
# for each, a few at a time. Each run ends with a documented exit code and, where it fails, one line
# on stderr: never a traceback.
ODD = ["-1", "0", "1", "0.5", "1e9", "-1e9", "nan", "inf", "x", "", "abc\udcff"]
CHAIN = ["--temperature", "--top-k", "--top-p", "--min-p", "--repeat-penalty", "--repeat-last-n",
         "--presence-penalty", "--frequency-penalty", "-n", "--draft-max", "--threads", "--seed", "-a", "--provider"]
OPTIONS = {"generate": CHAIN + ["--stop", "--lookahead-schedule"], "chat": CHAIN,
           "inspect": ["--threads", "--provider"],
           "export": ["--precision", "--drafter-precision", "--max-context", "--exporter", "--device",
                      "--drafter-vocab-keep", "--tokenizer", "--drafter-tokenizer", "-o", "-d"]}


def _fuzz(command: str, head: list[str], input: bytes | None = None, examples: int = 40) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=examples, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(st.lists(st.tuples(st.sampled_from(OPTIONS[command]), st.sampled_from(ODD)), min_size=1, max_size=3))
    def check(options: list[tuple[str, str]]) -> None:
        args = [command, *head]
        for flag, value in options:
            args += [flag, value]
        r = CliRunner().invoke(app, args, input=input)
        assert r.exit_code in (0, 2, 4, 5, 6), (args, r.exit_code, r.output)
        assert "Traceback" not in r.output and (r.exception is None or isinstance(r.exception, SystemExit)), (
            args, r.output)
        if r.exit_code and "Usage:" not in r.stderr:  # edge-sd's own errors; the parser's show the usage
            assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error:"), (args, r.stderr)

    check()


def test_generate_options_fuzzed(tiny_root: Path) -> None:
    _fuzz("generate", [str(tiny_root / "pairs" / "gemma_qwen"), "-p", "The cat", "-n", "4"], examples=60)


def test_chat_options_fuzzed(tiny_root: Path) -> None:
    _fuzz("chat", [str(tiny_root / "pairs" / "gemma_qwen"), "-n", "4"], input=b"Hi\n\xff\nBye\n")


def test_inspect_options_fuzzed(tiny_root: Path) -> None:
    _fuzz("inspect", [str(tiny_root / "pairs" / "gemma_qwen")], examples=20)


def test_export_options_fuzzed(tiny_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every option is checked before any model is read: what passes the checks reaches the export
    proper, which stands in here as one that refuses (the real export is tested elsewhere)."""
    from edge_sd.errors import ExportError
    from edge_sd.export import pair as pair_module

    def reached(*args, **kwargs):
        raise ExportError("checks passed")

    monkeypatch.setattr(pair_module, "atomic_folder", reached)
    monkeypatch.chdir(tmp_path)
    _fuzz("export", ["-t", str(tiny_root / "hf" / "bl_llama"), "--json"])
