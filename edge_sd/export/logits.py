"""Graph edits at the LM head, shared by `logits_to_keep` and `split_lm_head` (here) and pruning
(prune.py).

`logits_to_keep` (an int64 input of shape [1]) makes the graph compute logits for the last n
positions only, as transformers' argument of that name does. A prompt's prefill needs at most the
last position's logits (the target's are not read at all), and the LM head over every prompt position
was half of it: Gemma-3-270M's head (640 x 262,144) over 120 positions is a 20 GFLOP MatMul, which
one position cuts to 0.2 GFLOP. A graph without the input still runs (logits for every position).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from edge_sd.errors import ExportError
from edge_sd.manifest import KEEP_INPUT

# An LM head whose weight is larger than this is computed in parts of at most this size
# (split_lm_head): 65,536 rows of Gemma-3-270M's 8-bit head, 16,384 of its fp32 head. A launch's
# transient memory grows with a part's size; smaller parts cost an fp32 head's multi-position
# forwards a little time (benchmarks/results/startup.md).
HEAD_PART_BYTES = 40 << 20
PART_ALIGN = 64

# The elementwise ops that may sit between the LM head's MatMul and the logits output (Gemma-2's final
# soft-capping: Div, Tanh, Mul); they do not care about the vocabulary width.
ELEMENTWISE = {"Div", "Mul", "Tanh", "Cast", "Add", "Sub"}


def load(path: Path) -> Any:
    """The ONNX model at path, its weights loaded (hard-linked weights, as in a copied pair folder, are
    unlinked first: onnx refuses them)."""
    import onnx

    for f in path.parent.glob(f"{path.name}*"):
        if f.stat().st_nlink > 1:
            tmp = f.with_name(f.name + ".copy")
            shutil.copyfile(f, tmp)
            tmp.replace(f)
    return onnx.load(str(path))


def save(model: Any, path: Path) -> None:
    """Write the model over path, its weights in one external data file beside it."""
    import onnx

    data = f"{path.name}.data"
    for f in path.parent.glob(f"{path.name}*"):
        f.unlink()
    onnx.save_model(model, str(path), save_as_external_data=True, location=data, size_threshold=1024)
    for f in (path, path.parent / data):
        if f.exists():
            os.chmod(f, 0o644)


def save_graph(model: Any, path: Path) -> None:
    """Write a model loaded without its weights over path, the weights file beside it untouched."""
    import onnx

    tmp = path.with_name(path.name + ".partial")
    onnx.save_model(model, str(tmp))
    os.chmod(tmp, 0o644)
    tmp.replace(path)  # a new file: a hard-linked copy of the old one (a copied pair folder) keeps it


def lm_head(graph: Any, path: Path) -> tuple[Any, list[Any]]:
    """The node computing the LM head (a MatMul or MatMulNBits) and the elementwise ops between it and
    the logits output (nearest the output first)."""
    producer = {o: n for n in graph.node for o in n.output}
    if not any(o.name == "logits" for o in graph.output) or "logits" not in producer:
        raise ExportError(f"{path} has no 'logits' output")
    node, chain = producer["logits"], []
    while node.op_type in ELEMENTWISE:
        chain.append(node)
        node = producer.get(node.input[0])
        if node is None:
            raise ExportError(f"{path}: the logits come from no MatMul that edge-sd can edit")
    if node.op_type not in ("MatMul", "MatMulNBits"):
        raise ExportError(f"{path}: the LM head is a {node.op_type}, which edge-sd cannot edit")
    return node, chain


def drop_shapes(graph: Any, nodes: list[Any]) -> None:
    """Forget the recorded shapes of these nodes' outputs (an edit changed them; ORT infers them)."""
    stale = {o for n in nodes for o in n.output}
    for vi in [v for v in graph.value_info if v.name in stale]:
        graph.value_info.remove(vi)


def add_logits_to_keep(path: Path) -> bool:
    """Give the model at path a `logits_to_keep` input that slices the hidden states before the LM
    head to the last n positions (0, its default: all of them). Returns False when it has one already.

    Only the graph file is rewritten: the weights beside it are neither read nor written (the new
    constants are a few bytes, kept inline)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(path), load_external_data=False)
    g = model.graph
    if any(i.name == KEEP_INPUT for i in g.input):
        return False
    node, chain = lm_head(g, path)
    hidden = node.input[0]
    # An input with an initializer of its name is optional: a caller that does not feed it (ONNX
    # Runtime's generate API reading the builder's genai_config.json) gets 0, every position.
    g.input.append(helper.make_tensor_value_info(KEEP_INPUT, TensorProto.INT64, [1]))
    g.initializer.extend(numpy_helper.from_array(np.array([v], dtype=np.int64), name) for v, name in
                         ((0, KEEP_INPUT), (np.iinfo(np.int64).max, "logits_to_keep.end"), (1, "logits_to_keep.axis")))
    kept = f"{hidden}.kept"
    at = list(g.node).index(node)
    g.node.insert(at, helper.make_node("Slice", [hidden, f"{KEEP_INPUT}.start", "logits_to_keep.end",
                                                 "logits_to_keep.axis"], [kept], name="logits_to_keep.slice"))
    g.node.insert(at, helper.make_node("Neg", [KEEP_INPUT], [f"{KEEP_INPUT}.start"], name="logits_to_keep.neg"))
    node.input[0] = kept
    drop_shapes(g, [node, *chain])
    save_graph(model, path)
    return True


def nbits_like(node: Any, inputs: list[str], output: str, name: str, n: int) -> Any:
    """A MatMulNBits node with `node`'s kernel settings over other inputs, computing n output columns."""
    from onnx import helper

    made = helper.make_node("MatMulNBits", inputs, [output], name=name, domain=node.domain)
    made.attribute.extend(a for a in node.attribute if a.name != "N")
    made.attribute.append(helper.make_attribute("N", n))
    return made


def split_lm_head(path: Path, rows: int | None = None) -> int:
    """Compute an LM head of more than `rows` rows (vocabulary entries; by default as many as
    HEAD_PART_BYTES of its weight hold) in parts, their logits concatenated: a MatMulNBits in the
    gguf export's layout (scales [N, blocks]) as MatMulNBits over row ranges of the same initializers
    (Slices, which ONNX Runtime folds while optimizing; only the graph file is rewritten), an fp32
    MatMul over an initializer [K, N] as MatMuls over initializers of their own, one per column range
    (the weights file is rewritten: `_matmul_parts`). Other layouts are left as they are. Returns the
    number of parts (1: left as it was).

    Why: ONNX Runtime repacks such a weight while it builds a session, and where the repacked copy was
    saved beside the engine (engines/prepared.py) it still computes the copy to find the saved one
    (by the copy's hash), and lets go of the copy and the weight it was packed from only when that
    weight is done. A 262k-row head's copies, the weight's and the saved one's pages, are the peak of a
    launch's memory; in parts, one part's are held at a time.
    Each logit is the same dot product over the same input row either way (tests/test_gguf.py and
    tests/test_export.py compare a split head's logits with the whole head's, bit for bit)."""
    import math

    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(path), load_external_data=False)
    g = model.graph
    if any(n.op_type == "Concat" and "logits" in n.output for n in g.node):
        return 1  # in parts already
    node, chain = lm_head(g, path)
    inits = {i.name: i for i in g.initializer}
    weights = list(node.input[1:])
    if chain or any(w not in inits or not inits[w].dims for w in weights):
        return 1
    if node.op_type == "MatMulNBits":
        n = int({a.name: helper.get_attribute_value(a) for a in node.attribute}.get("N", 0))
        if (not 2 <= len(weights) <= 3 or any(inits[w].dims[0] != n for w in weights)
                or len(inits[weights[1]].dims) != 2):
            return 1
        row_bytes = math.prod(inits[weights[0]].dims[1:])  # uint8 blocks
    else:  # MatMul
        w = inits[weights[0]] if len(weights) == 1 else None
        if w is None or len(w.dims) != 2 or w.data_type != onnx.TensorProto.FLOAT:
            return 1
        n, row_bytes = int(w.dims[1]), 4 * int(w.dims[0])
    rows = rows or max(PART_ALIGN, HEAD_PART_BYTES // max(row_bytes, 1))
    if n <= rows:
        return 1
    # Parts of a multiple of 64 rows: the kernel computes the columns of a tile that N leaves over
    # otherwise than full tiles (measured on the tiny test target, parts of 171 rows), and a multiple
    # of 64 keeps every part's tiles where the whole head's were.
    size = math.ceil(math.ceil(n / math.ceil(n / rows)) / PART_ALIGN) * PART_ALIGN
    ranges = [(lo, min(n, lo + size)) for lo in range(0, n, size)]
    if node.op_type == "MatMul":
        return _matmul_parts(path, node.name, ranges)
    at = list(g.node).index(node)
    base = node.name
    g.initializer.append(numpy_helper.from_array(np.array([0], np.int64), f"{base}/part_axes"))
    new, outputs = [], []
    for p, (lo, hi) in enumerate(ranges):
        g.initializer.extend([numpy_helper.from_array(np.array([lo], np.int64), f"{base}/part{p}_start"),
                              numpy_helper.from_array(np.array([hi], np.int64), f"{base}/part{p}_end")])
        bounds = [f"{base}/part{p}_start", f"{base}/part{p}_end", f"{base}/part_axes"]
        sliced = [f"{w}/part{p}" for w in weights]
        for w, part_w in zip(weights, sliced, strict=True):
            new.append(helper.make_node("Slice", [w, *bounds], [part_w], name=f"{part_w}/Slice"))
        part = nbits_like(node, [node.input[0], *sliced], f"{node.output[0]}/part{p}", f"{base}_part{p}", hi - lo)
        new.append(part)
        outputs.append(part.output[0])
    new.append(helper.make_node("Concat", outputs, [node.output[0]], axis=-1, name=f"{base}/Concat"))
    drop_shapes(g, [node])
    g.node.remove(node)
    for i, nd in enumerate(new):
        g.node.insert(at + i, nd)
    save_graph(model, path)
    return len(ranges)


def _matmul_parts(path: Path, name: str, ranges: list[tuple[int, int]]) -> int:
    """The MatMul head `name` over initializers of its own, one per column range. Slices of the
    weight would do in the graph, but ONNX Runtime folds them into copies while the weight is mapped
    at an engine's first load, which then holds the head twice over. Whatever else reads the weight (a
    tied embedding's Transpose) reads a Concat of the parts: folded at the first load as the Transpose
    is, into the table the lookup reads."""
    from onnx import helper, numpy_helper

    model = load(path)
    g = model.graph
    node = next(nd for nd in g.node if nd.name == name)
    weight = next(i for i in g.initializer if i.name == node.input[1])
    w = numpy_helper.to_array(weight)
    g.initializer.remove(weight)
    parts = [f"{weight.name}/part{p}" for p in range(len(ranges))]
    g.initializer.extend(numpy_helper.from_array(np.ascontiguousarray(w[:, lo:hi]), part)
                         for part, (lo, hi) in zip(parts, ranges, strict=True))
    del w
    at = list(g.node).index(node)
    made = [helper.make_node("MatMul", [node.input[0], part], [f"{node.output[0]}/part{p}"], name=f"{name}_part{p}")
            for p, part in enumerate(parts)]
    made.append(helper.make_node("Concat", [m.output[0] for m in made], [node.output[0]], axis=-1,
                                 name=f"{name}/Concat"))
    drop_shapes(g, [node])
    g.node.remove(node)
    for i, nd in enumerate(made):
        g.node.insert(at + i, nd)
    if any(weight.name in nd.input for nd in g.node):
        g.node.insert(0, helper.make_node("Concat", parts, [weight.name], axis=1, name=f"{weight.name}/Concat"))
    save(model, path)
    return len(ranges)


def expose_head(path: Path) -> dict:
    """Let the runtime compute the LM head itself where the graph's is an 8-bit MatMulNBits over blocks
    of 32 with the default zero point and scales that halves hold (a GGUF file's Q8_0 head), whole or
    in parts of one weight, behind `logits_to_keep`: the hidden states it reads become a graph output
    too, and the return is the manifest's `lm_head` (engines/lm_head.py; {} for any other head, the
    graph left as it was). Only the graph file is rewritten: the record points into the weights file
    as it stands."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(path), load_external_data=False)
    g = model.graph
    producer = {o: n for n in g.node for o in n.output}
    inits = {i.name: i for i in g.initializer}
    top = producer.get("logits")
    parts = [producer.get(i) for i in top.input] if top is not None and top.op_type == "Concat" else [top]
    if any(p is None or p.op_type != "MatMulNBits" or len(p.input) != 3 for p in parts):
        return {}
    sources, at = [], 0
    for p in parts:
        a = {t.name: helper.get_attribute_value(t) for t in p.attribute}
        if a.get("bits") != 8 or a.get("block_size") != 32 or p.input[0] != parts[0].input[0]:
            return {}
        names, ranges = [], set()
        for name in p.input[1:]:
            cut = producer.get(name)
            if name in inits:
                names.append(name)
                ranges.add((0, int(a["N"])))
            elif cut is not None and cut.op_type == "Slice" and cut.input[0] in inits and len(cut.input) >= 3:
                lo, hi = (int(numpy_helper.to_array(inits[i])[0]) for i in cut.input[1:3])
                names.append(cut.input[0])
                ranges.add((lo, hi))
            else:
                return {}
        if ranges != {(at, at + int(a["N"]))}:
            return {}
        at += int(a["N"])
        sources.append(tuple(names))
    if len(set(sources)) != 1:
        return {}
    weight, scales = (inits[n] for n in sources[0])
    rows, cols = int(weight.dims[0]), int(weight.dims[1]) * 32
    if (at != rows or list(weight.dims) != [rows, cols // 32, 32] or weight.data_type != TensorProto.UINT8
            or list(scales.dims) != [rows, cols // 32] or scales.data_type != TensorProto.FLOAT):
        return {}
    keep = producer.get(parts[0].input[0])
    if keep is None or keep.name != "logits_to_keep.slice":
        return {}  # without logits_to_keep the graph's head could not be skipped
    where = []
    for init in (weight, scales):
        info = {e.key: e.value for e in init.external_data}
        if init.data_location != TensorProto.EXTERNAL or "location" not in info:
            return {}
        where.append((info["location"], [int(info.get("offset", 0)), int(info["length"])]))
    if where[0][0] != where[1][0]:
        return {}
    offset, length = where[1][1]
    values = np.fromfile(path.parent / where[1][0], dtype=np.float32, count=length // 4, offset=offset)
    if not np.array_equal(values.astype(np.float16).astype(np.float32), values):
        return {}  # the runtime's kernel keeps scales as halves, as GGUF blocks carry them
    hidden = keep.input[0]
    if not any(o.name == hidden for o in g.output):
        g.output.append(helper.make_tensor_value_info(hidden, TensorProto.FLOAT, None))
        save_graph(model, path)
    return {"output": hidden, "rows": rows, "cols": cols, "file": where[0][0], "weight": where[0][1],
            "scales": where[1][1]}


def float32_logits(path: Path) -> bool:
    """Cast fp16 logits to float32 inside the graph (the model builder's fp16 and int4 graphs for CUDA
    give fp16 logits). Returns False when they are float32 already.

    The runtime reads every row on the host, and numpy has no fast float16 kernels (an argmax over a
    row of fp16 logits is scalar code), while a Cast on the GPU costs microseconds. Only the graph
    file is rewritten."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(path), load_external_data=False)
    g = model.graph
    out = next((o for o in g.output if o.name == "logits"), None)
    if out is None:
        raise ExportError(f"{path} has no 'logits' output")
    if out.type.tensor_type.elem_type != TensorProto.FLOAT16:
        return False
    for n in g.node:
        n.output[:] = ["logits.fp16" if o == "logits" else o for o in n.output]
        n.input[:] = ["logits.fp16" if i == "logits" else i for i in n.input]
    g.node.append(helper.make_node("Cast", ["logits.fp16"], ["logits"], to=TensorProto.FLOAT, name="logits.float32"))
    out.type.tensor_type.elem_type = TensorProto.FLOAT
    save_graph(model, path)
    return True


def keep_logits(engine_dir: Path) -> bool:
    """add_logits_to_keep on an exported engine folder, its manifest following (inputs, file hashes).
    Returns False when it had the input already."""
    from dataclasses import replace

    from edge_sd.manifest import file_entries, load_engine_manifest
    from edge_sd.manifest import save as save_manifest

    m = load_engine_manifest(engine_dir)
    if not add_logits_to_keep(engine_dir / m.model_file):
        return False
    save_manifest(replace(m, input_names=[*m.input_names, KEEP_INPUT], files=file_entries(engine_dir)), engine_dir)
    return True
