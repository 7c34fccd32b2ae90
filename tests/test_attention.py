"""edge-sd's attention kernel (engines/attention.py): what GroupQueryAttention computes, each row alike
in any forward and over any view on a multiple of 16 positions, and the graph rewrite that puts it in
place of the nodes it computes."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from edge_sd.engines import attention

HEADS, KV_HEADS, DIM = 4, 1, 64
WINDOW = 48

lib, why = attention.library()
pytestmark = pytest.mark.skipif(lib is None, reason=f"the kernel did not build: {why}")


def _session(op: str, window: int) -> ort.InferenceSession:
    """One attention node over a shared buffer: GroupQueryAttention (ONNX Runtime's) or CachedAttention."""
    domain = attention.DOMAIN if op == attention.OP else "com.microsoft"
    extra = {"do_rotary": 0, "softcap": 0.0} if domain == "com.microsoft" else {}
    names = ["q", "k", "v", "past_k", "past_v", "seqlens", "total"]
    node = helper.make_node(op, names, ["out", "present_k", "present_v"], domain=domain, num_heads=HEADS,
                            kv_num_heads=KV_HEADS, local_window_size=window, scale=0.125, **extra)
    f, i32 = TensorProto.FLOAT, TensorProto.INT32
    ins = [helper.make_tensor_value_info("q", f, [1, "s", HEADS * DIM]),
           helper.make_tensor_value_info("k", f, [1, "s", KV_HEADS * DIM]),
           helper.make_tensor_value_info("v", f, [1, "s", KV_HEADS * DIM]),
           helper.make_tensor_value_info("past_k", f, [1, KV_HEADS, "n", DIM]),
           helper.make_tensor_value_info("past_v", f, [1, KV_HEADS, "n", DIM]),
           helper.make_tensor_value_info("seqlens", i32, [1]), helper.make_tensor_value_info("total", i32, [])]
    outs = [helper.make_tensor_value_info("out", f, [1, "s", HEADS * DIM]),
            helper.make_tensor_value_info("present_k", f, [1, KV_HEADS, "n", DIM]),
            helper.make_tensor_value_info("present_v", f, [1, KV_HEADS, "n", DIM])]
    model = helper.make_model(helper.make_graph([node], "attention", ins, outs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    opts.log_severity_level = 3
    if domain == attention.DOMAIN:
        opts.register_custom_ops_library(str(lib))
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _forward(session: ort.InferenceSession, q: np.ndarray, k: np.ndarray, v: np.ndarray, keys: np.ndarray,
             values: np.ndarray, end: int) -> np.ndarray:
    """The attention of q's rows, the last of them at buffer position end - 1, their keys and values
    written into `keys` and `values` in place (bound as past and present both, as edge-sd binds them)."""
    io = session.io_binding()
    for name, x in (("q", q), ("k", k), ("v", v)):
        io.bind_cpu_input(name, np.ascontiguousarray(x[None]))
    for past, present, buffer in (("past_k", "present_k", keys), ("past_v", "present_v", values)):
        value = ort.OrtValue.ortvalue_from_numpy(buffer)
        io.bind_ortvalue_input(past, value)
        io.bind_ortvalue_output(present, value)
    io.bind_cpu_input("seqlens", np.array([end - 1], np.int32))
    io.bind_cpu_input("total", np.array(end, np.int32))
    io.bind_output("out")
    session.run_with_iobinding(io)
    return io.get_outputs()[-1].numpy()[0]


def _reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray, end: int, window: int) -> np.ndarray:
    """Attention in float64: row r (position end - rows + r) over the positions up to its own, the last
    `window` of them where window > 0."""
    out = np.zeros(q.shape)
    for r in range(len(q)):
        t = end - len(q) + r
        lo = max(0, t - window + 1) if window > 0 else 0
        for h in range(HEADS):
            kv = h // (HEADS // KV_HEADS)
            s = keys[0, kv, lo:t + 1].astype(np.float64) @ q[r, h * DIM:(h + 1) * DIM] * 0.125
            p = np.exp(s - s.max())
            out[r, h * DIM:(h + 1) * DIM] = p / p.sum() @ values[0, kv, lo:t + 1]
    return out


@pytest.mark.parametrize("window", [WINDOW, -1])
def test_the_kernel_computes_what_group_query_attention_does(window: int) -> None:
    rng = np.random.default_rng(0)
    ours, theirs = _session(attention.OP, window), _session("GroupQueryAttention", window)
    for rows, end in ((1, 5), (2, 70), (5, 100), (17, 130)):
        q = rng.standard_normal((rows, HEADS * DIM), np.float32)
        k, v = (rng.standard_normal((rows, KV_HEADS * DIM), np.float32) for _ in range(2))
        cache = [rng.standard_normal((1, KV_HEADS, 144, DIM), np.float32) for _ in range(2)]
        mine = [c.copy() for c in cache]
        got = _forward(ours, q, k, v, *mine, end)
        want = _forward(theirs, q, k, v, *cache, end)
        assert all(np.array_equal(a, b) for a, b in zip(mine, cache, strict=True))  # the same writes
        assert np.abs(got - _reference(q, *mine, end, window)).max() < 2e-6
        assert np.abs(got - want).max() < 2e-5
        # the window's edge: off by one position, the reference is far from it
        if window > 0 and end > window + 1:
            assert np.abs(got - _reference(q, *mine, end, window + 1)).max() > 1e-3


@pytest.mark.parametrize("window", [WINDOW, -1])
def test_a_row_is_computed_alike_in_any_forward_and_view(window: int) -> None:
    """Each position's output bit for bit the same whether it is fed alone, with the position before
    it (a one-position step of an engine that reads it back), or in forwards of 6 and 17, and over a
    view of the buffer from 64 positions in. ONNX Runtime's own node is held to the same comparison:
    on x86-64 its one-row path gives other bits, which is what the comparison must catch."""
    rng = np.random.default_rng(1)
    n, start = 160, 120
    q = rng.standard_normal((n, HEADS * DIM), np.float32)
    k, v = (rng.standard_normal((n, KV_HEADS * DIM), np.float32) for _ in range(2))

    def outputs(session: ort.InferenceSession, sizes: list[int], offset: int = 0) -> np.ndarray:
        keys, values = (np.zeros((1, KV_HEADS, 192, DIM), np.float32) for _ in range(2))
        _forward(session, q[:start], k[:start], v[:start], keys, values, start)
        pos, out = start, []
        for s in sizes:
            view = (keys[:, :, offset:], values[:, :, offset:]) if offset else (keys, values)
            got = _forward(session, q[pos:pos + s], k[pos:pos + s], v[pos:pos + s],
                           *(np.ascontiguousarray(x) for x in view), pos + s - offset)
            if offset:  # written into the copies: carried back
                keys[:, :, offset:], values[:, :, offset:] = view
            out.append(got)
            pos += s
        return np.concatenate(out)

    ours = _session(attention.OP, window)
    alone = outputs(ours, [1] * 34)
    assert np.array_equal(alone, outputs(ours, [6, 17, 11]))
    assert np.array_equal(alone, outputs(ours, [17, 17]))
    if window > 0:
        assert np.array_equal(alone, outputs(ours, [1] * 34, offset=64))
    theirs = _session("GroupQueryAttention", window)
    if not np.array_equal(outputs(theirs, [1] * 34), outputs(theirs, [17, 17])):
        return  # the comparison tells forwards apart
    pytest.skip("ONNX Runtime's node computed one-row forwards alike here too: no negative control")


def _graph(nodes: list, head_dim: int = DIM) -> bytes:
    f = TensorProto.FLOAT
    names = {x for node in nodes for x in node.input if x}
    ins = [helper.make_tensor_value_info(x, f, [1, KV_HEADS, "n", head_dim] if x.startswith("past") else [1, "s"])
           for x in sorted(names)]
    outs = [helper.make_tensor_value_info(node.output[0], f, [1, "s"]) for node in nodes]
    model = helper.make_model(helper.make_graph(nodes, "g", ins, outs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return model.SerializeToString()


def _gqa(name: str, **attrs) -> object:
    inputs = [f"{name}_{x}" for x in ("q", "k", "v")] + ["past_k", "past_v", "seqlens", "total"]
    if attrs.get("do_rotary"):
        inputs += ["cos", "sin"]
    return helper.make_node("GroupQueryAttention", inputs, [f"{name}_out", f"{name}_pk", f"{name}_pv"], name=name,
                            domain="com.microsoft", **{"num_heads": HEADS, "kv_num_heads": KV_HEADS, **attrs})


def test_the_rewrite_replaces_the_nodes_the_kernel_computes_and_nothing_else() -> None:
    import onnx

    nodes = [_gqa("plain", local_window_size=WINDOW, scale=0.125, do_rotary=0, softcap=0.0),
             _gqa("rotary", do_rotary=1), _gqa("capped", softcap=30.0), _gqa("odd", num_heads=3, kv_num_heads=2),
             helper.make_node("Relu", ["x"], ["y"], name="relu")]
    before = _graph(nodes)
    after, count, everywhere = attention.rewrite(before, DIM, "float32")
    assert count == 1 and not everywhere  # three GroupQueryAttention nodes stay
    a, b = onnx.load_from_string(before), onnx.load_from_string(after)
    assert [(n.op_type, n.domain) for n in b.graph.node] == [
        (attention.OP, attention.DOMAIN), *[(n.op_type, n.domain) for n in a.graph.node[1:]]]
    assert b.graph.node[0].attribute == a.graph.node[0].attribute and b.graph.node[1:] == a.graph.node[1:]
    b.graph.node[0].op_type, b.graph.node[0].domain = a.graph.node[0].op_type, a.graph.node[0].domain
    assert b.graph == a.graph  # everything else byte for byte
    assert [(o.domain, o.version) for o in b.opset_import][-1] == (attention.DOMAIN, 1)
    # caches the kernel does not take: none rewritten
    for head_dim, dtype in ((80, "float32"), (1024, "float32"), (DIM, "float16")):
        assert attention.rewrite(_graph(nodes, head_dim), head_dim, dtype) == (_graph(nodes, head_dim), 0, False)


def test_the_kernels_graph_drops_the_previous_row_and_computes_what_it_computed_with_it(
        gguf_root, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gguf target's attention nodes run over the position before the forward's own as well
    (export/attention_steps.py); where the kernel runs, the rewrite gives them their own rows alone
    and removes what only fed the previous one. Each row's output is then bit for bit what it was
    with that row beside it, in prefill, steps and a verification-sized forward; the control, the
    graph as the kernel first took it, is the other engine."""
    import onnx

    from edge_sd.engines.ort import OrtEngine
    from edge_sd.manifest import load_engine_manifest

    folder = gguf_root / "pair" / "target"
    m = load_engine_manifest(folder)
    before = (folder / m.model_file).read_bytes()
    after, count, everywhere = attention.rewrite(before, m.head_dim, m.kv_dtype)
    gqa = [n for n in onnx.load_from_string(before).graph.node if n.op_type == "GroupQueryAttention"]
    assert count == len(gqa) > 0 and everywhere
    graph = onnx.load_from_string(after).graph
    made = {o: n for n in graph.node for o in n.output}
    kernel = [n for n in graph.node if n.op_type == attention.OP]
    assert len(kernel) == count
    for node in kernel:  # the query and key rows straight from their rotary embedding
        assert [made[x].op_type for x in node.input[:2]] == ["RotaryEmbedding"] * 2
    assert not any(n.op_type == "Concat" and set(n.output) & {x for k in kernel for x in k.input} for n in graph.node)
    assert len(graph.node) < len(onnx.load_from_string(before).graph.node) - 6 * count

    # One node the kernel does not take (a softcap): it stays ONNX Runtime's, so not every attention
    # is the kernel's and the engine keeps splitting its forwards.
    capped = onnx.load_from_string(before)
    first = next(n for n in capped.graph.node if n.op_type == "GroupQueryAttention")
    first.attribute.append(helper.make_attribute("softcap", 30.0))
    _, partly, not_everywhere = attention.rewrite(capped.SerializeToString(), m.head_dim, m.kv_dtype)
    assert partly == count - 1 and not not_everywhere

    monkeypatch.setenv(attention.ENV, "1")
    monkeypatch.setenv("EDGE_SD_RUNTIME_CACHE", "0")
    dropped = OrtEngine(folder, provider="cpu", threads=2)
    dropped.prepare()
    simplified = attention._simplified
    monkeypatch.setattr(attention, "_simplified", lambda g: ([raw for *_, raw in g], False))
    kept = OrtEngine(folder, provider="cpu", threads=2)
    kept.prepare()
    monkeypatch.setattr(attention, "_simplified", simplified)
    assert dropped.shared.attention_by_kernel and not kept.shared.attention_by_kernel
    ids = np.random.default_rng(5).integers(3, m.vocab_size, size=120)
    for e in (dropped, kept):
        e.reset()
    outs = []
    for e in (dropped, kept):
        rows = [e.forward(ids[:40]), *(e.forward(ids[i:i + 1]) for i in range(40, 90)), e.forward(ids[90:107])]
        outs.append(np.concatenate(rows))
    assert np.array_equal(outs[0], outs[1])
