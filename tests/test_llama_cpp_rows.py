"""llama.cpp's rows in `edge-sd bench --llama-cpp`: its tools' logs read, and the rows run beside
edge-sd's on the real pair.

llama.cpp itself is built only by benchmarks/llama_cpp.sh (about 10 minutes on 2 cores), never by the
set-up or the tests. So the bench test runs two stand-in scripts in its place that check the arguments
edge-sd passes and print the timing lines llama.cpp 0.5.0-dev (vendored in llama-cpp-python 0.3.36)
printed for `The three primary colors are` on gemma-3-270m-q4_k_m.gguf; what they test is edge-sd's
side: the arguments, the parsing and the rows in the table.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from edge_sd.bench.llama_cpp import COMPLETION, SPECULATIVE, LlamaCpp, parse
from edge_sd.errors import UsageError

COMPLETION_LOG = "".join([
    "0.02.984.779 I common_perf_print:    sampling time =      20.25 ms\n",
    "0.02.984.787 I common_perf_print:        load time =      50.16 ms\n",
    "0.02.984.788 I common_perf_print: prompt eval time =      49.23 ms /     6 tokens ",
    "(    8.21 ms per token,   121.87 tokens per second)\n",
    "0.02.984.790 I common_perf_print:        eval time =     466.91 ms /    15 runs   ",
    "(   31.13 ms per token,    32.13 tokens per second)\n",
    "0.02.984.790 I common_perf_print:       total time =     539.16 ms /    21 tokens\n",
])
SPECULATIVE_LOG = """\
0.02.191.285 I encoded    6 tokens in    0.027 seconds, speed:  220.224 t/s
0.02.191.307 I decoded   17 tokens in    0.476 seconds, speed:   35.720 t/s
0.02.191.341 I n_draft   = 3
0.02.191.373 I n_predict = 17
0.02.191.389 I n_drafted = 4
0.02.191.406 I n_accept  = 3
0.02.191.423 I accept    = 75.000%
"""


def test_both_tools_logs_are_read() -> None:
    plain = parse(COMPLETION_LOG, speculative=False)
    # The eval line, not the prompt eval line before it: 15 runs after the prompt's.
    assert (plain.tokens, plain.accept) == (15, None)
    # Decoding: the 15 runs' eval time and the sampler's time for their 15 of the 16 tokens it chose.
    assert (plain.eval_s, plain.prefill_s) == pytest.approx((0.46691, 0.04923))
    assert plain.decode_s == pytest.approx(0.46691 + 0.02025 * 15 / 16)
    assert parse(COMPLETION_LOG.split("\n", 1)[1], speculative=False).decode_s == pytest.approx(0.46691)
    spec = parse(SPECULATIVE_LOG, speculative=True)
    assert (spec.tokens, spec.decode_s, spec.prefill_s, spec.accept) == pytest.approx((17, 0.476, 0.027, 0.75))
    assert spec.rate == pytest.approx(17 / 0.476)
    # Nothing drafted: llama.cpp prints "accept = -nan%"; the rate still stands.
    assert parse(SPECULATIVE_LOG.replace("75.000%", "-nan%"), speculative=True).accept is None
    with pytest.raises(RuntimeError, match="no eval time"):
        parse("llama_model_load: error loading model", speculative=False, tool=COMPLETION)


def _stand_ins(folder: Path, gguf: Path) -> Path:
    """Scripts named as llama.cpp's tools that check edge-sd's arguments (the GGUF file, the prompt
    file, the thread count) and print the recorded timings."""
    folder.mkdir()
    for name, log in ((COMPLETION, COMPLETION_LOG), (SPECULATIVE, SPECULATIVE_LOG)):
        extra = "--spec-type ngram-simple" if name == SPECULATIVE else "-no-cnv --no-warmup"
        script = folder / name
        script.write_text(f"""#!/usr/bin/env bash
args="$*"
case "$args" in *"-m {gguf} "*) ;; *) echo "wrong model: $args" >&2; exit 3;; esac
case "$args" in *"-t 2 -tb 2 "*) ;; *) echo "wrong threads: $args" >&2; exit 3;; esac
case "$args" in *"{extra}"*) ;; *) echo "missing {extra}: $args" >&2; exit 3;; esac
prompt="${{@: -1}}"
[ -s "$prompt" ] || {{ echo "no prompt file" >&2; exit 3; }}
cat >&2 <<'LOG'
{log}LOG
""")
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return folder


def test_llama_cpp_samples_with_edge_sds_chain() -> None:
    """Every setting of the chain given (llama.cpp's own defaults of top-k 40, top-p 0.95 and min-p
    0.05 would else apply), in edge-sd's order; greedy at temperature 0, penalties included."""
    from edge_sd.bench.llama_cpp import sampling_args
    from edge_sd.bench.run import CHAT
    from edge_sd.sampling import SamplingConfig

    def opts(args: list[str]) -> dict[str, str]:
        return dict(zip(args[::2], args[1::2], strict=True))

    chat = opts(sampling_args(CHAT))
    assert chat["--samplers"] == "penalties;temperature;top_k;top_p;min_p"
    assert (chat["--temp"], chat["--top-k"], chat["--top-p"], chat["--min-p"]) == ("0.8", "40", "0.95", "0.05")
    assert chat["--repeat-penalty"] == "1.0" and chat["--presence-penalty"] == "0.0"
    t1 = opts(sampling_args(SamplingConfig(1.0)))
    assert (t1["--top-k"], t1["--top-p"], t1["--min-p"]) == ("0", "1.0", "0.0")
    greedy = opts(sampling_args(SamplingConfig(repetition_penalty=1.2, repeat_last_n=32)))
    assert greedy["--temp"] == "0" and greedy["--repeat-penalty"] == "1.2" and greedy["--repeat-last-n"] == "32"


def test_missing_tools_and_files_are_named(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(UsageError, match=r"lacks llama.cpp's llama-completion, llama-speculative-simple.*llama_cpp.sh"):
        LlamaCpp(tmp_path, gguf, 2)
    tools = _stand_ins(tmp_path / "bin", gguf)
    with pytest.raises(UsageError, match=r"nothing.gguf not found.*--gguf"):
        LlamaCpp(tools, tmp_path / "nothing.gguf", 2)


@pytest.mark.real
def test_bench_runs_llama_cpp_rows_beside_edge_sd(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from edge_sd.manifest import load_engine_manifest
    from edge_sd.tools.cli import app

    from test_real_pair import PAIR

    if not (PAIR / "pair.json").is_file():
        pytest.fail(f"the real pair is not exported at {PAIR}: run `bash scripts/test.sh` first")
    gguf = Path(load_engine_manifest(PAIR / "target").source)  # the file the target was exported from
    tools = _stand_ins(tmp_path / "bin", gguf)
    out = tmp_path / "results"
    args = ["bench", str(PAIR), "--per-set", "1", "-n", "8", "--draft-lengths", "2", "--algorithms", "slem",
            "--no-auto", "--threads", "2", "--llama-cpp", str(tools), "-o", str(out), "--modes", "greedy,sample,chat"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads((out / "real_pair.json").read_text())
    rows = {(r["mode"], r["engine"], r["algorithm"]): r for r in data["summary"]}
    # plain decoding and n-gram speculation in every mode, the chat setting's included
    assert {(m, "llama.cpp", a) for m in ("greedy", "sample", "chat") for a in ("ar", "ngram")} <= set(rows)
    plain, ngram = rows["greedy", "llama.cpp", "ar"], rows["greedy", "llama.cpp", "ngram"]
    # Two prompts, each timed as the tool reports: its prefill plus its decoding (sampling included).
    decode = 0.46691 + 0.02025 * 15 / 16
    assert plain["prompts"] == 2 and plain["tokens_per_s"] == pytest.approx(15 / (0.04923 + decode))
    assert ngram["tokens_per_s"] == pytest.approx(17 / (0.027 + 0.476))
    assert plain["identical_to_plain"] is None and ngram["tokens_per_target_forward"] is None
    table = (out / "real_pair.md").read_text()
    assert "| llama.cpp | n-gram speculation |" in table and "| llama.cpp | plain |" in table
    assert rows["greedy", "edge-sd", "slem"]["identical_to_plain"] == 2
