"""One-position steps that compute what longer forwards compute: attention over at least two rows.

On x86-64, ONNX Runtime's GroupQueryAttention takes a path of its own for a single query row, which
rounds otherwise (about 1e-7 of its output), and a quantized graph's int8 activations round that into
a few hundredths of the logits' scale: a target whose plain steps fed one position would not compute
what a verification forward computes. Re-feeding the last cached position through the whole graph
(`min_step_positions` 2) fixes that at the price of a second row through every layer. Only the
attention needs the second row, and what it needs of it is already cached: the previous position's
key and value. So each GroupQueryAttention node here reads them back from the shared KV buffer and
runs over that row and the forward's own (the previous row's query is a copy of the first: its
output row is dropped, and in a kernel over two or more rows each row's result does not depend on the
others'). It writes the previous position's key and value back unchanged. The rotary embedding moves
out of the attention node (`RotaryEmbedding` on the forward's own rows, the same caches), since the
cached keys are stored rotated already. A forward from an empty cache has no previous position and
runs as it did.

The manifest says so (`previous_row_attention`); export validation then measures whether single steps
agree with longer forwards, and sets `min_step_positions` from that as for any graph.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from edge_sd.errors import ExportError
from edge_sd.export.gguf_graph import MS_DOMAIN
from edge_sd.manifest import WINDOW_INPUT

PREFIX = "/previous_row"


def rewrite(model_path: Path) -> int:
    """Rewrite every GroupQueryAttention node of the graph at model_path (its weights file untouched);
    returns how many."""
    import onnx

    from edge_sd.export.logits import save_graph

    model = onnx.load(str(model_path), load_external_data=False)
    count = rewrite_model(model, model_path)
    if count:
        save_graph(model, model_path)
    return count


def rewrite_model(model: Any, where: Path | str = "graph") -> int:
    """Rewrite the GroupQueryAttention nodes of a loaded model in place (`where` names it in errors);
    returns how many. Refuses attention nodes it cannot rewrite exactly, naming them."""
    from onnx import helper, numpy_helper

    g = model.graph
    nodes = [n for n in g.node if n.op_type == "GroupQueryAttention"]
    if not nodes:
        return 0
    inits = {i.name: i for i in g.initializer}
    inputs = {i.name for i in g.input}
    if "input_ids" not in inputs or "attention_mask" not in inputs:
        raise ExportError(f"{where}: expected inputs input_ids and attention_mask beside GroupQueryAttention")
    new: list[Any] = []

    def const(name: str, values: list[int] | int) -> str:
        g.initializer.append(numpy_helper.from_array(np.array(values, dtype=np.int64), f"{PREFIX}/{name}"))
        return f"{PREFIX}/{name}"

    def op(kind: str, ins: list[str], out: str, domain: str = "", **attrs: Any) -> str:
        new.append(helper.make_node(kind, ins, [out], name=out, domain=domain, **attrs))
        return out

    # The forward's geometry, once: s new positions after `start` cached, `prev` (0 or 1) the previous
    # position read back, `positions` [1, s] the new positions for the rotary embedding.
    one = const("one", 1)
    zero1, one1, two1, end1 = const("zero1", [0]), const("one1", [1]), const("two1", [2]), const("end1", [1 << 62])
    s = op("Gather", [op("Shape", ["input_ids"], f"{PREFIX}/ids_shape"), one], f"{PREFIX}/new", axis=0)
    total = op("Gather", [op("Shape", ["attention_mask"], f"{PREFIX}/mask_shape"), one], f"{PREFIX}/total", axis=0)
    start = op("Sub", [total, s], f"{PREFIX}/start")
    prev = op("Min", [start, one], f"{PREFIX}/prev")
    first = op("Sub", [start, prev], f"{PREFIX}/first")
    positions = op("Unsqueeze", [op("Range", [start, total, one], f"{PREFIX}/range"), zero1], f"{PREFIX}/positions")
    start1 = op("Unsqueeze", [start, zero1], f"{PREFIX}/start1")
    first1 = op("Unsqueeze", [first, zero1], f"{PREFIX}/first1")
    prev1 = op("Unsqueeze", [prev, zero1], f"{PREFIX}/prev1")

    rewritten = {}
    for node in nodes:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        ins = list(node.input) + [""] * (12 - len(node.input))
        if not attrs.get("do_rotary") or any(ins[9:]) or not ins[7] or not ins[8]:
            raise ExportError(f"{where}: {node.name}: expected GroupQueryAttention with its own rotary embedding "
                              "(cos and sin caches) and no further inputs")
        if ins[7] not in inits:
            raise ExportError(f"{where}: {node.name}: the rotary cos cache {ins[7]} is not an initializer")
        heads, kv_heads = int(attrs["num_heads"]), int(attrs["kv_num_heads"])
        head_dim = 2 * int(inits[ins[7]].dims[1])
        q, k, v, past_k, past_v, seqlens, total_len, cos, sin = ins[:9]
        b = node.name
        if not k and not v:  # packed: the query input holds query, key and value
            sizes = const(f"{b}/qkv_sizes", [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
            q, k, v = (f"{b}/{x}_unpacked" for x in "qkv")
            new.append(helper.make_node("Split", [ins[0], sizes], [q, k, v], name=f"{b}/qkv_split", axis=2))
        elif not k or not v:
            raise ExportError(f"{where}: {node.name}: a key input without a value input, or the reverse")
        interleaved = int(attrs.get("rotary_interleaved", 0))
        q_rot = op("RotaryEmbedding", [q, positions, cos, sin], f"{b}/q_rot", MS_DOMAIN, num_heads=heads,
                   interleaved=interleaved)
        k_rot = op("RotaryEmbedding", [k, positions, cos, sin], f"{b}/k_rot", MS_DOMAIN, num_heads=kv_heads,
                   interleaved=interleaved)
        shape = const(f"{b}/row_shape", [0, -1, kv_heads * head_dim])
        rows = {}
        for what, past in (("k", past_k), ("v", past_v)):
            # [1, kv_heads, capacity, head_dim] -> the previous position as [1, prev, kv_heads * head_dim]
            row = op("Slice", [past, first1, start1, two1], f"{b}/{what}_cached")
            if kv_heads > 1:
                row = op("Transpose", [row], f"{b}/{what}_cached_t", perm=[0, 2, 1, 3])
            rows[what] = op("Reshape", [row, shape], f"{b}/{what}_previous")
        q_in = op("Concat", [op("Slice", [q_rot, zero1, prev1, one1], f"{b}/q_previous"), q_rot], f"{b}/q_in",
                  axis=1)
        k_in = op("Concat", [rows["k"], k_rot], f"{b}/k_in", axis=1)
        v_in = op("Concat", [rows["v"], v], f"{b}/v_in", axis=1)
        attrs["do_rotary"] = 0
        attrs.pop("rotary_interleaved", None)
        full = f"{b}/with_previous"
        new.append(helper.make_node("GroupQueryAttention", [q_in, k_in, v_in, past_k, past_v, seqlens, total_len],
                                    [full, *node.output[1:]], name=b, domain=MS_DOMAIN, **attrs))
        op("Slice", [full, prev1, end1, one1], node.output[0])
        rewritten[id(node)] = list(new)  # the first layer's list starts with the shared nodes
        new.clear()
    ordered = [m for n in g.node for m in rewritten.get(id(n), [n])]
    del g.node[:]
    g.node.extend(ordered)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return len(nodes)


# --- sliding-window layers over a view of their cache ---------------------------------------------
#
# GroupQueryAttention scores every cached position and zeroes those outside a sliding window, so a
# window layer's work grows with the whole context. Rotated before they are cached (above), keys and
# values do not depend on where in a buffer they sit: a window layer may as well be given a view of
# its buffer that starts `window_offset` positions in, as long as the view holds every position its
# rows attend to. The engine binds such views (engines/engine.py); these nodes turn the forward's
# geometry into the view's.

WINDOW_PREFIX = "/window_view"


def window_views(model_path: Path) -> tuple[list[str], int]:
    """Make the sliding-window attention nodes of a graph rewritten above read their cache from
    `window_offset` positions in (an int64 scalar input, 0 unless bound: a host that does not bind it
    runs as before). Returns the past-key inputs of those nodes and their window, ([], 0) where there
    are none. Only single-head caches: a view of a [1, heads, capacity, dim] buffer from an offset is
    one block of memory only with one head."""
    import onnx
    from onnx import helper

    from edge_sd.export.logits import save_graph

    model = onnx.load(str(model_path), load_external_data=False)
    g = model.graph
    by_name = {n.name: n for n in g.node}
    chosen = []
    for node in g.node:
        if node.op_type != "GroupQueryAttention":
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("local_window_size", -1) > 0 and attrs.get("kv_num_heads") == 1 \
                and f"{node.name}/k_cached" in by_name and f"{node.name}/v_cached" in by_name:
            chosen.append((node, int(attrs["local_window_size"])))
    if not chosen:
        return [], 0
    windows = {w for _, w in chosen}
    if len(windows) > 1:
        raise ExportError(f"{model_path}: sliding windows of several sizes ({sorted(windows)}): not supported")
    count_from(model, [node for node, _ in chosen], WINDOW_INPUT, WINDOW_PREFIX, model_path)
    save_graph(model, model_path)
    return [node.input[3] for node, _ in chosen], windows.pop()


def count_from(model: Any, nodes: list[Any], offset_input: str, prefix: str, where: Path | str) -> None:
    """Make these attention nodes (rewritten above) count their cache from `offset_input` positions
    in: an int64 scalar input added with a default of 0, so that a host that does not bind it runs
    them as before. Their sequence lengths and the previous position's reads shift by the offset."""
    from onnx import TensorProto, helper, numpy_helper

    g = model.graph
    by_name = {n.name: n for n in g.node}
    g.input.append(helper.make_tensor_value_info(offset_input, TensorProto.INT64, []))
    g.initializer.append(numpy_helper.from_array(np.array(0, dtype=np.int64), offset_input))
    new: list[Any] = []
    shifted: dict[str, str] = {}  # a geometry tensor -> the same counted from the offset

    def shift(name: str, offset: str) -> str:
        if name not in shifted:
            shifted[name] = f"{prefix}/{name.strip('/').replace('/', '_')}"
            new.append(helper.make_node("Sub", [name, offset], [shifted[name]], name=shifted[name]))
        return shifted[name]

    offset32 = f"{prefix}/offset_int32"
    new.append(helper.make_node("Cast", [offset_input], [offset32], name=offset32, to=TensorProto.INT32))
    for node in nodes:
        # seqlens_k (int32 [1]) and total_sequence_length (int32 scalar), counted in the view
        node.input[5], node.input[6] = shift(node.input[5], offset32), shift(node.input[6], offset32)
        for what in ("k", "v"):  # the previous position read back: [first, start) in the view
            read = by_name[f"{node.name}/{what}_cached"]
            read.input[1], read.input[2] = shift(read.input[1], offset_input), shift(read.input[2], offset_input)
    # The new nodes read tensors computed once for the whole graph: they go in before the first node
    # that reads what they compute, which comes after those tensors are made.
    order = list(g.node)
    made_at = {o: i for i, n in enumerate(order) for o in n.output}
    first = min(i for i, n in enumerate(order) if any(x in shifted.values() for x in n.input))
    if max(made_at.get(x, -1) for x in shifted) >= first:
        raise ExportError(f"{where}: the attention's geometry is computed after its first use")
    del g.node[:]
    g.node.extend(order[:first] + new + order[first:])
