"""Global attention layers of one key/value head, computed as one matrix product over all the heads.

ONNX Runtime's CPU GroupQueryAttention reads the shared key/value head once for each query head, so
a global layer's step costs about heads times the reads of its cache (Gemma-3-270M: 4 query heads
over one key/value head of 256, 3 of its 18 layers). Here the query rows of every head are stacked
into one [rows x heads, head_dim] matrix, which is multiplied by the cached keys (Gemm, keys
transposed), masked past each row's own position, normalized (Softmax) and multiplied by the cached
values (MatMul): each key and value is read once a step. Each output row is the same sum whatever
the forward's length or the cache's, so a one-position step computes what a verification forward
computes (export validation measures that, as for every graph).

The GroupQueryAttention node stays, to write the forward's keys and values into the shared buffer
(its attention output is no longer read); it counts its cache from `global_offset` (as the window
layers count theirs from `window_offset`, export/attention_steps.py), so that a host may bind it a
view that holds the last few positions only and its own attention costs nothing at depth. The
product reads the layer's whole cache from a second input over the same buffer, `whole.<past input>`
([1, 1, n, head_dim]: the buffer's first n positions, n at least the forward's last position plus
one). Positions from the forward's own on are masked by position, so a host may bind more of the
buffer than is written (edge-sd binds a multiple of 64 positions and rebinds as the text grows).
The product is made to read the buffer after the writer has run: its query rows are reshaped with
a shape read off the writer's output. The `whole.*` inputs have no default (an empty one would give
wrong attention, and switching between the two forms with an `If` made a step nearly three times
slower): onnxruntime-genai, which binds only the inputs it knows, is given the graph as it was
before this rewrite (`write_genai_graph`). edge-sd's own runtime, where its attention kernel runs,
computes a grouped layer's attention by that kernel over the whole cache instead (engines/attention.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from edge_sd.errors import ExportError
from edge_sd.export.attention_steps import PREFIX, count_from
from edge_sd.manifest import GLOBAL_INPUT, WHOLE_PREFIX

GLOBAL_PREFIX = "/global_view"
# The graph onnxruntime-genai runs where model.onnx takes inputs it does not bind (genai_config.json
# names it); it reads the same external weights file.
GENAI_GRAPH = "genai_model.onnx"


def write_genai_graph(folder: Path) -> None:
    """Keep the folder's graph as it is now for onnxruntime-genai: a copy that genai_config.json
    names (where there is one), before a rewrite that adds inputs genai does not bind."""
    import json
    import shutil

    config = folder / "genai_config.json"
    if not config.is_file():
        return
    shutil.copyfile(folder / "model.onnx", folder / GENAI_GRAPH)
    data = json.loads(config.read_text())
    data["model"]["decoder"]["filename"] = GENAI_GRAPH
    config.write_text(json.dumps(data, indent=4) + "\n")


def grouped_global(model_path: Path) -> list[str]:
    """Compute the global attention layers of one fp32 key/value head, in a graph whose attention
    reads the previous position back (export/attention_steps.py rewrite), as above. Returns the
    past-key inputs of those layers ([] where there are none)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from edge_sd.export.logits import save_graph

    model = onnx.load(str(model_path), load_external_data=False)
    g = model.graph
    by_name = {n.name: n for n in g.node}
    inputs = {i.name: i for i in g.input}
    inits = {i.name: i for i in g.initializer}
    rotary = {o: n for n in g.node if n.op_type == "RotaryEmbedding" for o in n.output}
    readers: dict[str, list[Any]] = {}
    for n in g.node:
        for x in n.input:
            readers.setdefault(x, []).append(n)
    chosen = []
    for node in g.node:
        if node.op_type != "GroupQueryAttention":
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        past = inputs.get(node.input[3])
        dropped = readers.get(f"{node.name}/with_previous", [])
        if attrs.get("local_window_size", -1) <= 0 and attrs.get("kv_num_heads") == 1 \
                and not attrs.get("softcap") and past is not None \
                and past.type.tensor_type.elem_type == TensorProto.FLOAT \
                and f"{node.name}/k_cached" in by_name and f"{node.name}/v_cached" in by_name \
                and f"{node.name}/q_rot" in rotary and rotary[f"{node.name}/q_rot"].input[2] in inits \
                and len(dropped) == 1 and dropped[0].op_type == "Slice":
            chosen.append((node, attrs, dropped[0].output[0]))
    if not chosen:
        return []
    count_from(model, [node for node, _, _ in chosen], GLOBAL_INPUT, GLOBAL_PREFIX, model_path)

    def const(name: str, values: Any, dtype: Any = np.int64) -> str:
        g.initializer.append(numpy_helper.from_array(np.array(values, dtype=dtype), f"{GLOBAL_PREFIX}/{name}"))
        return f"{GLOBAL_PREFIX}/{name}"

    minus_one, two, three, four = const("minus_one", [-1]), const("two", [2]), const("three", [3]), const("four", [4])
    zero, one, axes12 = const("zero", 0), const("one", 1), const("axes12", [1, 2])
    masked, kept = const("masked", -np.inf, np.float32), const("kept", 0.0, np.float32)
    replaced = {}
    for node, attrs, dropped_out in chosen:
        b = node.name
        heads = int(attrs["num_heads"])
        new: list[Any] = []

        def op(kind: str, ins: list[str], out: str, new: list[Any] = new, b: str = b, **kw: Any) -> str:
            name = f"{b}/grouped/{out}"
            new.append(helper.make_node(kind, ins, [name], name=name, **kw))
            return name

        head_dim = 2 * int(inits[rotary[f"{b}/q_rot"].input[2]].dims[1])  # the cos cache: head_dim / 2 wide
        whole = {}
        for what, i in (("key", 3), ("value", 4)):
            name = WHOLE_PREFIX + node.input[i]
            g.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT,
                                                         [1, 1, "whole_sequence_length", head_dim]))
            whole[what] = op("Flatten", [name], f"{what}_rows", axis=3)  # [n, head_dim]: a view
        # [1, s, heads * head_dim] -> [s * heads, head_dim], the shape read off the writer's output
        written = op("Shape", [node.output[1]], "written_shape")
        q_shape = op("Concat", [minus_one, op("Slice", [written, three, four], "head_dim")], "q_shape", axis=0)
        q = op("Reshape", [f"{b}/q_rot", q_shape], "q_rows")
        scale = float(attrs.get("scale") or 0.0) or 1.0 / float(np.sqrt(head_dim))
        scores = op("Gemm", [q, whole["key"]], "scores", alpha=scale, transB=1)  # [s * heads, n]
        n1 = op("Slice", [op("Shape", [WHOLE_PREFIX + node.input[3]], "whole_shape"), two, three], "n1")
        scores = op("Reshape", [scores, op("Concat", [minus_one, const(f"{b}_heads", [heads]), n1], "s_h_n",
                                          axis=0)], "scores_by_row")  # [s, heads, n]
        # Row r (position start + r) attends to positions 0..start + r.
        later = op("Greater", [op("Range", [zero, op("Squeeze", [n1], "n"), one], "columns"),
                               op("Unsqueeze", [f"{PREFIX}/range", axes12], "row_positions")], "later")
        bias = op("Where", [later, masked, kept], "mask")  # [s, 1, n]
        p = op("Softmax", [op("Add", [scores, bias], "masked_scores")], "p", axis=-1)
        out = op("MatMul", [p, whole["value"]], "out")  # [s, heads, head_dim]
        new.append(helper.make_node("Reshape", [out, op("Shape", [f"{b}/q_rot"], "out_shape")],
                                    [dropped_out], name=f"{b}/grouped/{dropped_out}"))
        replaced[dropped_out] = new  # the Slice that dropped the previous row's output: named after it
    ordered = [m for n in g.node for m in replaced.get(n.name, [n])]
    if sum(len(v) for v in replaced.values()) + len(g.node) - len(replaced) != len(ordered):
        raise ExportError(f"{model_path}: an attention output to replace was not found")
    del g.node[:]
    g.node.extend(ordered)
    write_genai_graph(model_path.parent)  # the graph on disk is still the one before
    save_graph(model, model_path)
    return [node.input[3] for node, _, _ in chosen]
