"""Make a model builder's fp32 graph of a GGUF file compute with the file's own quantized weights.

The fp32 graph is the GGUF dequantized (transformers reads the file through `gguf`), so each of its
weight matrices is, row for row, rows of GGUF tensors: one tensor, a fused projection of several
(q, k and v in one MatMul), or rows in another order (llama.cpp permutes the rows of Llama's q and
k). Rows are matched by value (a hash, then exact comparison), which needs no table of tensor
names per architecture. Each matched MatMul becomes a MatMulNBits over the rows' own blocks
(export/ggml.py): integer values, scales and zero points as stored, and for formats with a minimum
an exact correction outside the kernel, since x . (s*q + o) over a block = s*(x . q) + o*sum(x):

    y = MatMulNBits(x) + MatMul(ReduceSum(x per block), offsets)

ONNX Runtime's MatMulNBits with float zero points would carry the minimum directly, but runs a slow
fallback. A tied embedding becomes a GatherBlockQuantized over the LM head's quantized table, so the
vocabulary is held once, quantized.

What is not matched stays as it is: a weight kept in float in the file (F32, F16, BF16) is already
exact in the fp32 graph. A weight that is neither is refused: the graph would compute with
something the file does not hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edge_sd.errors import ExportError
from edge_sd.export.ggml import FLOAT_TYPES, Blocks, concat, unpack

MS_DOMAIN = "com.microsoft"


@dataclass
class _Source:
    """One GGUF matrix: its blocks (None for a float type) and its weights as the fp32 graph has them."""

    name: str
    type_name: str
    blocks: Blocks | None
    weights: np.ndarray  # [rows, cols] float32


@dataclass
class Report:
    """What the rewrite did: the figures the manifest records."""

    nodes: int = 0  # MatMuls now computing with the file's blocks
    embedding: str = ""  # how the token embedding is read
    offset_nodes: int = 0  # of those, with the per-block offset correction
    float_nodes: int = 0  # MatMuls left in float (the file's weight is a float type)
    fused_nodes: int = 0  # MatMulNBits nodes each computing several MatMuls that read one input
    types: dict[str, int] = field(default_factory=dict)  # weights carried, by GGML type
    checked_weights: int = 0  # weights compared with gguf's dequantization (all equal, or an error)

    def to_dict(self) -> dict:
        return {"quantized_matmuls": self.nodes, "offset_corrections": self.offset_nodes,
                "float_matmuls": self.float_nodes, "fused_matmuls": self.fused_nodes,
                "embedding": self.embedding, "weights_by_type": self.types,
                "weights_equal_to_gguf_dequantization": self.checked_weights}


class _Index:
    """The GGUF file's matrices, unpacked on demand, with a row hash table per row width."""

    def __init__(self, path: Path):
        from gguf import GGUFReader

        self.reader = GGUFReader(str(path))
        self.tensors = {t.name: t for t in self.reader.tensors if len(t.shape) == 2}
        self._sources: dict[str, _Source] = {}
        self._tables: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, list[_Source]]] = {}
        self._mix = np.random.default_rng(0).integers(1, 2**63, size=1 << 16, dtype=np.uint64) | np.uint64(1)

    def source(self, name: str) -> _Source:
        if name not in self._sources:
            import gguf

            t = self.tensors[name]
            cols = int(t.shape[0])  # GGUF lists dimensions innermost first
            kind = t.tensor_type.name
            if kind in FLOAT_TYPES:  # BF16 arrives as its raw 16-bit words: gguf converts them
                w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(-1, cols).astype(np.float32)
                self._sources[name] = _Source(name, kind, None, w)
            else:
                raw = np.asarray(t.data)
                blocks = unpack(name, kind, raw, cols)
                w = blocks.weights()
                ref = gguf.quants.dequantize(raw, t.tensor_type).reshape(w.shape)
                if not np.array_equal(w.view(np.uint32), ref.view(np.uint32)):
                    bad = int((w != ref).sum())
                    raise ExportError(f"GGUF tensor {name} ({kind}): {bad} unpacked weights differ from gguf's "
                                      "dequantization (a bug in edge-sd's reading of this format)")
                self._sources[name] = _Source(name, kind, blocks, w)
        return self._sources[name]

    def _hash(self, rows: np.ndarray) -> np.ndarray:
        bits = np.ascontiguousarray(rows, dtype=np.float32).view(np.uint32).astype(np.uint64)
        return (bits * self._mix[: rows.shape[1]]).sum(axis=1)  # wraps around: a hash, checked after

    def _table(self, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[_Source]]:
        """Sorted row hashes of every matrix `cols` wide, with each hash's source and row."""
        if cols not in self._tables:
            sources = [self.source(n) for n, t in self.tensors.items() if int(t.shape[0]) == cols]
            hashes = [self._hash(s.weights) for s in sources]
            which = np.concatenate([np.full(len(h), i) for i, h in enumerate(hashes)]) if sources else np.zeros(0, int)
            rows = np.concatenate([np.arange(len(h)) for h in hashes]) if sources else np.zeros(0, int)
            flat = np.concatenate(hashes) if sources else np.zeros(0, np.uint64)
            order = np.argsort(flat, kind="stable")
            self._tables[cols] = (flat[order], which[order], rows[order], sources)
        return self._tables[cols]

    def find(self, w: np.ndarray, what: str) -> list[tuple[_Source, np.ndarray]]:
        """The GGUF rows that make up w [rows, cols], as runs of (source, its row indices) in w's row
        order. Raises ExportError when a row is in no tensor of the file."""
        hashes, which, rows, sources = self._table(w.shape[1])
        h = self._hash(w)
        at = np.searchsorted(hashes, h)
        found = (at < len(hashes)) & (hashes[np.minimum(at, len(hashes) - 1)] == h)
        if not found.all():
            raise ExportError(f"{what}: {int((~found).sum())} of its {len(w)} rows are in no tensor of the GGUF file "
                              "(the graph computes with weights the file does not hold); export with --precision fp32")
        src, row = which[at], rows[at]
        runs: list[tuple[_Source, np.ndarray]] = []
        start = 0
        for i in range(1, len(src) + 1):
            if i == len(src) or src[i] != src[start]:
                s = sources[src[start]]
                idx = row[start:i]
                if not np.array_equal(s.weights[idx].view(np.uint32), w[start:i].view(np.uint32)):
                    raise ExportError(f"{what}: rows {start}..{i - 1} match {s.name} by hash but not by value")
                runs.append((s, idx))
                start = i
        return runs


def _pack(b: Blocks) -> tuple[np.ndarray, np.ndarray | None]:
    """MatMulNBits' B [N, blocks, bytes per block] and zero points (None: the kernel's default)."""
    n, k = b.shape
    nb = k // b.block
    if b.bits == 8:
        # q - z (Q5_0's and Q6_K's values are centred on 16 and 32, Q8_0's on 0) fits a signed byte:
        # stored shifted onto the kernel's default zero point 128, the same integers times the same
        # scales with no zero-point tensor to read.
        centred = b.q.astype(np.int16) - np.repeat(b.zero, b.block, axis=1).astype(np.int16)
        if centred.min(initial=0) >= -128 and centred.max(initial=0) <= 127:
            return np.ascontiguousarray((centred + 128).astype(np.uint8).reshape(n, nb, b.block)), None
        data = b.q.reshape(n, nb, b.block)
        zero = b.zero
    else:
        q = b.q.reshape(n, nb, b.block // 2, 2)
        data = q[..., 0] | (q[..., 1] << 4)
        z = b.zero if nb % 2 == 0 else np.concatenate([b.zero, np.zeros((n, 1), np.uint8)], axis=1)
        zero = z[:, 0::2] | (z[:, 1::2] << 4)
    default = 1 << (b.bits - 1)
    return np.ascontiguousarray(data, dtype=np.uint8), None if (b.zero == default).all() else zero


def _unpack_packed(data: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, bits: int, block: int,
                   offset: np.ndarray | None) -> np.ndarray:
    """The weights [N, K] the written initializers define (the check on _pack's layout)."""
    n = data.shape[0]
    if bits == 8:
        q = data.reshape(n, -1)
        z = np.full(scale.shape, 128, np.uint8) if zero is None else zero
    else:
        q = np.stack([data & 0x0F, data >> 4], axis=-1).reshape(n, -1)
        z = np.full(scale.shape, 8, np.uint8) if zero is None else np.stack(
            [zero & 0x0F, zero >> 4], axis=-1).reshape(n, -1)[:, : scale.shape[1]]
    return Blocks(q, scale, z, offset, bits, block).weights()


class _Rewriter:
    def __init__(self, model: Any, index: _Index, accuracy_level: int, report: Report):
        from onnx import numpy_helper

        self.model, self.g = model, model.graph
        self.index, self.level, self.report = index, accuracy_level, report
        self.inits = {i.name: i for i in self.g.initializer}
        self.to_array = numpy_helper.to_array
        self.from_array = numpy_helper.from_array
        self._sums: dict[tuple[str, int], str] = {}  # (input, block) -> its per-block sums
        self.quantized: dict[str, tuple[str, str, str | None, str | None, Blocks]] = {}  # weight -> names

    def add_init(self, array: np.ndarray, name: str) -> str:
        self.g.initializer.append(self.from_array(array, name))
        return name

    def blocks_for(self, w: np.ndarray, what: str) -> Blocks | None:
        """The file's blocks for w [rows, cols] (None: float rows, left as they are)."""
        runs = self.index.find(w, what)
        floats = [s.name for s, _ in runs if s.blocks is None]
        if floats:
            if len(floats) < len(runs):
                raise ExportError(f"{what}: fuses float and quantized GGUF tensors; export with --precision fp32")
            return None
        parts = [s.blocks.rows(idx) for s, idx in runs]  # type: ignore[union-attr]
        for s, idx in runs:
            self.report.types[s.type_name] = self.report.types.get(s.type_name, 0) + len(idx) * w.shape[1]
        b = parts[0] if len(parts) == 1 else concat(parts)
        self.report.checked_weights += w.size
        return b

    def write_blocks(self, base: str, b: Blocks) -> tuple[str, str, str | None, str | None]:
        data, zero = _pack(b)
        names = (self.add_init(data, f"{base}_Q{b.bits}"), self.add_init(b.scale, f"{base}_scales"),
                 self.add_init(zero, f"{base}_zero_points") if zero is not None else None,
                 self.add_init(np.ascontiguousarray(b.offset.T), f"{base}_offsets") if b.offset is not None else None)
        back = _unpack_packed(data, b.scale, zero, b.bits, b.block, b.offset)
        if not np.array_equal(back.view(np.uint32), b.weights().view(np.uint32)):
            raise ExportError(f"{base}: the packed initializers do not give back the GGUF's weights")
        return names

    def block_sums(self, x: str, k: int, block: int, at: int) -> str:
        """Per-block sums of x [batch, seq, k] -> [batch, seq, k // block], computed once per input."""
        from onnx import helper

        key = (x, block)
        if key not in self._sums:
            base = f"{x}/block_sums_{block}"
            shape = self.add_init(np.array([0, 0, k // block, block], np.int64), f"{base}/shape")
            axes = self.add_init(np.array([-1], np.int64), f"{base}/axes")
            self.g.node.insert(at, helper.make_node("ReduceSum", [f"{base}/blocks", axes], [base], keepdims=0,
                                                    name=f"{base}/ReduceSum"))
            self.g.node.insert(at, helper.make_node("Reshape", [x, shape], [f"{base}/blocks"], name=f"{base}/Reshape"))
            self._sums[key] = base
        return self._sums[key]

    def matmul(self, node: Any) -> None:
        from onnx import helper

        weight = node.input[1]
        w = self.to_array(self.inits[weight]).T  # [N, K]: the builder stores x @ W^T's W^T
        b = self.blocks_for(w, f"{node.name} ({weight})")
        if b is None:
            self.report.float_nodes += 1
            return
        b = b.centred()
        n, k = b.shape
        qname, sname, zname, oname = self.write_blocks(weight, b)
        self.quantized[weight] = (qname, sname, zname, oname, b)
        at = list(self.g.node).index(node)
        out = node.output[0]
        mm_out = f"{out}/nbits" if oname else out
        inputs = [node.input[0], qname, sname] + ([zname] if zname else [])
        new = [helper.make_node("MatMulNBits", inputs, [mm_out], name=f"{node.name}_Q{b.bits}", domain=MS_DOMAIN,
                                K=k, N=n, bits=b.bits, block_size=b.block, accuracy_level=self.level)]
        if oname:
            sums = self.block_sums(node.input[0], k, b.block, at)
            at = list(self.g.node).index(node)
            new += [helper.make_node("MatMul", [sums, oname], [f"{out}/offsets"], name=f"{node.name}/offsets"),
                    helper.make_node("Add", [mm_out, f"{out}/offsets"], [out], name=f"{node.name}/add_offsets")]
            self.report.offset_nodes += 1
        self.g.node.remove(node)
        for i, nd in enumerate(new):
            self.g.node.insert(at + i, nd)
        self.report.nodes += 1

    def embedding(self, node: Any, producer: dict[str, Any]) -> None:
        """Gather of the token table -> GatherBlockQuantized over the file's blocks (the LM head's,
        when tied), plus the offsets gathered per row where the format has them."""
        from onnx import helper

        data, ids = node.input[0], node.input[1]
        src = producer.get(data)
        if src is not None and src.op_type == "Transpose" and src.input[0] in self.quantized:
            qname, sname, zname, oname, b = self.quantized[src.input[0]]
            self.report.embedding = "GatherBlockQuantized, shared with the LM head"
        elif data in self.inits:
            w = self.to_array(self.inits[data])
            found = self.blocks_for(w, f"{node.name} ({data})")
            if found is None:
                self.report.embedding = "Gather (float in the file)"
                return
            b = found
            qname, sname, zname, oname = self.write_blocks(data, b)
            self.report.embedding = "GatherBlockQuantized"
        else:
            return
        vocab, k = b.shape
        at = list(self.g.node).index(node)
        out = node.output[0]
        flat = f"{qname}/rows"
        shape = self.add_init(np.array([vocab, k * b.bits // 8], np.int64), f"{flat}/shape")
        gathered = f"{out}/blocks" if oname else out
        new = [helper.make_node("Reshape", [qname, shape], [flat], name=f"{flat}/Reshape"),
               helper.make_node("GatherBlockQuantized", [flat, ids, sname] + ([zname] if zname else []), [gathered],
                                name=f"{node.name}BlockQuantized", domain=MS_DOMAIN, bits=b.bits,
                                block_size=b.block, gather_axis=0, quantize_axis=1)]
        if oname:
            # offsets [vocab, blocks] gathered per id, each repeated over its block: [batch, seq, k]
            table = self.add_init(np.ascontiguousarray(b.offset), f"{data}_offset_rows")  # type: ignore[arg-type]
            expand = self.add_init(np.array([1, 1, 1, b.block], np.int64), f"{table}/expand")
            axes = self.add_init(np.array([-1], np.int64), f"{table}/axes")
            shape3 = self.add_init(np.array([0, 0, k], np.int64), f"{table}/shape")
            new += [helper.make_node("Gather", [table, ids], [f"{table}/g"], name=f"{table}/Gather"),
                    helper.make_node("Unsqueeze", [f"{table}/g", axes], [f"{table}/u"], name=f"{table}/Unsqueeze"),
                    helper.make_node("Expand", [f"{table}/u", expand], [f"{table}/e"], name=f"{table}/Expand"),
                    helper.make_node("Reshape", [f"{table}/e", shape3], [f"{table}/r"], name=f"{table}/Reshape"),
                    helper.make_node("Add", [gathered, f"{table}/r"], [out], name=f"{table}/Add")]
        self.g.node.remove(node)
        for i, nd in enumerate(new):
            self.g.node.insert(at + i, nd)

    def fuse_shared_inputs(self) -> None:
        """MatMulNBits nodes that read the same input with the same kernel settings (a gate and an
        up projection) -> one node over their rows stacked, and a Split giving each its own output
        back: the input is quantized once and the kernel called once (what that saves:
        docs/design.md). Each output column is the same dot product as before
        (tests/test_gguf.py compares every weight bit for bit). Nodes whose weights other nodes read
        too (a tied LM head) are left as they are."""
        from onnx import helper

        from edge_sd.export.logits import nbits_like

        readers: dict[str, int] = {}
        for n in self.g.node:
            for i in n.input:
                readers[i] = readers.get(i, 0) + 1
        groups: dict[tuple, list[Any]] = {}
        for n in self.g.node:
            if n.op_type != "MatMulNBits" or any(readers[w] != 1 for w in n.input[1:]):
                continue
            a = {t.name: helper.get_attribute_value(t) for t in n.attribute}
            key = (n.input[0], len(n.input), a["K"], a["bits"], a["block_size"], a.get("accuracy_level"))
            groups.setdefault(key, []).append(n)
        inits = {i.name: i for i in self.g.initializer}
        for nodes in (ns for ns in groups.values() if len(ns) > 1):
            name = _joined([n.name for n in nodes])
            sizes = [int(helper.get_node_attr_value(n, "N")) for n in nodes]
            stacked = []
            for pos, suffix in zip(range(1, len(nodes[0].input)), ("weight", "scales", "zero_points"), strict=False):
                arrays = [self.to_array(inits[n.input[pos]]) for n in nodes]
                stacked.append(self.add_init(np.concatenate(arrays, axis=0), f"{name}.{suffix}"))
                for n in nodes:
                    self.g.initializer.remove(inits[n.input[pos]])
            fused = nbits_like(nodes[0], [nodes[0].input[0], *stacked], f"{name}/output_0", name, sum(sizes))
            split = self.add_init(np.array(sizes, np.int64), f"{name}/split")
            at = min(list(self.g.node).index(n) for n in nodes)
            for n in nodes:
                self.g.node.remove(n)
            self.g.node.insert(at, helper.make_node("Split", [fused.output[0], split], [n.output[0] for n in nodes],
                                                    axis=-1, name=f"{name}/Split"))
            self.g.node.insert(at, fused)
            self.report.fused_nodes += 1

    def drop_unused(self) -> None:
        used = {i for n in self.g.node for i in n.input} | {o.name for o in self.g.output}
        for n in [n for n in self.g.node if n.op_type == "Transpose" and not set(n.output) & used]:
            self.g.node.remove(n)
        used = {i for n in self.g.node for i in n.input} | {o.name for o in self.g.output}
        for init in [i for i in self.g.initializer if i.name not in used]:
            self.g.initializer.remove(init)


def _joined(names: list[str]) -> str:
    """One name for nodes whose names differ in one path component: /a/gate_proj/M, /a/up_proj/M ->
    /a/gate_proj+up_proj/M (the names joined by "+" otherwise)."""
    parts = [n.split("/") for n in names]
    if len({len(p) for p in parts}) == 1:
        differ = [i for i in range(len(parts[0])) if len({p[i] for p in parts}) > 1]
        if len(differ) == 1:
            i = differ[0]
            return "/".join([*parts[0][:i], "+".join(p[i] for p in parts), *parts[0][i + 1:]])
    return "+".join(names)


def requantize(model_path: Path, gguf_path: Path, accuracy_level: int) -> dict:
    """Rewrite the fp32 graph at model_path (weights beside it) in place to compute with the GGUF
    file's quantized weights; returns the report's figures."""
    from onnx import helper

    from edge_sd.export.logits import load, save

    model = load(model_path)
    report = Report()
    rw = _Rewriter(model, _Index(gguf_path), accuracy_level, report)
    for node in [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in rw.inits]:
        if len(rw.inits[node.input[1]].dims) == 2:
            rw.matmul(node)
    producer = {o: n for n in model.graph.node for o in n.output}
    for node in [n for n in model.graph.node if n.op_type == "Gather"]:
        if node.input[1] == "input_ids" or "embed" in node.name:
            rw.embedding(node, producer)
    rw.fuse_shared_inputs()
    rw.drop_unused()
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    save(model, model_path)
    return report.to_dict()
