"""`edge-sd serve` against generating in-process, on the same pair and prompts, in one run.

    bash scripts/real_pair.sh                      # once: the default pair in engines/
    .venv/bin/python benchmarks/serve.py [--per-set 4] [--load-seconds 120]

1. One client: per prompt (code and news articles; greedy, then the chat setting with a seed), a
   generation in this process (Model + Generator, what `edge-sd generate` runs) and a streamed
   /v1/completions request to a server on the same pair, interleaved. Rate: new tokens over the time
   from the request to its last token, prefill included, on both sides. Time to first token: from the
   request to the first streamed text, beside the in-process one and the prefill the server reports.
   Each client keeps one HTTP connection pool across its requests, as an app keeps its SDK's.
2. Four clients at once, greedy, each its own prompt: their total rate against the same four prompts
   one client after the other; each stream's text against the one it got alone.
3. Load: 16 streaming clients in a loop for `--load-seconds` (the server takes 4 at once and queues
   16): replies, errors by status, and the server's resident memory every 2 s.

Both the server and this process run 2 intra-op threads; they never compute at the same time.
Writes benchmarks/results/serve.{md,json,png}; `--report` writes the table and plot again from the JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from edge_sd.bench.run import CHAT, machine, write_results
from edge_sd.config import GenerationConfig
from edge_sd.model import Model
from edge_sd.tools import prompt_sets
from edge_sd.tools.paths import cache_dir

ROOT = Path(__file__).resolve().parents[1]
THREADS = 2
MODES = {"greedy": {"temperature": 0.0},
         "chat": {"temperature": CHAT.temperature, "top_k": CHAT.top_k, "top_p": CHAT.top_p, "min_p": CHAT.min_p}}


def start_server(pair: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "edge_sd.tools.cli", "serve", str(pair), "--port", str(port), "-t", str(THREADS),
           "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the server did not start: {proc.communicate()[1][-2000:]}")


def stream(client: httpx.Client, url: str, prompt: str, max_tokens: int, mode: str, seed: int) -> dict:
    """One streamed completion: its text, times and the server's statistics. client: kept across
    requests, as an app keeps its SDK's (a new httpx client loads its TLS settings first, about 0.1 s
    here, which is the client's cost, not the server's)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "seed": seed, "stream": True, **MODES[mode]}
    start = time.perf_counter()
    first, text, stats = None, [], {}
    with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "error": r.read().decode()[:200]}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"status": 200, "error": chunk["error"]["message"]}
            piece = chunk["choices"][0]["text"]
            if piece and first is None:
                first = time.perf_counter() - start
            text.append(piece)
            stats = chunk.get("edge_sd", stats)
    return {"status": 200, "text": "".join(text), "s": time.perf_counter() - start, "ttft_s": first,
            "tokens": stats.get("new_tokens", 0), "prefill_s": stats.get("prefill_s", 0.0)}


def alone(model: Model, prompt: str, max_tokens: int, mode: str, seed: int) -> dict:
    m = {("repetition_penalty" if k == "repeat_penalty" else k): v for k, v in MODES[mode].items()}
    gen = model.generator(GenerationConfig(max_new_tokens=max_tokens, seed=seed, **m))
    start = time.perf_counter()
    first = None
    gen.append_text(prompt)
    while not gen.is_done:
        if gen.generate_next_tokens().text and first is None:
            first = time.perf_counter() - start
    r = gen.result()
    return {"text": r.text, "s": time.perf_counter() - start, "tokens": len(r.token_ids), "ttft_s": first,
            "prefill_s": r.stats.prefill_s}


def one_client(model: Model, client: httpx.Client, url: str, prompts: list, max_tokens: int) -> list[dict]:
    rows = []
    for i, p in enumerate(prompts):
        for mode in MODES:
            runs = {}
            order = ("server", "in-process") if i % 2 else ("in-process", "server")
            for side in order:
                runs[side] = (stream(client, url, p.text, max_tokens, mode, i) if side == "server"
                              else alone(model, p.text, max_tokens, mode, i))
            s, a = runs["server"], runs["in-process"]
            rows.append({"set": p.set, "prompt": p.id, "mode": mode, "server_tps": s["tokens"] / s["s"],
                         "inproc_tps": a["tokens"] / a["s"], "ttft_s": s["ttft_s"], "inproc_ttft_s": a["ttft_s"],
                         "prefill_s": s["prefill_s"],
                         "equal": s["text"] == a["text"], "tokens": s["tokens"]})
            print(f"{p.id:>14} {mode:6} server {rows[-1]['server_tps']:6.1f} tok/s, in-process "
                  f"{rows[-1]['inproc_tps']:6.1f}; first text {1e3 * (s['ttft_s'] or 0):.0f} ms (in-process "
                  f"{1e3 * (a['ttft_s'] or 0):.0f}), prefill "
                  f"{1e3 * s['prefill_s']:.0f} ms; equal {rows[-1]['equal']}", flush=True)
    return rows


def four_at_once(url: str, prompts: list, max_tokens: int) -> list[dict]:
    groups = []
    clients = [httpx.Client() for _ in range(4)]  # one each: four apps
    for g in range(0, len(prompts) - 3, 4):
        group = prompts[g:g + 4]
        solo = [stream(clients[0], url, p.text, max_tokens, "greedy", 0) for p in group]
        start = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda c, p: stream(c, url, p.text, max_tokens, "greedy", 0), clients, group))
        wall = time.perf_counter() - start
        groups.append({"prompts": [p.id for p in group], "solo_tps": sum(r["tokens"] for r in solo) /
                       sum(r["s"] for r in solo), "together_tps": sum(r["tokens"] for r in got) / wall,
                       "equal": sum(a["text"] == b["text"] for a, b in zip(solo, got, strict=True))})
        print(f"four at once: {groups[-1]}", flush=True)
    for c in clients:
        c.close()
    return groups


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def load(url: str, pid: int, prompts: list, max_tokens: int, seconds: float) -> dict:
    statuses: dict[str, int] = {}
    lock = threading.Lock()
    end = time.monotonic() + seconds
    tokens = [0]

    def client(i: int) -> None:
        n = 0
        http = httpx.Client()
        while time.monotonic() < end:
            mode = "greedy" if i % 2 else "chat"
            r = stream(http, url, prompts[(i + n) % len(prompts)].text, max_tokens, mode, i)
            key = str(r["status"]) + (" (error event)" if r["status"] == 200 and "error" in r else "")
            with lock:
                statuses[key] = statuses.get(key, 0) + 1
                tokens[0] += r.get("tokens", 0)
            if r["status"] in (429, 503):
                time.sleep(1.0)
            n += 1
        http.close()

    memory = []
    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    start = time.monotonic()
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        memory.append((round(time.monotonic() - start, 1), round(rss_mb(pid), 1)))
        time.sleep(2.0)
    wall = time.monotonic() - start
    print(f"load: {statuses}, {tokens[0] / wall:.1f} tok/s", flush=True)
    return {"seconds": seconds, "statuses": statuses, "tps": tokens[0] / wall, "rss_mb": memory}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, default=ROOT / "engines" / "gemma3-270m_smollm2-135m")
    ap.add_argument("--per-set", type=int, default=4)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=64)
    ap.add_argument("--load-seconds", type=float, default=120.0)
    ap.add_argument("--report", action="store_true")
    ap.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    if args.report:
        print(write_results(args.out, "serve", report, plot))
        return
    prompts = [p for s in ("code", "summarisation") for p in prompt_sets.load(s, cache_dir(), args.per_set)]
    model = Model.load(args.pair, threads=THREADS)
    proc, url = start_server(args.pair)
    client = httpx.Client()
    try:
        for p in prompts[:2]:  # warm both sides up (first forwards, the drafter's session)
            stream(client, url, p.text, 8, "greedy", 0)
            alone(model, p.text, 8, "greedy", 0)
        rows = one_client(model, client, url, prompts, args.max_new_tokens)
        groups = four_at_once(url, prompts, args.max_new_tokens)
        loaded = load(url, proc.pid, prompts, args.max_new_tokens, args.load_seconds)
    finally:
        proc.send_signal(signal.SIGTERM)
        stderr = proc.communicate(timeout=120)[1]
    result = {"date": datetime.date.today().isoformat(), "machine": {**machine(), "vector": vector_extensions()},
              "pair": args.pair.name,
              "max_new_tokens": args.max_new_tokens, "threads": THREADS, "one_client": rows, "four": groups,
              "load": loaded, "exit_code": proc.returncode, "tracebacks": stderr.count("Traceback")}
    print(write_results(args.out, "serve", report, plot, result))


def vector_extensions() -> str:
    """AVX-512 or AVX2 (ONNX Runtime's and llama.cpp's kernels differ between them)."""
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    return "AVX-512" if "avx512f" in flags else ("AVX2, no AVX-512" if "avx2" in flags else "unknown")


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def report(result: dict) -> str:
    m = result["machine"]
    lines = ["# edge-sd serve against generating in-process", "",
             f"{result['date']}; {m['cpu']} ({m.get('vector', 'vector extensions not recorded')}), {m['cores']} "
             f"cores, ONNX Runtime {m['onnxruntime']}; the pair "
             f"{result['pair']}, {result['threads']} threads each, {result['max_new_tokens']} new tokens. Command: "
             "`python benchmarks/serve.py`. Rates: new tokens over the time from the request to the last token, "
             "prefill included; medians over prompts. First text: from the request to the first text streamed "
             "(in-process: returned by `generate_next_tokens`); one HTTP client kept across requests.", "",
             "| mode | prompts | server tok/s | in-process tok/s | server / in-process | first text, server (ms) | "
             "first text, in-process (ms) | prefill (ms) | texts equal |", "|---|---|---|---|---|---|---|---|---|"]
    for mode in MODES:
        rows = [r for r in result["one_client"] if r["mode"] == mode]
        ratio = statistics.median(r["server_tps"] / r["inproc_tps"] for r in rows)
        inproc = f"{1e3 * _median(rows, 'inproc_ttft_s'):.0f}" if all(r.get("inproc_ttft_s") for r in rows) else "n/a"
        lines.append(f"| {mode} | {len(rows)} | {_median(rows, 'server_tps'):.1f} | {_median(rows, 'inproc_tps'):.1f} "
                     f"| {ratio:.3f}x | {1e3 * _median(rows, 'ttft_s'):.0f} | {inproc} "
                     f"| {1e3 * _median(rows, 'prefill_s'):.0f} "
                     f"| {sum(r['equal'] for r in rows)} of {len(rows)} |")
    lines += ["", "Four clients at once (greedy, each its own prompt) against the same four one after the other:", "",
              "| prompts | one at a time tok/s | four at once tok/s | ratio | texts equal to alone |",
              "|---|---|---|---|---|"]
    for g in result["four"]:
        lines.append(f"| {', '.join(g['prompts'])} | {g['solo_tps']:.1f} | {g['together_tps']:.1f} | "
                     f"{g['together_tps'] / g['solo_tps']:.2f}x | {g['equal']} of 4 |")
    ld = result["load"]
    rss = [mb for _, mb in ld["rss_mb"]]
    after = [mb for t, mb in ld["rss_mb"] if t >= 60] or rss
    lines += ["", f"Load: 16 streaming clients in a loop for {ld['seconds']:.0f} s (greedy and chat setting "
              f"alternately; `--max-concurrent 4 --queue 16`): replies by status {ld['statuses']}, "
              f"{ld['tps']:.1f} tok/s in all. Server resident memory: {rss[0]:.0f} MB at the start, "
              f"{min(after):.0f}-{max(after):.0f} MB after the first minute, {rss[-1]:.0f} MB at the end. "
              f"The server exited with code {result['exit_code']} on SIGTERM; tracebacks in its log: "
              f"{result['tracebacks']}.", ""]
    if result.get("note"):
        lines += [result["note"], ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    modes = list(MODES)
    for j, (key, label) in enumerate((("inproc_tps", "in-process"), ("server_tps", "server, one client"))):
        values = [_median([r for r in result["one_client"] if r["mode"] == mode], key) for mode in modes]
        ax1.bar([i + 0.4 * j for i in range(len(modes))], values, width=0.4, label=label)
    ax1.set_xticks([i + 0.2 for i in range(len(modes))], modes)
    ax1.set_ylabel("tok/s (median, prefill included)")
    ax1.legend(fontsize=8)
    t, mb = zip(*result["load"]["rss_mb"], strict=True)
    ax2.plot(t, mb)
    ax2.set_xlabel("s into the load test (16 clients)")
    ax2.set_ylabel("server resident memory (MB)")
    ax2.set_ylim(0, max(mb) * 1.1)
    fig.suptitle(f"edge-sd serve, {result['pair']} ({result['date']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
