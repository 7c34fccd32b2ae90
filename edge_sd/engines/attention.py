"""Cached attention computed by edge-sd's own kernel, inside ONNX Runtime, in place of GroupQueryAttention.

ONNX Runtime's CPU GroupQueryAttention scores each query head against the cache on its own and runs a
few query rows through general matrix products that repack their operands at every call: once a
sliding-window layer holds its few hundred positions, its attention was most of what a step's time
grew by with depth (benchmarks/results/step_profile.md). The kernel here makes one pass over the keys
and values for every query head that shares them and for up to 16 query rows at once, in blocks of
16 keys, keeping each row's softmax running from block to block (benchmarks/cached_attention.py).

It is a custom operator, `CachedAttention` in the domain `edge_sd`, with GroupQueryAttention's inputs,
outputs and meaning as the exported graphs use it: the rotary embedding applied before it, float32,
past and present bound to one buffer (the new rows' keys and values are written into it at their
positions, then every row attends to the positions up to its own, the last `local_window_size` of
them where that is set). An engine's exported graph keeps the standard node, which any ONNX Runtime
runs (C#, C++); a CPU load rewrites it (`rewrite`, which also removes what the kernel makes
unneeded: below) before ONNX Runtime builds the session, and the runtime cache keeps the rewritten
graph (engines/prepared.py).

Each row's output is computed alike whatever the forward holds: its keys are scored and summed in
blocks that fall on multiples of 16 positions of the buffer it is given, in one fixed order, and a
block past a row's own position adds exact zeros. So a one-position step computes what a
verification forward computes for the same position, and a sliding-window view (whose offset is a
multiple of the window granule, 64 or more) what the whole buffer gives.

The kernel is compiled on first use (engines/native.py). It reaches ONNX Runtime through its C API,
whose function table only ever grows at its end: the positions used are those of version 17, which
added the thread pool's parallel-for. It runs where the CPU has AVX-512 (where it was measured);
EDGE_SD_ATTENTION=0 keeps ONNX Runtime's own node, =1 uses the kernel on any CPU. Export validation
measures the graph as exported, with ONNX Runtime's node (export/validate.py): the kernel keeps every
consistency that holds there.
"""

from __future__ import annotations

import os
import struct
import subprocess
import threading
from pathlib import Path
from typing import Any

from edge_sd.engines import native, protobuf
from edge_sd.engines.attention_source import SOURCE

ENV = "EDGE_SD_ATTENTION"
DOMAIN = "edge_sd"
OP = "CachedAttention"
MAX_HEADS_PER_KV = 16  # the kernel's bounds on query heads sharing a key/value head, and on head_dim
MAX_HEAD_DIM = 512


_lock = threading.Lock()
_built: list[tuple[Path | None, str]] = []  # the library's path or None, and why there is none


def library() -> tuple[Path | None, str]:
    """The compiled operator library and "", or None and why there is none (built once per machine)."""
    with _lock:
        if not _built:
            try:
                _built.append((native.compiled(SOURCE, "edge_sd_attention", "the attention kernel"), ""))
            except (OSError, subprocess.SubprocessError, RuntimeError) as e:
                _built.append((None, str(e)))
        return _built[0]


def wanted() -> tuple[Path | None, str]:
    """The library engines register with ONNX Runtime, or None and why not: EDGE_SD_ATTENTION=0 never,
    =1 on any CPU, unset where the CPU has AVX-512 (where the kernel was measured); and only where it
    builds."""
    choice = os.environ.get(ENV, "").strip()
    if choice == "0":
        return None, f"{ENV}=0"
    if choice != "1" and "avx512f" not in native.cpu_flags().split():
        return None, "this CPU has no AVX-512"
    return library()


# The form `rewrite` gives a graph: a runtime cache saved from another form is made again.
GRAPH_FORM = 2


def identity(path: Path) -> str:
    """What a runtime cache built with this library records of it: another kernel, or another form
    of the rewritten graph, builds it again. The library's folder is named after its source,
    compiler, flags and CPU (native.compiled)."""
    return f"{path.parent.name}/{GRAPH_FORM}"


# The ONNX protobuf fields the rewrite reads and writes (onnx.proto): ModelProto.graph and
# .opset_import, GraphProto.node, NodeProto.op_type, .domain and .attribute, AttributeProto.name,
# .f and .i, OperatorSetIdProto.domain and .version.
_MODEL_GRAPH, _MODEL_OPSET, _GRAPH_NODE, _GRAPH_OUTPUT, _VALUE_NAME = 7, 8, 1, 12, 1
_NODE_INPUT, _NODE_OUTPUT, _NODE_NAME, _NODE_OP, _NODE_DOMAIN, _NODE_ATTR = 1, 2, 3, 4, 7, 5
_ATTR_NAME, _ATTR_F, _ATTR_I, _ATTR_GRAPH, _ATTR_GRAPHS = 1, 2, 3, 6, 11


def _signed(value: int) -> int:
    """An int64 attribute's value from its varint (negative ones are written as 64-bit two's complement)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _node(data: bytes) -> bytes | None:
    """A NodeProto as CachedAttention, or None where it is not a GroupQueryAttention node the kernel
    computes as it is used: the rotary embedding applied before it, no softcap, seven inputs, query
    heads a multiple of the key/value heads within the kernel's bound."""
    parsed = protobuf.fields(data)
    text = {n: v for n, k, v, _ in parsed if k == 2 and n in (_NODE_OP, _NODE_DOMAIN)}
    if text.get(_NODE_OP) != b"GroupQueryAttention" or text.get(_NODE_DOMAIN) != b"com.microsoft":
        return None
    if sum(1 for n, k, v, _ in parsed if n == _NODE_INPUT and k == 2 and v) != 7:
        return None
    attrs: dict[bytes, float] = {}
    for n, k, v, _ in parsed:
        if n == _NODE_ATTR and k == 2:
            parts = protobuf.fields(v)
            name = next((pv for pn, _, pv, _ in parts if pn == _ATTR_NAME), b"")
            for pn, pk, pv, _ in parts:
                if pn == _ATTR_I and pk == 0:
                    attrs[name] = _signed(pv)
                elif pn == _ATTR_F and pk == 5:
                    attrs[name] = struct.unpack("<f", pv.to_bytes(4, "little"))[0]
    heads, kv = int(attrs.get(b"num_heads", 0)), int(attrs.get(b"kv_num_heads", 0))
    if attrs.get(b"do_rotary", 0) or attrs.get(b"softcap", 0.0) or attrs.get(b"smooth_softmax", 0) \
            or kv <= 0 or heads % kv or heads // kv > MAX_HEADS_PER_KV:
        return None
    renamed = {_NODE_OP: protobuf.field(_NODE_OP, OP.encode()),
               _NODE_DOMAIN: protobuf.field(_NODE_DOMAIN, DOMAIN.encode())}
    return b"".join(renamed.get(n, raw) for n, _, _, raw in parsed)


def rewrite(model: bytes, head_dim: int, kv_dtype: str) -> tuple[bytes, int, bool]:
    """A serialized ONNX model with its GroupQueryAttention nodes that the kernel computes as they are
    used (`_node`; float32 caches, head_dim a multiple of 64 within the kernel's bound) replaced by
    CachedAttention nodes and simplified where the kernel allows (below); how many; and whether the
    kernel now computes every attention of the graph (no GroupQueryAttention left, and every global
    layer's attention its own, not a grouped product's): then each row's logits are the same in any
    forward, and an engine need not split its forwards (engines/engine.py). Edited as protobuf,
    field by field, so that the runtime needs no `onnx` package; everything else is kept byte for
    byte."""
    if kv_dtype != "float32" or head_dim % 64 or not 0 < head_dim <= MAX_HEAD_DIM:
        return model, 0, False
    out, count, everywhere = [], 0, False
    for n, k, v, raw in protobuf.fields(model):
        if n == _MODEL_GRAPH and k == 2:
            graph = []
            for gn, gk, gv, graw in protobuf.fields(v):
                node = _node(gv) if gn == _GRAPH_NODE and gk == 2 else None
                count += node is not None
                graph.append((gn, gk, gv, graw) if node is None else (gn, gk, node, protobuf.field(_GRAPH_NODE, node)))
            parts, everywhere = _simplified(graph) if count else ([raw for *_, raw in graph], False)
            raw = protobuf.field(_MODEL_GRAPH, b"".join(parts))
        out.append(raw)
    if count:
        out.append(protobuf.field(_MODEL_OPSET, protobuf.field(1, DOMAIN.encode()) + protobuf.int_field(2, 1)))
    return b"".join(out), count, everywhere


# --- what the kernel makes unneeded ---------------------------------------------------------------
#
# An exported graph's attention nodes also run over the position before the forward's own, read back
# from the cache (export/attention_steps.py): ONNX Runtime's node computes one query row otherwise
# than several, and the extra row makes every step a forward of two. The kernel computes each row
# alike whatever else the forward holds, so where it runs that row is dropped again: the node takes
# the forward's own rows, its output is what the Slice after it kept, and the nodes that only fed the
# previous row go.
#
# A global layer's attention is computed apart, as one product over all its heads
# (export/grouped_attention.py), its node only writing the cache through a view of the last few
# positions. The kernel reads each key once for all heads too: its own output replaces the product's,
# and the engine binds it the whole cache (engines/engine.py, `attention_by_kernel`).

class _Node:
    def __init__(self, raw: bytes):
        self.parsed = protobuf.fields(raw)
        self.inputs = [v.decode() for n, k, v, _ in self.parsed if n == _NODE_INPUT and k == 2]
        self.outputs = [v.decode() for n, k, v, _ in self.parsed if n == _NODE_OUTPUT and k == 2]
        text = {n: v for n, k, v, _ in self.parsed if k == 2 and n in (_NODE_OP, _NODE_DOMAIN, _NODE_NAME)}
        self.name = text.get(_NODE_NAME, b"").decode()
        self.op = text.get(_NODE_OP, b"").decode()
        self.domain = text.get(_NODE_DOMAIN, b"").decode()
        self.changed = False

    def int_attribute(self, name: bytes) -> int | None:
        for n, k, v, _ in self.parsed:
            if n == _NODE_ATTR and k == 2:
                parts = protobuf.fields(v)
                if next((pv for pn, _, pv, _ in parts if pn == _ATTR_NAME), b"") == name:
                    return next((_signed(pv) for pn, pk, pv, _ in parts if pn == _ATTR_I and pk == 0), None)
        return None

    def has_subgraph(self) -> bool:
        return any(pn in (_ATTR_GRAPH, _ATTR_GRAPHS) for n, k, v, _ in self.parsed if n == _NODE_ATTR and k == 2
                   for pn, _, _, _ in protobuf.fields(v))

    def raw(self) -> bytes:
        """The node's bytes with its inputs and outputs as they now are, every other field as it was."""
        out, placed = [], set()
        for n, _, _, raw in self.parsed:
            if n in (_NODE_INPUT, _NODE_OUTPUT):
                if n not in placed:
                    placed.add(n)
                    names = self.inputs if n == _NODE_INPUT else self.outputs
                    out += [protobuf.field(n, x.encode()) for x in names]
            else:
                out.append(raw)
        return b"".join(out)


def _simplified(graph: list[tuple[int, int, Any, bytes]]) -> tuple[list[bytes], bool]:
    """A graph's fields, its CachedAttention nodes that run over the previous row (as
    export/attention_steps.py builds them) taking their own rows alone, those of global layers giving
    the output of the grouped product that stood beside them (named after it, as
    export/grouped_attention.py names it), and the nodes that then feed nothing removed; any node not
    in that form is kept as it is. Also whether every attention node is now the kernel's own, its
    output read."""
    nodes = {i: _Node(v) for i, (n, k, v, _) in enumerate(graph) if n == _GRAPH_NODE and k == 2}
    producer = {o: nodes[i] for i in nodes for o in nodes[i].outputs if o}
    readers: dict[str, list[_Node]] = {}
    for node in nodes.values():
        for x in node.inputs:
            readers.setdefault(x, []).append(node)
    dropped: set[int] = set()
    kernel = [node for node in nodes.values() if node.op == OP and node.domain == DOMAIN and len(node.inputs) >= 5]
    for node in kernel:
        _own_rows(node, producer, readers, dropped)
    # A grouped product's last node is named "<attention node>/grouped/<its output>". The engine gives
    # the kernel the whole cache only where every attention is the kernel's (`everywhere`): so every
    # product is replaced, or none.
    products = {p.name[: -len(f"/grouped/{p.outputs[0]}")]: p for p in nodes.values()
                if p.outputs and p.outputs[0] and p.name.endswith(f"/grouped/{p.outputs[0]}")}
    writers = [node for node in kernel if node.changed and not readers.get(node.outputs[0])]
    no_node = all(node.op != "GroupQueryAttention" for node in nodes.values())
    if no_node and all(node.name in products for node in writers):
        for node in writers:
            node.outputs[0] = products[node.name].outputs[0]
            dropped.add(id(products[node.name]))
    if not any(node.changed for node in kernel):
        return [raw for *_, raw in graph], False
    read = {_value_name(v) for n, k, v, _ in graph if n == _GRAPH_OUTPUT and k == 2}
    read.update(x for node in nodes.values() if id(node) not in dropped for x in node.inputs)
    everywhere = no_node and all(node.outputs[0] in read for node in kernel)
    # a subgraph (If, Loop) may read a tensor no node of this graph lists: nothing is pruned then
    return _rewired(graph, nodes, dropped, prune=not any(n.has_subgraph() for n in nodes.values())), everywhere


def _own_rows(node: _Node, producer: dict[str, _Node], readers: dict[str, list[_Node]], dropped: set[int]) -> None:
    """Give a CachedAttention node that also runs over the previous row its own rows alone: its query,
    key and value inputs each a Concat of the previous row (the query's first row sliced off, the
    key's and value's read back from its cache inputs) and the forward's own, its output read by the
    Slice that drops that row (which goes, into `dropped`) or by nothing (a global layer's)."""

    def made_by(name: str, op: str) -> _Node | None:
        found = producer.get(name)
        return found if found is not None and found.op == op and not found.domain else None

    def read_back(name: str, past: str) -> bool:
        """Whether `name` is rows sliced out of the cache input `past`, reshaped or transposed."""
        found = producer.get(name)
        while found is not None and found.op in ("Reshape", "Transpose") and not found.domain:
            found = producer.get(found.inputs[0])
        return found is not None and found.op == "Slice" and not found.domain and found.inputs[0] == past

    concats = [c for c in (made_by(x, "Concat") for x in node.inputs[:3])
               if c is not None and len(c.inputs) == 2 and c.int_attribute(b"axis") == 1]
    if len(concats) != 3:
        return
    cq, ck, cv = concats
    q_previous = made_by(cq.inputs[0], "Slice")
    kept = readers.get(node.outputs[0], [])
    if q_previous is None or q_previous.inputs[0] != cq.inputs[1] or len(q_previous.inputs) < 3 \
            or len(kept) > 1 or kept and (kept[0].op != "Slice" or kept[0].domain
                                          or kept[0].inputs[0] != node.outputs[0]
                                          or kept[0].inputs[1:2] != q_previous.inputs[2:3]) \
            or not read_back(ck.inputs[0], node.inputs[3]) or not read_back(cv.inputs[0], node.inputs[4]):
        return
    node.inputs[:3] = [cq.inputs[1], ck.inputs[1], cv.inputs[1]]
    if kept:
        node.outputs[0] = kept[0].outputs[0]
        dropped.add(id(kept[0]))
    node.changed = True


def _rewired(graph: list[tuple[int, int, Any, bytes]], nodes: dict[int, _Node], dropped: set[int],
             prune: bool) -> list[bytes]:
    """The graph's fields with the rewired nodes written anew, the dropped ones gone and, with `prune`,
    every node none of whose outputs is read (graph outputs count) gone too."""
    needed = {_value_name(v) for n, k, v, _ in graph if n == _GRAPH_OUTPUT and k == 2}
    keep: set[int] = set()
    for i in sorted(nodes, reverse=True):  # an ONNX graph's nodes are in topological order
        node = nodes[i]
        if id(node) in dropped:
            continue
        if not prune or any(o in needed for o in node.outputs if o):
            keep.add(i)
            needed.update(x for x in node.inputs if x)
    out = []
    for i, (_, _, _, raw) in enumerate(graph):
        if i not in nodes:
            out.append(raw)
        elif i in keep:
            out.append(protobuf.field(_GRAPH_NODE, nodes[i].raw()) if nodes[i].changed else raw)
    return out


def _value_name(value_info: bytes) -> str:
    return next((v.decode() for n, k, v, _ in protobuf.fields(value_info) if n == _VALUE_NAME and k == 2), "")
