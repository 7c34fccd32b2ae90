"""Weight quantization of an exported engine with ONNX Runtime's own quantizers."""

from __future__ import annotations

import shutil
from pathlib import Path

from edge_sd.errors import ExportError

# MatMulNBits settings measured on the 2-core CPU machines (see REAL_MODELS.md): block 32, symmetric,
# accuracy level 4 (int8 activations) is the fast one; level 0 is slower than fp32 there.
QUANT_BLOCK = 32
QUANT_ACCURACY_LEVEL = 4


def quantize(folder: Path, precision: str) -> None:
    """Replace folder/model.onnx (and its external data) by a weight-quantized model."""
    src = folder / "model.onnx"
    out_dir = folder / "quantized"
    out_dir.mkdir()
    out = out_dir / "model.onnx"
    try:
        if precision in ("int8", "int4"):
            import onnx
            from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

            # Weight-only (MatMulNBits): activations are quantized per row and block, never over the
            # whole batch, so a k-token verification forward computes what k single steps compute.
            # Dynamic int8 quantization scales activations per tensor and breaks exactly that.
            q = MatMulNBitsQuantizer(onnx.load(str(src)), bits=int(precision[3:]), block_size=QUANT_BLOCK,
                                     is_symmetric=True, accuracy_level=QUANT_ACCURACY_LEVEL)
            q.process()
            onnx.save_model(q.model.model, str(out), save_as_external_data=True,
                            location="model.onnx_data")
        else:
            raise ExportError(f"no quantizer for {precision}")
    except ExportError:
        raise
    except Exception as e:
        raise ExportError(f"quantization to {precision} failed: {e}") from None
    for f in folder.glob("model.onnx*"):
        f.unlink()
    for f in out_dir.iterdir():
        shutil.move(str(f), folder / f.name)
    out_dir.rmdir()
