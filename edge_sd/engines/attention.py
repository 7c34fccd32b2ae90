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
runs (C#, C++); a CPU load rewrites it (`rewrite`) before ONNX Runtime builds the session, and the
runtime cache keeps the rewritten graph (engines/prepared.py).

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


def identity(path: Path) -> str:
    """What a runtime cache built with this library records of it: another kernel builds it again.
    The library's folder is named after its source, compiler, flags and CPU (native.compiled)."""
    return path.parent.name


# The ONNX protobuf fields the rewrite reads and writes (onnx.proto): ModelProto.graph and
# .opset_import, GraphProto.node, NodeProto.op_type, .domain and .attribute, AttributeProto.name,
# .f and .i, OperatorSetIdProto.domain and .version.
_MODEL_GRAPH, _MODEL_OPSET, _GRAPH_NODE = 7, 8, 1
_NODE_INPUT, _NODE_OP, _NODE_DOMAIN, _NODE_ATTR = 1, 4, 7, 5
_ATTR_NAME, _ATTR_F, _ATTR_I = 1, 2, 3


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
                    attrs[name] = pv - (1 << 64) if pv >= 1 << 63 else pv
                elif pn == _ATTR_F and pk == 5:
                    attrs[name] = struct.unpack("<f", pv.to_bytes(4, "little"))[0]
    heads, kv = int(attrs.get(b"num_heads", 0)), int(attrs.get(b"kv_num_heads", 0))
    if attrs.get(b"do_rotary", 0) or attrs.get(b"softcap", 0.0) or attrs.get(b"smooth_softmax", 0) \
            or kv <= 0 or heads % kv or heads // kv > MAX_HEADS_PER_KV:
        return None
    renamed = {_NODE_OP: protobuf.field(_NODE_OP, OP.encode()),
               _NODE_DOMAIN: protobuf.field(_NODE_DOMAIN, DOMAIN.encode())}
    return b"".join(renamed.get(n, raw) for n, _, _, raw in parsed)


def rewrite(model: bytes, head_dim: int, kv_dtype: str) -> tuple[bytes, int]:
    """A serialized ONNX model with its GroupQueryAttention nodes that the kernel computes as they are
    used (`_node`; float32 caches, head_dim a multiple of 64 within the kernel's bound) replaced by
    CachedAttention nodes, and how many. Edited as protobuf, field by field, so that the runtime
    needs no `onnx` package; everything else is kept byte for byte."""
    if kv_dtype != "float32" or head_dim % 64 or not 0 < head_dim <= MAX_HEAD_DIM:
        return model, 0
    out, count = [], 0
    for n, k, v, raw in protobuf.fields(model):
        if n == _MODEL_GRAPH and k == 2:
            graph = []
            for gn, gk, gv, graw in protobuf.fields(v):
                node = _node(gv) if gn == _GRAPH_NODE and gk == 2 else None
                count += node is not None
                graph.append(graw if node is None else protobuf.field(_GRAPH_NODE, node))
            raw = protobuf.field(_MODEL_GRAPH, b"".join(graph))
        out.append(raw)
    if count:
        out.append(protobuf.field(_MODEL_OPSET, protobuf.field(1, DOMAIN.encode()) + protobuf.int_field(2, 1)))
    return b"".join(out), count
